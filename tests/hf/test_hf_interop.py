"""Hugging Face interop around the weights: tokenizers both ways, special-token ids, the files an
export writes, export -> import -> export identity, the local HF cache, fine-tuning with
--init-from, and one end-to-end test of a transformers user's round trip. Nothing is downloaded.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig  # noqa: E402

from glasslm.presets import get_preset# noqa: E402
from glasslm.hf import export_hf, import_hf, load_model  # noqa: E402
from glasslm.core.model import TransformerLM  # noqa: E402
from glasslm.tokenizers import (  # noqa: E402
    CharTokenizer, HFTokenizer, gpt2_tokenizer, load_tokenizer, read_hf_tokenizer, save_hf_tokenizer,
    special_token_ids, train_tokenizer_from_text,
)

# Text that trips tokenizers: combining marks, zero-width and BOM characters, emoji sequences
# (with a zero-width joiner), CJK, control characters, CRLF, runs of spaces and newlines,
# special-token strings glued to text and cut in half.
TORTURE = [
    "Hello world, it's 2026 \u2014 caf\u00e9 na\u00efve \u00c5ngstr\u00f6m",
    "e\u0301 \u200b\ufeff \U0001F600\U0001F468\u200d\U0001F469\u200d\U0001F467 \u65e5\u672c\u8a9e \ud55c\uad6d\uc5b4",
    "tabs\tand\r\nCRLF \x00\x07\x7f  \n\n\n   trailing   ",
    "<|endoftext|>glued<|endoftext|><|endoftext|> and cut <|endoftext| <|endo",
    "  leading spaces, 'quotes' \"double\" don't I'll we've 12345 3.14159 ...!!!???",
]


def run_cli(*args, env=None, check=True):
    result = subprocess.run([sys.executable, "-m", "glasslm.cli", *map(str, args)], capture_output=True,
                            text=True, env={**os.environ, **(env or {})}, timeout=300)
    if check:
        assert result.returncode == 0, result.stderr
    return result


def glasslm_tokenizer(kind: str, text: str, data_dir: Path):
    if kind == "char":
        return CharTokenizer.from_text(text + "".join(TORTURE))
    if kind == "gpt2":
        return gpt2_tokenizer(data_dir, backend="glasslm")
    return train_tokenizer_from_text(text[:30_000], vocab_size=320)


# --- tokenizers ------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["char", "gpt2", "bpe"])
def test_every_glasslm_tokenizer_saves_as_files_autotokenizer_loads(kind, tmp_path, shakespeare_text, data_dir):
    text = shakespeare_text[:40_000]
    tokenizer = glasslm_tokenizer(kind, text, data_dir)
    save_hf_tokenizer(tokenizer, tmp_path)
    auto = AutoTokenizer.from_pretrained(tmp_path)
    ours_again = load_tokenizer(tmp_path)  # glasslm reads the tokenizer.json back (through `tokenizers`)
    assert isinstance(ours_again, HFTokenizer)
    for sample in [text, *TORTURE]:
        ids = tokenizer.encode(sample)
        assert auto.encode(sample, add_special_tokens=False) == ids
        assert ours_again.encode(sample) == ids
        assert auto.decode(ids) == ours_again.decode(ids) == tokenizer.decode(ids)
    roles = special_token_ids(tokenizer)
    assert (auto.bos_token_id, auto.eos_token_id, auto.pad_token_id) == (roles["bos"], roles["eos"], roles["pad"])
    assert auto.eos_token == "<|endoftext|>" and roles["eos"] == tokenizer.special_tokens["<|endoftext|>"]
    if kind == "char":  # the end-of-text follows the characters, and its text encodes to it
        assert roles == {"bos": tokenizer.vocab_size - 1, "eos": tokenizer.vocab_size - 1, "pad": None, "unk": None}
        assert auto.encode("ROMEO:", add_special_tokens=False) == tokenizer.encode("ROMEO:") != []
        assert auto.encode("a<|endoftext|>", add_special_tokens=False) == tokenizer.encode("a") + [roles["eos"]]


def test_a_char_tokenizer_from_before_end_of_text_exports_without_special_tokens(tmp_path, shakespeare_text):
    tokenizer = CharTokenizer(sorted(set(shakespeare_text)))  # as an old tokenizer.json loads: no specials
    save_hf_tokenizer(tokenizer, tmp_path)
    auto = AutoTokenizer.from_pretrained(tmp_path)
    assert (auto.bos_token_id, auto.eos_token_id, auto.pad_token_id) == (None, None, None)
    assert len(auto) == tokenizer.vocab_size == 65
    assert auto.encode("ROMEO:\n", add_special_tokens=False) == tokenizer.encode("ROMEO:\n")


def llama_style_tokenizer(text: str):
    """A Llama-2-style tokenizer built with `tokenizers`: BPE over '▁'-marked words with byte fallback
    (<0x00>..<0xFF> for characters outside the vocabulary), <unk>/<s>/</s> special tokens."""
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.train_from_iterator(text.splitlines(), trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"]))
    data = json.loads(tok.to_str())
    vocab = data["model"]["vocab"]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    return Tokenizer.from_str(json.dumps(data))


def transformers_user_model(tmp_path: Path, text: str) -> tuple[Path, torch.nn.Module]:
    """What a transformers 5 user has: a Llama and its tokenizer, both saved with save_pretrained."""
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(tokenizer_object=llama_style_tokenizer(text), bos_token="<s>",
                                        eos_token="</s>", unk_token="<unk>")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    model = LlamaForCausalLM(config).eval()
    directory = tmp_path / "user"
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory, model


def test_transformers5_saved_model_imports_with_its_tokenizer_and_generates(tmp_path, shakespeare_text):
    directory, _ = transformers_user_model(tmp_path, shakespeare_text[:20_000])
    assert (directory / "tokenizer.json").is_file() and not (directory / "vocab.json").exists()
    model, tokenizer = load_model(directory)
    assert tokenizer is not None and tokenizer.vocab_size == model.config.vocab_size
    auto = AutoTokenizer.from_pretrained(directory)
    for sample in [shakespeare_text[:3000], *TORTURE]:  # the torture set needs the byte fallback
        ids = tokenizer.encode(sample)
        assert ids == auto.encode(sample, add_special_tokens=False)
        assert tokenizer.decode(ids) == auto.decode(ids)
    assert special_token_ids(tokenizer)["eos"] == auto.eos_token_id
    # (`glasslm generate --checkpoint` on such a directory: see the end-to-end test.)


def test_gpt2_tokenizer_saved_by_transformers5_reads_back(tmp_path, data_dir):
    from transformers import GPT2Tokenizer

    from glasslm.tokenizers import find_gpt2_files

    vocab, merges = find_gpt2_files(data_dir)
    GPT2Tokenizer(str(vocab), str(merges)).save_pretrained(tmp_path)
    assert not (tmp_path / "merges.txt").exists()
    ours, reference = read_hf_tokenizer(tmp_path), gpt2_tokenizer(data_dir, backend="glasslm")
    for sample in TORTURE:
        assert ours.encode(sample) == reference.encode(sample)
    assert special_token_ids(ours)["eos"] == 50256


def test_sentencepiece_tokenizer_model(tmp_path, shakespeare_text, monkeypatch):
    import io

    spm = pytest.importorskip("sentencepiece")
    buffer = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(shakespeare_text[:50_000].splitlines()), model_writer=buffer,
                                   vocab_size=400, byte_fallback=True, model_type="bpe", minloglevel=2)
    (tmp_path / "tokenizer.model").write_bytes(buffer.getvalue())
    tokenizer = read_hf_tokenizer(tmp_path)
    assert tokenizer.kind == "sentencepiece" and tokenizer.vocab_size == 400
    for sample in ["ROMEO: O, she doth teach the torches to burn bright!", "caf\u00e9 \u65e5\u672c\u8a9e \U0001F600"]:
        ids = tokenizer.encode(sample)  # characters outside the 400 pieces fall back to bytes
        assert ids == spm.SentencePieceProcessor(model_proto=buffer.getvalue()).encode(sample)
        assert max(ids) < 400 and tokenizer.decode(ids) == sample
    assert special_token_ids(tokenizer)["bos"] == 1 and special_token_ids(tokenizer)["eos"] == 2
    monkeypatch.setitem(sys.modules, "sentencepiece", None)  # as if it were not installed
    with pytest.raises(ImportError, match="pip install sentencepiece"):
        read_hf_tokenizer(tmp_path)


# --- export ----------------------------------------------------------------------------------------

@torch.no_grad()
def test_exported_char_model_has_its_tokenizer_and_its_end_of_text(tmp_path, shakespeare_text):
    tokenizer = CharTokenizer.from_text(shakespeare_text)
    end = tokenizer.special_tokens["<|endoftext|>"]
    model = TransformerLM(get_preset("shakespeare-char-cpu-nanogpt", n_layers=1, vocab_size=tokenizer.vocab_size)).eval()
    out = export_hf(model, tmp_path / "hf", tokenizer, {"data": "tinyshakespeare", "step": 5000, "val_loss": 1.4697},
                    zero_biases=True)
    auto = AutoTokenizer.from_pretrained(out)
    ids = auto.encode("ROMEO:\nWhat say'st thou?", add_special_tokens=False)
    assert ids == tokenizer.encode("ROMEO:\nWhat say'st thou?")  # before: GPT2Tokenizer, "ROMEO:" -> []
    hf_model = AutoModelForCausalLM.from_pretrained(out).eval()
    # Before: 50256 on a 65-token vocabulary; then none at all, which lm-eval's hf model cannot stop on.
    assert (hf_model.config.bos_token_id, hf_model.config.eos_token_id, hf_model.config.pad_token_id) == (end, end, None)
    assert end == tokenizer.vocab_size - 1 == len(set(shakespeare_text))
    assert GenerationConfig.from_pretrained(out).eos_token_id == end and auto.eos_token_id == end
    old = export_hf(model, tmp_path / "old", CharTokenizer(tokenizer.chars), zero_biases=True)  # a pre-eos tokenizer
    assert GenerationConfig.from_pretrained(old).eos_token_id is None
    assert AutoModelForCausalLM.from_pretrained(old).config.eos_token_id is None
    torch.testing.assert_close(hf_model(torch.tensor([ids])).logits, model(torch.tensor([ids])), atol=1e-5, rtol=0)
    card = (out / "README.md").read_text()
    assert f"{model.num_parameters():,}" in card and "tinyshakespeare" in card and "1.4697" in card and "5000" in card


def test_exported_llama_names_the_trained_bpe_end_of_text(tmp_path, shakespeare_text):
    tokenizer = train_tokenizer_from_text(shakespeare_text[:30_000], vocab_size=300)
    end = tokenizer.special_tokens["<|endoftext|>"]
    model = TransformerLM(get_preset("llama-tiny", n_layers=1, vocab_size=tokenizer.vocab_size))
    out = export_hf(model, tmp_path / "hf", tokenizer)
    config = AutoModelForCausalLM.from_pretrained(out).config
    assert config.bos_token_id == config.eos_token_id == end != 2  # before: Llama's defaults 1 and 2
    assert GenerationConfig.from_pretrained(out).eos_token_id == end
    auto = AutoTokenizer.from_pretrained(out)
    assert auto.eos_token == "<|endoftext|>" and auto.eos_token_id == end
    assert auto.encode(TORTURE[3], add_special_tokens=False) == tokenizer.encode(TORTURE[3])


ROUND_TRIP = {
    "gpt2-biases": dict(preset="gpt2-small", n_layers=1, d_model=32, n_heads=4, context_length=32),
    "char-bias-free": dict(preset="shakespeare-char-cpu-nanogpt", n_layers=1),
    "llama": dict(preset="llama-tiny", n_layers=1),
    "llama-biases": dict(preset="llama-tiny", n_layers=1, bias=True),
    "qwen2-like": dict(preset="llama-tiny", n_layers=1, attn_qkv_bias=True, d_head=24, tie_embeddings=True),
    "mistral-like": dict(preset="llama-tiny", n_layers=1, sliding_window=16),
    "llama3-scaled": dict(preset="llama-tiny", n_layers=1, rope_scaling="llama3", rope_original_context=64),
}


@pytest.mark.parametrize("case", ROUND_TRIP)
@torch.no_grad()
def test_export_import_export_is_byte_identical(case, tmp_path, shakespeare_text):
    settings = dict(ROUND_TRIP[case])
    tokenizer = CharTokenizer.from_text(shakespeare_text)
    model = TransformerLM(get_preset(settings.pop("preset"), vocab_size=tokenizer.vocab_size, **settings)).eval()
    with torch.no_grad():
        for p in model.parameters():  # biases must survive, so none may be zero
            p.normal_(0.0, 0.1)
    first = export_hf(model, tmp_path / "first", tokenizer, zero_biases=True)
    back, back_tokenizer = load_model(first)
    assert back.config == model.config and back.num_parameters() == model.num_parameters()  # bias flags kept
    for name, tensor in model.state_dict().items():
        assert torch.equal(back.state_dict()[name], tensor), name
    second = export_hf(back, tmp_path / "second", back_tokenizer, zero_biases=True)
    for name in ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (first / name).read_bytes() == (second / name).read_bytes(), name
    tokens = torch.randint(0, tokenizer.vocab_size, (1, 24))
    hf_logits = AutoModelForCausalLM.from_pretrained(first).eval()(tokens).logits
    torch.testing.assert_close(hf_logits, model(tokens), atol=1e-5, rtol=0)


# --- the local Hugging Face cache ------------------------------------------------------------------

def fake_hub_cache(root: Path, name: str, model_dir: Path) -> Path:
    """models--org--name/{refs/main, snapshots/<rev>/...} as huggingface_hub lays it out."""
    import shutil

    repo = root / ("models--" + name.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0123abcd")
    shutil.copytree(model_dir, repo / "snapshots" / "0123abcd")
    return repo / "snapshots" / "0123abcd"


@torch.no_grad()
def test_hub_names_resolve_from_the_local_cache_only(tmp_path, shakespeare_text, monkeypatch):
    tokenizer = CharTokenizer.from_text(shakespeare_text)
    model = TransformerLM(get_preset("llama-tiny", n_layers=1, vocab_size=tokenizer.vocab_size)).eval()
    fake_hub_cache(tmp_path / "hf-home" / "hub", "someorg/tiny", export_hf(model, tmp_path / "export", tokenizer))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    loaded, loaded_tokenizer = load_model("someorg/tiny")
    tokens = torch.tensor([tokenizer.encode("ROMEO:")])
    assert torch.equal(loaded(tokens), model(tokens))
    assert loaded_tokenizer.encode("ROMEO:") == tokenizer.encode("ROMEO:")
    expected_path = tmp_path / "hf-home" / "hub" / "models--someorg--absent"
    with pytest.raises(FileNotFoundError, match=str(expected_path)):
        load_model("someorg/absent")
    # $HF_HUB_CACHE wins over $HF_HOME.
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-home" / "hub"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "nowhere"))
    assert torch.equal(load_model("someorg/tiny")[0](tokens), model(tokens))
    # The CLI resolves names the same way, offline, and says where it looked.
    env = {"HF_HUB_CACHE": str(tmp_path / "hf-home" / "hub"), "HF_HUB_OFFLINE": "1"}
    missing = run_cli("generate", "--checkpoint", "gpt2", "--prompt", "x", env=env, check=False)
    assert missing.returncode == 1 and str(tmp_path / "hf-home" / "hub" / "models--gpt2") in missing.stderr
    assert "Traceback" not in missing.stderr


# --- fine-tuning and info --------------------------------------------------------------------------

@pytest.mark.slow
def test_info_and_init_from_refuse_a_different_vocabulary(tmp_path, shakespeare_text, data_dir, capsys):
    tokenizer = CharTokenizer.from_text(shakespeare_text)
    model = TransformerLM(get_preset("llama-tiny", n_layers=1, vocab_size=tokenizer.vocab_size))
    hf_dir = export_hf(model, tmp_path / "hf", tokenizer)
    info = run_cli("info", "--checkpoint", hf_dir).stdout
    assert "Hugging Face directory" in info and f"{model.num_parameters():,}" in info and f"{tokenizer.vocab_size} tokens" in info
    from glasslm.cli import main

    (tmp_path / "other.txt").write_text("plain ascii text, a little of it. " * 400)
    assert main(["prepare", str(tmp_path / "other.txt"), "--tokenizer", "gpt2", "--out", str(tmp_path / "prepared"),
                 "--quiet", "--data-dir", str(data_dir)]) == 0
    result = run_cli("train", "--init-from", hf_dir, "--data", tmp_path / "prepared", "--max-steps", "1",
                     "--out", tmp_path / "run", check=False)
    assert result.returncode == 1 and "different vocabulary" in result.stderr and "Traceback" not in result.stderr
    assert main(["train", "--init-from", str(hf_dir), "--data", str(tmp_path / "other.txt"), "--n-layers", "3",
                 "--out", str(tmp_path / "run")]) == 1
    assert "keeps the pretrained architecture" in capsys.readouterr().err


# --- the whole round trip --------------------------------------------------------------------------

@pytest.mark.slow
@torch.no_grad()
def test_transformers_user_round_trip_end_to_end(tmp_path, shakespeare_text):
    """save_pretrained -> glasslm generate -> train --init-from -> convert --to-hf -> transformers,
    with the same ids and logits at each step."""
    text = shakespeare_text[:20_000]
    user_dir, hf_model = transformers_user_model(tmp_path, text)
    auto = AutoTokenizer.from_pretrained(user_dir)
    sample = "ROMEO:\nO, she doth teach the torches to burn bright! \u00e9\U0001F600"

    # 1. glasslm reads the user's directory: same ids, same logits, same greedy tokens.
    model, tokenizer = load_model(user_dir)
    ids = tokenizer.encode(sample)
    assert ids == auto.encode(sample, add_special_tokens=False)
    tokens = torch.tensor([ids])
    torch.testing.assert_close(model(tokens), hf_model(tokens).logits, atol=1e-5, rtol=0)
    hf_greedy = hf_model.generate(tokens[:, :6], max_new_tokens=10, do_sample=False, eos_token_id=None,
                                  pad_token_id=0)[0, 6:].tolist()
    from glasslm.generation import generate_tokens

    assert list(generate_tokens(model, ids[:6], 10, temperature=0.0)) == hf_greedy
    prompt = auto.decode(ids[:6])
    generated = run_cli("generate", "--checkpoint", user_dir, "--prompt", prompt, "--max-new-tokens", "10",
                        "--temperature", "0").stdout
    assert generated.rstrip("\n") == auto.decode(ids[:6] + hf_greedy)

    # 2. Fine-tune from it: a new run directory, the weights move.
    (tmp_path / "text.txt").write_text(text)
    run_cli("train", "--init-from", user_dir, "--data", tmp_path / "text.txt", "--max-steps", "3",
            "--batch-size", "2", "--eval-interval", "0", "--eval-iters", "1", "--out", tmp_path / "run",
            "--sample-tokens", "0", "--no-progress")
    tuned, tuned_tokenizer = load_model(tmp_path / "run")
    assert not torch.equal(tuned.embed.weight, model.embed.weight)
    assert tuned_tokenizer.encode(sample) == ids

    # 3. Export and load back with transformers: same ids, same logits, same greedy tokens.
    run_cli("convert", "--to-hf", "--checkpoint", tmp_path / "run", "--out", tmp_path / "exported")
    hf_tuned = AutoModelForCausalLM.from_pretrained(tmp_path / "exported").eval()
    auto_tuned = AutoTokenizer.from_pretrained(tmp_path / "exported")
    assert auto_tuned.encode(sample, add_special_tokens=False) == ids
    assert auto_tuned.decode(ids) == auto.decode(ids)
    assert (hf_tuned.config.bos_token_id, hf_tuned.config.eos_token_id) == (auto.bos_token_id, auto.eos_token_id)
    torch.testing.assert_close(hf_tuned(tokens).logits, tuned(tokens), atol=1e-5, rtol=0)
    hf_greedy = hf_tuned.generate(tokens[:, :6], max_new_tokens=10, do_sample=False, eos_token_id=None,
                                  pad_token_id=0)[0, 6:].tolist()
    assert list(generate_tokens(tuned, ids[:6], 10, temperature=0.0)) == hf_greedy
