import pytest

from glasslm.presets import PRESETS, get_preset
from glasslm.core.config import ModelConfig


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(d_model=100, n_heads=3), "divisible by n_heads"),
        (dict(d_model=64, n_heads=8, n_kv_heads=3), "multiple of n_kv_heads"),
        (dict(d_model=64, n_heads=4, n_kv_heads=8), "multiple of n_kv_heads"),
        (dict(d_model=60, n_heads=4, positional="rope"), "even head size"),
        (dict(norm="batchnorm"), "norm must be one of"),
        (dict(dropout=1.0), "dropout"),
        (dict(vocab_size=0), "vocab_size must be a positive integer"),
        (dict(n_layers=2.5), "n_layers must be a positive integer"),
    ],
)
def test_invalid_configs_raise_clear_errors(fields, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig(**fields)


def test_presets_have_the_documented_shapes():
    small = get_preset("gpt2-small")
    assert (small.n_layers, small.n_heads, small.d_model, small.context_length) == (12, 12, 768, 1024)
    assert small.activation == "gelu_tanh" and small.tie_embeddings and small.bias
    llama = get_preset("llama-tiny")
    assert (llama.norm, llama.positional, llama.mlp, llama.bias, llama.tie_embeddings) == (
        "rmsnorm", "rope", "swiglu", False, False)
    assert llama.n_kv_heads < llama.n_heads
    vaswani = get_preset("vaswani-decoder")
    assert (vaswani.d_model, vaswani.n_layers, vaswani.n_heads, vaswani.d_mlp) == (512, 6, 8, 2048)
    assert vaswani.scale_embeddings and vaswani.positional == "sinusoidal" and vaswani.init == "xavier"
    assert vaswani.activation == "relu" and vaswani.norm_placement == "post"
    char = get_preset("shakespeare-char")
    assert (char.n_layers, char.n_heads, char.d_model, char.context_length, char.dropout) == (6, 6, 384, 256, 0.2)
    cpu = get_preset("shakespeare-char-cpu")
    assert (cpu.n_layers, cpu.n_heads, cpu.d_model, cpu.context_length, cpu.dropout) == (4, 4, 128, 64, 0.0)
    tiny = get_preset("tiny-transformer")
    assert (tiny.n_layers, tiny.n_heads, tiny.d_model, tiny.context_length, tiny.dropout) == (5, 5, 195, 256, 0.15)
    assert tiny.activation == "relu" and tiny.d_mlp == 4 * 195


def test_unknown_preset_and_fields():
    with pytest.raises(ValueError, match="unknown preset"):
        get_preset("gpt5")
    with pytest.raises(ValueError, match="unknown setting .n_layer.; did you mean .n_layers."):
        get_preset("gpt2-small", n_layer=3)


def test_replace_keeps_derived_defaults_following():
    cfg = get_preset("gpt2-small").replace(n_heads=4, d_model=256)
    assert cfg.n_kv_heads == 4 and cfg.d_mlp == 1024
    llama = get_preset("llama-tiny").replace(n_heads=4)
    assert llama.n_kv_heads == 2  # an explicit GQA setting is kept


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_dict_round_trip(name):
    cfg = get_preset(name)
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg


def test_one_registry_holds_model_and_recipe_of_every_preset():
    from glasslm.training.config import get_recipe
    from glasslm.training.config import TrainConfig

    for name, preset in PRESETS.items():
        assert isinstance(preset.model, ModelConfig)
        if preset.recipe is not None:
            recipe = get_recipe(name)
            assert isinstance(recipe, TrainConfig)
            assert {k: getattr(recipe, k) for k in preset.recipe} == preset.recipe
    assert get_recipe("shakespeare-char").batch_size == 64
    assert get_recipe("gpt2-small", max_steps=10).max_steps == 10
    assert get_recipe("default") == TrainConfig()


@pytest.mark.parametrize("name", ["llama3-8b", "gpt2-xl", "vaswani-decoder"])
def test_presets_without_a_recipe_are_refused_not_trained_with_defaults(name):
    from glasslm.training.config import get_recipe

    assert PRESETS[name].recipe is None
    with pytest.raises(ValueError, match="has no training recipe"):
        get_recipe(name)


def test_unknown_preset_suggests_the_closest_name():
    with pytest.raises(ValueError, match="did you mean 'gpt2-small'"):
        get_preset("gpt2-smal")


def test_cli_refuses_a_preset_without_recipe_before_loading_anything(tmp_path, capsys):
    from glasslm.cli import main

    assert main(["train", "--preset", "llama3-8b", "--data", str(tmp_path / "none.txt"),
                 "--out", str(tmp_path / "run")]) == 1
    err = capsys.readouterr().err
    assert "has no training recipe" in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()
