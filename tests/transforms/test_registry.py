"""The model-transform seam: a transform registered here is recorded by save_checkpoint and re-applied
by load_checkpoint; misuse (twice, unknown names or options) is a clear error; the CLI's choices
come from the registry."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
import torch
from torch import nn

from glasslm.cli import build_parser
from glasslm.core.model import TransformerLM
from glasslm.io.checkpoint import load_checkpoint, save_checkpoint
from glasslm.presets import get_preset
from glasslm.tokenizers import CharTokenizer
from glasslm.transforms import (TRANSFORMS, Transform, applied_transforms, apply_transform, register_transform,
                                transform_names)
from glasslm.transforms.quantize import Int4Linear, Int8Linear


@dataclass(frozen=True)
class GainOptions:
    initial: float = 1.0


class GainedMLP(nn.Module):
    """An MLP followed by a learned per-channel gain: a structural change with its own weights."""

    def __init__(self, mlp: nn.Module, d_model: int, initial: float, device: torch.device):
        super().__init__()
        self.mlp = mlp
        self.gain = nn.Parameter(torch.full((d_model,), initial, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(x) * self.gain


def add_gains(model: TransformerLM, options: GainOptions) -> None:
    device = model.embed.weight.device  # `meta` when a checkpoint is being loaded
    for block in model.blocks:
        block.mlp = GainedMLP(block.mlp, model.config.d_model, options.initial, device)


@pytest.fixture
def gain_transform():
    transform = register_transform(Transform("test-gain", add_gains, options=GainOptions, summary="a test transform"))
    yield transform
    del TRANSFORMS["test-gain"]


def small_model() -> TransformerLM:
    torch.manual_seed(0)
    return TransformerLM(get_preset("llama-tiny", vocab_size=3)).eval()


def test_a_registered_transform_is_recorded_and_reapplied_on_load(gain_transform, tmp_path):
    model = small_model()
    apply_transform(model, "test-gain", initial=0.5)
    with torch.no_grad():  # as if trained: loading must read these, not rebuild the initial 0.5
        for block in model.blocks:
            block.mlp.gain.uniform_(0.1, 2.0)
    path = save_checkpoint(tmp_path / "ckpt", model, CharTokenizer.from_text("abc"), {"note": "kept"})
    meta = json.loads((path / "meta.json").read_text())
    assert meta == {"note": "kept", "transforms": [{"name": "test-gain", "initial": 0.5}]}

    loaded, _, _ = load_checkpoint(path)
    assert all(isinstance(block.mlp, GainedMLP) for block in loaded.blocks)
    assert applied_transforms(loaded) == [{"name": "test-gain", "initial": 0.5}]
    assert torch.equal(loaded.blocks[1].mlp.gain, model.blocks[1].mlp.gain)
    tokens = torch.tensor([[0, 1, 2, 1]])
    with torch.no_grad():
        assert torch.equal(loaded(tokens), model(tokens))


def test_transforms_are_reapplied_in_the_order_they_were_applied(gain_transform, tmp_path):
    model = small_model()
    apply_transform(model, "test-gain")
    apply_transform(model, "int8")  # after the gain: the MLP inside GainedMLP is quantized too
    path = save_checkpoint(tmp_path / "ckpt", model)
    loaded, _, meta = load_checkpoint(path)
    assert meta["transforms"] == [{"name": "test-gain", "initial": 1.0}, {"name": "int8"}]
    assert isinstance(loaded.blocks[0].mlp, GainedMLP) and isinstance(loaded.blocks[0].mlp.mlp.down, Int8Linear)
    tokens = torch.tensor([[0, 1, 2, 1]])
    with torch.no_grad():
        assert torch.equal(loaded(tokens), model(tokens))


def test_a_transform_s_own_rebuild_is_used_on_load(tmp_path):
    calls = []

    def rebuild(model, options):
        calls.append(options)
        add_gains(model, options)

    register_transform(Transform("test-rebuilt", add_gains, options=GainOptions, rebuild=rebuild))
    try:
        model = small_model()
        apply_transform(model, "test-rebuilt", GainOptions(initial=2.0))
        assert calls == []
        load_checkpoint(save_checkpoint(tmp_path / "ckpt", model))
        assert calls == [GainOptions(initial=2.0)]
    finally:
        del TRANSFORMS["test-rebuilt"]


def test_applying_a_transform_twice_is_refused(gain_transform):
    model = small_model()
    apply_transform(model, "test-gain")
    with pytest.raises(ValueError, match="'test-gain' was already applied"):
        apply_transform(model, "test-gain")
    assert applied_transforms(model) == [{"name": "test-gain", "initial": 1.0}]
    assert not isinstance(model.blocks[0].mlp.mlp, GainedMLP)  # the refused second one changed nothing


def test_quantizing_a_quantized_model_is_refused():
    model = small_model()
    apply_transform(model, "int8")
    with pytest.raises(ValueError, match="already quantized"):
        apply_transform(model, "int4")
    assert not any(isinstance(m, Int4Linear) for m in model.modules())
    assert applied_transforms(model) == [{"name": "int8"}]


def test_unknown_names_and_options_are_clear_errors(gain_transform, tmp_path):
    model = small_model()
    with pytest.raises(ValueError, match=r"unknown transform .int3.; choose from int8, int4, q4_0, q4_1, q5_0, q5_1, q8_0, q4_k, q5_k, q6_k, f16, bf16, f32, lora, row_split, expert_blocks, test-gain"):
        apply_transform(model, "int3")
    with pytest.raises(ValueError, match="'test-gain' has no option rank; its options are initial"):
        apply_transform(model, "test-gain", rank=4)
    with pytest.raises(ValueError, match="'int8' takes no options"):
        apply_transform(model, "int8", group_size=32)
    with pytest.raises(ValueError, match="already registered"):
        register_transform(Transform("test-gain", add_gains))
    assert applied_transforms(model) == []


def test_a_checkpoint_recording_an_unregistered_transform_names_it(gain_transform, tmp_path):
    model = small_model()
    apply_transform(model, "test-gain")
    path = save_checkpoint(tmp_path / "ckpt", model)
    del TRANSFORMS["test-gain"]
    try:
        with pytest.raises(ValueError, match=r"model.safetensors: unknown transform 'test-gain'"):
            load_checkpoint(path)
    finally:
        TRANSFORMS["test-gain"] = gain_transform


def test_meta_cannot_override_the_model_s_transform_record(tmp_path):
    with pytest.raises(ValueError, match="written from the model"):
        save_checkpoint(tmp_path / "ckpt", small_model(), meta={"transforms": [{"name": "int8"}]})
    assert not (tmp_path / "ckpt").exists()


def test_a_checkpoint_without_transforms_records_none(tmp_path):
    path = save_checkpoint(tmp_path / "ckpt", small_model())
    assert json.loads((path / "meta.json").read_text()) == {}
    assert applied_transforms(load_checkpoint(path)[0]) == []


def test_the_cli_quantize_choices_come_from_the_registry():
    register_transform(Transform("test-int2", add_gains, kind="quantization"))
    try:
        assert transform_names("quantization") == ("int8", "int4", "q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "f16", "bf16",
                                                     "f32", "test-int2")
        args = build_parser().parse_args(["quantize", "--checkpoint", "a", "--out", "b", "--method", "test-int2"])
        assert vars(args)["QuantizeConfig.method"] == "test-int2"
        args = build_parser().parse_args(["generate", "--checkpoint", "a", "--prompt", "x", "--quantize", "test-int2"])
        assert vars(args)["RuntimeOptions.quantize"] == "test-int2"
    finally:
        del TRANSFORMS["test-int2"]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["quantize", "--checkpoint", "a", "--out", "b", "--method", "test-int2"])
