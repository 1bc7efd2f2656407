"""Interop with Hugging Face transformers: logits parity, greedy parity, lossless round trips, errors.

Every HF model here is built from a tiny random config and saved to a temporary directory:
nothing is downloaded.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM  # noqa: E402

from glasslm.io.checkpoint import save_checkpoint  # noqa: E402
from glasslm.presets import get_preset# noqa: E402
from glasslm.generation import generate_tokens  # noqa: E402
from glasslm.hf import (  # noqa: E402
    UnsupportedModelError,
    adjacent_pairs_to_hf_rows,
    config_from_hf,
    export_hf,
    hf_rows_to_adjacent_pairs,
    import_hf,
    load_model,
)
from glasslm.core.model import TransformerLM  # noqa: E402

VOCAB = 101


def gpt2_config(tied: bool) -> GPT2Config:
    return GPT2Config(vocab_size=VOCAB, n_positions=48, n_embd=32, n_layer=2, n_head=4,
                      tie_word_embeddings=tied, bos_token_id=None, eos_token_id=None)


def llama_config(tied: bool, n_kv_heads: int) -> LlamaConfig:
    return LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=72, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=n_kv_heads, max_position_embeddings=64,
                       rope_theta=5000.0, rms_norm_eps=1e-5, tie_word_embeddings=tied,
                       bos_token_id=None, eos_token_id=None, pad_token_id=None)


CASES = {
    "gpt2-tied": lambda: gpt2_config(tied=True),
    "gpt2-untied": lambda: gpt2_config(tied=False),
    "llama-mha-tied": lambda: llama_config(tied=True, n_kv_heads=4),
    "llama-gqa-untied": lambda: llama_config(tied=False, n_kv_heads=2),
    "llama-mqa-tied": lambda: llama_config(tied=True, n_kv_heads=1),
}


def random_hf_model(config):
    """An HF model with weights large enough that logits are O(1) and argmaxes are not near-ties."""
    torch.manual_seed(0)
    cls = GPT2LMHeadModel if config.model_type == "gpt2" else LlamaForCausalLM
    model = cls(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "ln_" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.25)
    return model


def hf_saved(config, tmp_path, **save_kwargs):
    model = random_hf_model(config)
    directory = tmp_path / "hf"
    model.save_pretrained(directory, **save_kwargs)
    return model, directory


def greedy(forward, prompt: torch.Tensor, n: int) -> list[int]:
    """Greedy decoding by full forward passes (no cache), for any model mapping tokens -> logits."""
    tokens = prompt.clone()
    for _ in range(n):
        next_id = forward(tokens)[:, -1].argmax(-1, keepdim=True)
        tokens = torch.cat([tokens, next_id], dim=1)
    return tokens[0, prompt.shape[1]:].tolist()


@pytest.mark.parametrize("case", CASES)
@torch.no_grad()
def test_import_matches_hf_logits_and_greedy_tokens(case, tmp_path):
    hf_model, directory = hf_saved(CASES[case](), tmp_path)
    model = import_hf(directory)
    tokens = torch.randint(0, VOCAB, (3, 24), generator=torch.Generator().manual_seed(1))
    expected = hf_model(tokens).logits
    assert expected.abs().max() > 1.0  # the comparison is not trivially between near-zero numbers
    torch.testing.assert_close(model(tokens), expected, atol=1e-5, rtol=0)

    prompt = tokens[:1, :4]
    hf_tokens = greedy(lambda t: hf_model(t).logits, prompt, 20)
    assert greedy(model, prompt, 20) == hf_tokens
    # Our KV-cached generator agrees with the full-forward loop too.
    assert list(generate_tokens(model, prompt[0].tolist(), 20, temperature=0.0)) == hf_tokens


@pytest.mark.parametrize("case", CASES)
@torch.no_grad()
def test_export_loads_in_transformers_and_round_trip_is_lossless(case, tmp_path):
    config = CASES[case]()
    hf_model, directory = hf_saved(config, tmp_path)
    model = import_hf(directory)
    exported = export_hf(model, tmp_path / "exported")

    cls = type(hf_model)
    reloaded = cls.from_pretrained(exported).eval()
    tokens = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(reloaded(tokens).logits, hf_model(tokens).logits, atol=1e-5, rtol=0)
    assert reloaded.config.tie_word_embeddings == config.tie_word_embeddings

    again = import_hf(exported)
    before, after = model.state_dict(), again.state_dict()
    assert before.keys() == after.keys()
    for name in before:
        assert torch.equal(before[name], after[name]), name


def test_rotary_row_permutation_is_inverted_by_export():
    weight = torch.arange(2 * 8 * 3, dtype=torch.float32).reshape(16, 3)  # 2 heads of d_head 8
    ours = hf_rows_to_adjacent_pairs(weight, n_heads=2)
    # Head 0: our rows 0,1 are HF rows 0 and 4 (feature i pairs with i + d_head/2 in HF).
    assert torch.equal(ours[0], weight[0]) and torch.equal(ours[1], weight[4])
    assert torch.equal(ours[8 + 3], weight[8 + 5])  # head 1, our row 3 = pair 1's second = HF row 1 + 4
    assert torch.equal(adjacent_pairs_to_hf_rows(ours, n_heads=2), weight)


@torch.no_grad()
def test_sharded_safetensors_and_pytorch_bin(tmp_path):
    hf_model, directory = hf_saved(llama_config(tied=False, n_kv_heads=2), tmp_path, max_shard_size="20KB")
    assert (directory / "model.safetensors.index.json").is_file()
    tokens = torch.randint(0, VOCAB, (1, 10))
    expected = hf_model(tokens).logits
    torch.testing.assert_close(import_hf(directory)(tokens), expected, atol=1e-5, rtol=0)

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    torch.save(hf_model.state_dict(), bin_dir / "pytorch_model.bin")
    (bin_dir / "config.json").write_text((directory / "config.json").read_text())
    torch.testing.assert_close(import_hf(bin_dir)(tokens), expected, atol=1e-5, rtol=0)


@torch.no_grad()
def test_bias_free_gpt2_shaped_model_exports_only_with_explicit_zero_biases(tmp_path):
    model = TransformerLM(get_preset("shakespeare-char-cpu-nanogpt", n_layers=2)).eval()
    with pytest.raises(UnsupportedModelError, match="GPT-2 always has biases.*zero-biases"):
        export_hf(model, tmp_path / "refused")
    exported = export_hf(model, tmp_path / "hf", zero_biases=True)
    hf_model = GPT2LMHeadModel.from_pretrained(exported).eval()
    tokens = torch.randint(0, 65, (2, 20))
    torch.testing.assert_close(hf_model(tokens).logits, model(tokens), atol=1e-5, rtol=0)
    # Re-imported, it is bias-free again: same parameters (804,096 -> 809,856 before the fix).
    back = import_hf(exported)
    assert back.config.bias is False and back.num_parameters() == model.num_parameters()
    assert back.state_dict().keys() == model.state_dict().keys()
    # Biases changed in transformers (no longer zero) are not silently dropped.
    hf_model.transformer.h[0].attn.c_attn.bias.fill_(0.5)
    hf_model.save_pretrained(tmp_path / "tuned")
    with pytest.raises(ValueError, match="c_attn.bias is not zero"):
        import_hf(tmp_path / "tuned")


def test_gpt2_small_preset_has_exactly_hf_gpt2_shapes_and_parameters():
    with torch.device("meta"):
        hf_model = GPT2LMHeadModel(GPT2Config())
        ours = TransformerLM(get_preset("gpt2-small"))
    hf_count = sum(p.numel() for p in hf_model.parameters())
    assert hf_count == ours.num_parameters() == 124_439_808
    hf_shapes = {n: tuple(p.shape) for n, p in hf_model.state_dict().items() if not n.endswith("attn.bias")}
    ours_shapes = {n: tuple(p.shape) for n, p in ours.state_dict().items()}
    # Conv1D stores (d_in, d_out); ours (d_out, d_in).
    assert hf_shapes["transformer.h.0.attn.c_attn.weight"][::-1] == ours_shapes["blocks.0.attn.qkv.weight"]
    assert hf_shapes["transformer.h.0.mlp.c_fc.weight"][::-1] == ours_shapes["blocks.0.mlp.up.weight"]
    assert hf_shapes["transformer.wte.weight"] == ours_shapes["embed.weight"]
    assert hf_shapes["transformer.wpe.weight"] == ours_shapes["pos_embed.weight"]


# --- errors ----------------------------------------------------------------------------------------

def _write_config(directory, data):
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(data))


def test_unsupported_hf_configs_are_named(tmp_path):
    _, directory = hf_saved(llama_config(tied=False, n_kv_heads=2), tmp_path)
    data = json.loads((directory / "config.json").read_text())
    data["rope_parameters"] = {"rope_type": "longrope", "factor": 2.0, "rope_theta": 10000.0}
    (directory / "config.json").write_text(json.dumps(data))
    with pytest.raises(UnsupportedModelError, match="rope scaling 'longrope'"):
        import_hf(directory)
    _write_config(tmp_path / "bert", {"model_type": "bert", "architectures": ["BertModel"]})
    with pytest.raises(UnsupportedModelError, match="model_type='bert'"):
        import_hf(tmp_path / "bert")
    # Attention biases without MLP biases were refused before ModelConfig had per-site bias switches.
    biased, family = config_from_hf({**data, "rope_parameters": None, "attention_bias": True, "mlp_bias": False})
    assert family == "llama" and [biased.site_bias(site) for site in ("qkv", "out", "mlp")] == [True, True, False]


def test_missing_unexpected_and_misshaped_tensors_are_named(tmp_path):
    from safetensors.torch import load_file, save_file

    _, directory = hf_saved(gpt2_config(tied=True), tmp_path)
    weights = load_file(directory / "model.safetensors")
    config_text = (directory / "config.json").read_text()

    def write(name, tensors):
        target = tmp_path / name
        target.mkdir()
        (target / "config.json").write_text(config_text)
        save_file(tensors, target / "model.safetensors")
        return target

    fewer = {k: v for k, v in weights.items() if k != "transformer.h.1.mlp.c_fc.weight"}
    with pytest.raises(ValueError, match=r"missing tensors \['transformer.h.1.mlp.c_fc.weight'\]"):
        import_hf(write("missing", fewer))
    with pytest.raises(ValueError, match=r"unexpected tensors \['transformer.h.9.extra'\]"):
        import_hf(write("extra", {**weights, "transformer.h.9.extra": torch.zeros(1)}))
    wrong = {**weights, "transformer.wpe.weight": torch.zeros(40, 32)}
    with pytest.raises(ValueError, match=r"pos_embed.weight has shape \(40, 32\), the model expects \(48, 32\)"):
        import_hf(write("shape", wrong))
    no_weights = tmp_path / "no-weights"
    no_weights.mkdir()
    (no_weights / "config.json").write_text(config_text)
    with pytest.raises(FileNotFoundError, match="no weights"):
        import_hf(no_weights)


def test_export_outside_both_families_is_refused(tmp_path):
    vaswani = TransformerLM(get_preset("vaswani-decoder", n_layers=1, vocab_size=50, d_model=40, n_heads=4, d_mlp=64))
    with pytest.raises(UnsupportedModelError, match="sinusoidal"):
        export_hf(vaswani, tmp_path / "bad")


def test_export_refuses_post_norm_and_gqa_gpt2(tmp_path):
    with pytest.raises(UnsupportedModelError, match="post-norm"):
        export_hf(TransformerLM(get_preset("shakespeare-char-cpu-nanogpt", n_layers=1, norm_placement="post")), tmp_path)
    with pytest.raises(UnsupportedModelError, match="grouped-query"):
        export_hf(TransformerLM(get_preset("shakespeare-char-cpu-nanogpt", n_layers=1, n_kv_heads=2)), tmp_path)


# --- one loader for both kinds of directory --------------------------------------------------------

@pytest.mark.parametrize("preset", ["llama-tiny", "vaswani-decoder"])
@torch.no_grad()
def test_load_model_reads_glasslm_checkpoints_on_meta_and_rebuilds_buffers(preset, tmp_path):
    from glasslm.tokenizers import CharTokenizer

    model = TransformerLM(get_preset(preset, n_layers=2, vocab_size=20, dropout=0.0)).eval()
    save_checkpoint(tmp_path / "ckpt", model, CharTokenizer([chr(97 + i) for i in range(20)]))
    loaded, tokenizer = load_model(tmp_path / "ckpt")
    assert tokenizer is not None and tokenizer.vocab_size == 20
    assert not any(t.is_meta for t in list(loaded.parameters()) + list(loaded.buffers()))
    tokens = torch.randint(0, 20, (2, 12))
    assert torch.equal(loaded(tokens), model(tokens))


@torch.no_grad()
def test_load_model_accepts_hf_directories(tmp_path):
    hf_model, directory = hf_saved(gpt2_config(tied=True), tmp_path)
    model, tokenizer = load_model(directory)
    assert tokenizer is None  # no vocab.json / merges.txt saved
    tokens = torch.randint(0, VOCAB, (1, 8))
    torch.testing.assert_close(model(tokens), hf_model(tokens).logits, atol=1e-5, rtol=0)


def test_cli_convert_both_ways(tmp_path, capsys):
    from glasslm.cli import main

    hf_model, directory = hf_saved(llama_config(tied=False, n_kv_heads=2), tmp_path)
    assert main(["convert", "--from-hf", str(directory), "--out", str(tmp_path / "ckpt")]) == 0
    assert main(["convert", "--to-hf", "--checkpoint", str(tmp_path / "ckpt"), "--out", str(tmp_path / "back")]) == 0
    reloaded = LlamaForCausalLM.from_pretrained(tmp_path / "back").eval()
    tokens = torch.randint(0, VOCAB, (1, 8))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(tokens).logits, hf_model(tokens).logits, atol=1e-5, rtol=0)
    assert main(["convert", "--from-hf", str(tmp_path / "missing"), "--out", str(tmp_path / "x")]) == 1
    assert "does not exist" in capsys.readouterr().err


@torch.no_grad()
def test_gpt2_checkpoint_without_prefix_and_with_old_mask_buffers(tmp_path):
    # The original hub "gpt2" files name tensors "h.0.attn.c_attn.weight" (no "transformer.") and
    # carry the causal mask as attn.bias / attn.masked_bias buffers.
    from safetensors.torch import load_file, save_file

    hf_model, directory = hf_saved(gpt2_config(tied=True), tmp_path)
    weights = {k.removeprefix("transformer."): v for k, v in load_file(directory / "model.safetensors").items()}
    weights["h.0.attn.bias"] = torch.ones(1, 1, 48, 48).tril()
    weights["h.0.attn.masked_bias"] = torch.tensor(-1e4)
    save_file(weights, directory / "model.safetensors")
    tokens = torch.randint(0, VOCAB, (1, 12))
    torch.testing.assert_close(import_hf(directory)(tokens), hf_model(tokens).logits, atol=1e-5, rtol=0)


def test_hf_tokenizer_files_are_picked_up_and_exported(tmp_path, data_dir):
    from tokenizers import Tokenizer

    from glasslm.hf import hf_tokenizer, load_model
    from glasslm.tokenizers import gpt2_tokenizer

    assert hf_tokenizer(tmp_path) is None
    tokenizer = gpt2_tokenizer(data_dir)
    model = TransformerLM(get_preset("gpt2-small", n_layers=1, d_model=32, n_heads=2, context_length=32))
    export_hf(model, tmp_path / "hf", tokenizer)
    text = "Hello world, it's 2026 \u2014 caf\u00e9 \U0001F600!"
    loaded_model, loaded_tokenizer = load_model(tmp_path / "hf")
    assert loaded_tokenizer.encode(text) == tokenizer.encode(text)
    assert loaded_tokenizer.decode(loaded_tokenizer.encode(text)) == text
    hf = Tokenizer.from_file(str(tmp_path / "hf" / "tokenizer.json"))
    assert hf.encode(text, add_special_tokens=False).ids == tokenizer.encode(text)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["bos_token_id"] == config["eos_token_id"] == 50256 and config["pad_token_id"] is None
