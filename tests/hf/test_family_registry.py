"""The family registry is the seam: every family is one file registered in glasslm.hf.families,
`family_of` is derived from the registered families (no hand-kept inverse), and a family registered
from outside is picked up by import, export, config dispatch and the model card.

Pure glasslm: transformers is not needed (tests/hf/test_hf_families.py checks the built-in families
against it).
"""

from __future__ import annotations

import json
import re

import pytest
import torch

from glasslm.core.config import ModelConfig
from glasslm.core.model import TransformerLM
from glasslm.hf import (
    FAMILIES, HFFamily, UnsupportedModelError, config_from_hf, config_to_hf, export_hf, family_of, import_hf,
)
from glasslm.hf.families import family_reading
from glasslm.hf.families.common import uniform_sliding_window
from glasslm.hf.plan import SAME, WeightTable

_ROTARY = {"vocab_size": 61, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}

# One HF config.json per built-in family, as a plain dict (what `config_from_hf` reads).
HF_CONFIGS = {
    "gpt2": {"model_type": "gpt2", "vocab_size": 61, "n_positions": 32, "n_embd": 32, "n_layer": 2, "n_head": 4},
    "llama": {"model_type": "llama", **_ROTARY, "attention_bias": True, "mlp_bias": False},
    "mistral": {"model_type": "mistral", **_ROTARY, "sliding_window": 8},
    "qwen2": {"model_type": "qwen2", **_ROTARY},
    "qwen3": {"model_type": "qwen3", **_ROTARY, "head_dim": 16},
    "gpt_neox": {"model_type": "gpt_neox", "vocab_size": 61, "hidden_size": 32, "num_hidden_layers": 2,
                 "num_attention_heads": 4, "intermediate_size": 48, "rotary_pct": 0.25},
    "gemma3_text": {"model_type": "gemma3_text", **_ROTARY, "head_dim": 16, "sliding_window": 8,
                    "layer_types": ["sliding_attention", "full_attention"]},
    "gemma2": {"model_type": "gemma2", **_ROTARY, "head_dim": 16, "sliding_window": 8},
    "phi3": {"model_type": "phi3", **_ROTARY, "partial_rotary_factor": 0.5},
    "mixtral": {"model_type": "mixtral", **_ROTARY, "num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen3_moe": {"model_type": "qwen3_moe", **_ROTARY, "head_dim": 16, "num_experts": 4, "moe_intermediate_size": 16,
                  "decoder_sparse_step": 2, "norm_topk_prob": True},
    "qwen2_moe": {"model_type": "qwen2_moe", **_ROTARY, "num_experts": 4, "moe_intermediate_size": 16,
                  "shared_expert_intermediate_size": 24},
    "olmoe": {"model_type": "olmoe", **_ROTARY, "num_experts": 4, "num_experts_per_tok": 2},
}


def test_every_builtin_family_is_registered_once_under_its_model_type():
    assert sorted(FAMILIES) == sorted(HF_CONFIGS)
    for name, family in FAMILIES.items():
        assert family.name == name and family_reading(name) is family
        assert family.architecture.endswith(("LMHeadModel", "ForCausalLM"))


@pytest.mark.parametrize("name", sorted(HF_CONFIGS))
def test_family_of_round_trips_each_builtin_family(name):
    config, family = config_from_hf(HF_CONFIGS[name])
    assert family == name
    assert family_of(config) == name
    hf = config_to_hf(config)
    assert (hf["model_type"], hf["architectures"]) == (name, [FAMILIES[name].architecture])
    assert config_from_hf(json.loads(json.dumps(hf))) == (config, name)  # through config.json and back
    # Exactly one family accepts it: the recognisers do not overlap, so registration order is no tie-break.
    assert [f.name for f in FAMILIES.values() if not f.fit_problems(config)] == [name]


@pytest.mark.parametrize("name", sorted(HF_CONFIGS))
def test_family_of_asks_the_registry(name, monkeypatch):
    # Take the family out of the registry: nothing else remembers it, so its configs have no family.
    config, _ = config_from_hf(HF_CONFIGS[name])
    monkeypatch.delitem(FAMILIES, name)
    with pytest.raises(UnsupportedModelError, match="no Hugging Face form") as err:
        family_of(config)
    assert f"not {name}:" not in str(err.value)
    assert all(f"not {other}:" in str(err.value) for other in FAMILIES)
    with pytest.raises(UnsupportedModelError, match=f"model_type='{name}'"):
        config_from_hf(HF_CONFIGS[name])


def test_a_too_lenient_recogniser_does_not_claim_what_its_config_json_cannot_say(monkeypatch):
    # As if ModelConfig grew a field GPT-2's fit_problems has never heard of: the round trip through
    # GPT-2's config.json still refuses, so the next family (registered later) gets the config.
    import dataclasses

    from glasslm.hf.families import round_trip_problems
    from glasslm.presets import get_preset

    config = get_preset("llama-tiny")
    lenient = dataclasses.replace(FAMILIES["gpt2"], fit_problems=lambda config: [])
    monkeypatch.setitem(FAMILIES, "gpt2", lenient)
    assert family_of(config) == "llama"
    assert "config.json cannot say positional='rope'" in round_trip_problems(lenient, config)
    assert round_trip_problems(FAMILIES["llama"], config.replace(dropout=0.1, impl="readable")) == []


# --- a throwaway family: sinusoidal positions, which no HF family here has -----------------------

def _toy_config_from_hf(hf, context_length):
    return ModelConfig(vocab_size=hf["vocab"], context_length=context_length or hf["positions"], d_model=hf["width"],
                       n_layers=hf["depth"], n_heads=hf["heads"], d_mlp=2 * hf["width"], positional="sinusoidal",
                       norm="layernorm", mlp="mlp", activation="gelu", dropout=0.0, tie_embeddings=True)


def _toy_config_to_hf(config, zero_biases):
    return {"vocab": config.vocab_size, "positions": config.context_length, "width": config.d_model,
            "depth": config.n_layers, "heads": config.n_heads}


def _toy_fit_problems(config):
    return [] if _toy_config_from_hf(_toy_config_to_hf(config, False), None) == config else ["not a toy"]


def _toy_weight_table(config, hf_names):
    # Every tensor under "toy." + our name; weights stored transposed, to see both directions used.
    table = {}
    for name, tensor in TransformerLM(config).state_dict().items():
        table[name] = (("toy." + name,), lambda t: t.t().contiguous(), lambda t: (t.t(),)) if tensor.dim() == 2 \
            else (("toy." + name,), *SAME)
    return WeightTable(table)


TOY = HFFamily(name="toy", architecture="ToyForCausalLM", config_from_hf=_toy_config_from_hf,
               config_to_hf=_toy_config_to_hf, fit_problems=_toy_fit_problems, weight_table=_toy_weight_table,
               ignored_tensors=r"toy\.cache\.\d+", model_types=("toy-legacy",))


def test_a_registered_family_is_used_by_import_export_and_family_of(tmp_path, monkeypatch):
    torch.manual_seed(0)
    model = TransformerLM(ModelConfig(vocab_size=53, context_length=16, d_model=24, n_layers=2, n_heads=3,
                                      d_mlp=48, positional="sinusoidal", norm="layernorm", mlp="mlp",
                                      activation="gelu", dropout=0.0, tie_embeddings=True)).eval()
    with pytest.raises(UnsupportedModelError, match="positional=sinusoidal"):
        family_of(model.config)  # no built-in family has sinusoidal positions

    monkeypatch.setitem(FAMILIES, "toy", TOY)  # what a one-line register(...) does, undone after the test
    assert family_of(model.config) == "toy"
    directory = export_hf(model, tmp_path / "toy")
    written = json.loads((directory / "config.json").read_text())
    assert (written["model_type"], written["architectures"], written["width"]) == ("toy", ["ToyForCausalLM"], 24)
    assert "ToyForCausalLM (toy)" in (directory / "README.md").read_text()
    from safetensors.torch import load_file, save_file

    weights = load_file(directory / "model.safetensors")
    assert all(name.startswith("toy.") for name in weights)
    assert torch.equal(weights["toy.embed.weight"], model.embed.weight.detach().t())

    back = import_hf(directory)
    tokens = torch.randint(0, 53, (1, 10))
    assert back.config == model.config
    torch.testing.assert_close(back(tokens), model(tokens), atol=0, rtol=0)
    # The family's ignored buffers are skipped, any other extra tensor is still named.
    save_file({**weights, "toy.cache.0": torch.zeros(2)}, str(directory / "model.safetensors"))
    assert family_of(import_hf(directory).config) == "toy"
    save_file({**weights, "toy.other": torch.zeros(2)}, str(directory / "model.safetensors"))
    with pytest.raises(ValueError, match=re.escape("unexpected tensors ['toy.other']")):
        import_hf(directory)
    # Further model_types mean the same family on import.
    assert config_from_hf({**written, "model_type": "toy-legacy"}) == (model.config, "toy")


def test_sliding_window_layers_are_read_in_one_place():
    assert uniform_sliding_window(None, 8, "X") == 8
    assert uniform_sliding_window(["sliding_attention"] * 3, 8, "X") == 8
    assert uniform_sliding_window(["full_attention"] * 3, 8, "X") is None
    with pytest.raises(UnsupportedModelError, match="X with sliding-window attention on some layers only"):
        uniform_sliding_window(["full_attention", "sliding_attention"], 8, "X")
