"""lm-eval's own `local-completions` against `glasslm serve` on a model whose embedding table is padded past its
tokenizer (issue 36: lm-eval died after 32 of 200 requests): 200 requests, 100 scored with logprobs and 100
sampled at temperature 1.5 with 20 alternatives per token, all answered; the scores equal transformers'
log-softmax of the same model. lm-eval reads the tokenizer from the server (`tokenizer_backend=remote`:
/tokenizer_info, /tokenize, /detokenize), or, since it is GPT-2's, through tiktoken under tiktoken's
model name `gpt2` whatever the served name."""

import json
import math
import os

import pytest
import torch

pytest.importorskip("lm_eval")
pytest.importorskip("fastapi")

from glasslm.generation import generate  # noqa: E402
from glasslm.hf import load_model  # noqa: E402
from glasslm.serving.app import create_app  # noqa: E402
from glasslm.serving.config import ServeConfig  # noqa: E402
from glasslm.serving.server import serving_in_thread  # noqa: E402

WORDS = ["cat", "dog", "bird", "tree", "house", "river", "stone", "cloud", "light", "sound"]
CHOICE = """output_type: multiple_choice
doc_to_text: "{{question}}"
doc_to_choice: "{{choices}}"
doc_to_target: answer
metric_list:
  - metric: acc
"""
SAMPLED = """output_type: generate_until
doc_to_text: "{{question}}"
doc_to_target: "{{choices[0]}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 6
  do_sample: true
  temperature: 1.5
  logprobs: 20
metric_list:
  - metric: exact_match
"""


def _tasks(folder, docs: int = 100) -> None:
    rows = [{"question": f"Question {i}: the {WORDS[i % 10]} is", "choices": ["red", "blue"], "answer": i % 2}
            for i in range(docs)]
    (folder / "docs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "half.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:docs // 2]))
    for name, body, data in (("pad_choice", CHOICE, "half.jsonl"), ("pad_sampled", SAMPLED, "docs.jsonl")):
        (folder / f"{name}.yaml").write_text(f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
                                             f"    test: {folder / data}\ntest_split: test\n{body}")


def _evaluate(url: str, folder, tasks: list[str], model_args: str):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    return simple_evaluate(model="local-completions", tasks=tasks, batch_size=8, log_samples=True,
                           model_args=f"base_url={url}/v1/completions,max_length=129,max_retries=1,{model_args}",
                           task_manager=TaskManager(include_path=str(folder)), random_seed=1234,
                           numpy_random_seed=1234, torch_random_seed=1234, fewshot_random_seed=1234)


def _scores(results) -> list[float]:
    """Each choice's log-likelihood, doc by doc."""
    return [resp[0][0] for sample in results["samples"]["pad_choice"] for resp in sample["resps"]]


@pytest.mark.slow
def test_200_requests_with_logprobs_and_sampling_at_temperature_1_5_all_answered(padded_qwen3, tmp_path,
                                                                                  monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    directory, hf_model, hf_tok = padded_qwen3
    _tasks(tmp_path)
    model, tokenizer = load_model(directory)
    app = create_app(model, tokenizer, ServeConfig(name="padded", max_batch=8))
    with serving_in_thread(app) as url:
        remote = _evaluate(url, tmp_path, ["pad_choice", "pad_sampled"], "model=padded,tokenizer_backend=remote")
        cache = os.environ.get("TIKTOKEN_CACHE_DIR") or str(os.path.join(os.environ.get("GLASSLM_DATA_DIR", ""),
                                                                         "tiktoken_cache"))
        if os.path.isdir(cache):
            monkeypatch.setenv("TIKTOKEN_CACHE_DIR", cache)
            tiktoken = _evaluate(url, tmp_path, ["pad_choice"], "model=gpt2,tokenizer_backend=tiktoken")
        else:
            tiktoken = None
    stats = app.state.engine.stats
    assert stats["completed"] >= 200 and stats["largest_batch"] > 1
    samples = remote["samples"]["pad_sampled"]
    assert len(samples) == 100 and all(s["resps"][0][0] for s in samples)  # every one answered
    for sample in samples[:4]:  # lm-eval seeds every request 1234: the library's draw with that seed
        prompt = tokenizer.encode(sample["doc"]["question"])
        drawn = generate(model, [prompt], max_new_tokens=6, temperature=1.5, seed=1234, stop_strings=["\n"],
                         tokenizer=tokenizer)[0]
        assert sample["resps"][0][0] == drawn.text and all(t < len(hf_tok) for t in drawn.tokens)
    scores = _scores(remote)
    assert len(scores) == 100
    for sample, pair in zip(remote["samples"]["pad_choice"][:6], zip(scores[::2], scores[1::2])):  # transformers'
        context = hf_tok.encode(sample["doc"]["question"])
        for choice, score in zip(sample["doc"]["choices"], pair):
            ids = context + hf_tok.encode(" " + choice)  # lm-eval puts its target_delimiter " " between
            with torch.no_grad():
                log_probs = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), dim=-1)
            expected = float(log_probs[len(context) - 1:-1].gather(1, torch.tensor(ids[len(context):])[:, None]).sum())
            assert math.isclose(score, expected, abs_tol=1e-4), (choice, score, expected)
    if tiktoken is None:
        pytest.skip("no tiktoken cache ($GLASSLM_DATA_DIR/tiktoken_cache): the tiktoken half was not run")
    assert _scores(tiktoken) == pytest.approx(scores, abs=1e-5)  # tiktoken's GPT-2 ids are the server's
