"""llama.cpp's block formats as glasslm layers: bit-exact to ggml's reference, the kernel within its bound, files."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType, quants

from glasslm.core.layers import Linear
from glasslm.core.model import TransformerLM
from glasslm.io.checkpoint import load_checkpoint, save_checkpoint
from glasslm.kernels.qmatmul import activation_error_bound, kernel_ops
from glasslm.presets import get_preset
from glasslm.transforms import applied_transforms, apply_transform
from glasslm.transforms.ggml import BlockLinear, block_fields, dequantize_blocks, quantize_blocks
from glasslm.transforms.lora import LoRAConfig, add_lora
from tests.ggml_blocks import random_blocks


def awkward_weight(rows: int = 40, d_in: int = 128) -> torch.Tensor:
    """Rows of very different scales and signs: an all-positive row, an all-zero row, a constant row."""
    torch.manual_seed(0)
    weight = torch.randn(rows, d_in) * torch.logspace(-4, 1, rows)[:, None]
    weight[3] = weight[3].abs() + 0.5   # q4_1's minimum far from zero
    weight[5] = 0.0                     # a zero block: scale 0 must not divide by zero
    weight[7] = -0.25                   # every value the same
    return weight


@pytest.mark.parametrize("qtype", ["q4_0", "q4_1", "q5_0", "q5_1", "q8_0"])
def test_quantize_and_dequantize_are_llama_cpps_reference_bit_for_bit(qtype):
    weight = awkward_weight()
    blocks = quantize_blocks(weight, qtype)
    reference = quants.quantize(weight.numpy(), GGMLQuantizationType[qtype.upper()])
    assert blocks.dtype == torch.uint8 and np.array_equal(blocks.numpy(), reference)
    ours = dequantize_blocks(blocks, qtype)
    theirs = quants.dequantize(reference, GGMLQuantizationType[qtype.upper()])
    assert torch.equal(ours, torch.from_numpy(theirs))  # not close: the same bits


@pytest.mark.parametrize("qtype", ["q4_k", "q5_k", "q6_k"])
def test_k_quant_blocks_read_as_the_gguf_packages_dequantizer_reads_them(qtype):
    """Random super-blocks (any bytes are a valid block once its fp16 scales are finite): glasslm's
    reading of their levels, 6- or 8-bit sub-scales and super-scales gives the gguf package's
    numpy dequantizer's floats (a copy of ggml's dequantize_row_*), bit for bit."""
    blocks = random_blocks(qtype, 24, 512, seed=3)
    theirs = quants.dequantize(blocks.numpy(), GGMLQuantizationType[qtype.upper()])
    assert torch.equal(dequantize_blocks(blocks, qtype), torch.from_numpy(theirs))


@pytest.mark.parametrize("qtype", ["q4_0", "q4_1", "q5_0", "q5_1", "q8_0"])
def test_each_weight_is_within_half_a_step_of_its_block(qtype):
    weight = awkward_weight()
    error = (dequantize_blocks(quantize_blocks(weight, qtype), qtype) - weight).abs()
    blocks = weight.reshape(weight.shape[0], -1, 32)
    amax, low, high = blocks.abs().amax(-1), blocks.amin(-1), blocks.amax(-1)
    # The step between levels: q4_0 puts the largest |w| at level -8 (16 levels of max/8, so the other
    # side stops at 7/8 of it and a value beyond is clipped by up to a whole step), q4_1 cuts [min, max]
    # into 15 steps, q8_0 puts max |w| at 127. Round to nearest: at most half a step, plus the fp16
    # rounding of the block's scale (and minimum): 2^-11 relative, or 2^-24 absolute below fp16's
    # normal range, times the largest level.
    # q5_0 and q5_1 likewise with 32 levels.
    step, top = {"q4_0": (amax / 8, 8), "q4_1": ((high - low) / 15, 15), "q5_0": (amax / 16, 16),
                 "q5_1": ((high - low) / 31, 31), "q8_0": (amax / 127, 127)}[qtype]
    fp16 = (step * top + (low.abs() if qtype in ("q4_1", "q5_1") else 0)) * 2**-11 + top * 2**-24
    clipped = qtype in ("q4_0", "q5_0")
    bound = ((step if clipped else step / 2) + fp16)[..., None].expand_as(blocks).reshape_as(weight)
    assert torch.all(error <= bound * (1 + 1e-6))
    assert error.max() > 0.4 * bound.max()  # (the bound is tight enough to mean something)


def test_block_fields_lay_out_nibbles_as_ggml_does():
    # One q4_0 block: d = 1.0 (fp16 0x3C00), byte j holds input j (low) and input j + 16 (high).
    block = torch.tensor([0x00, 0x3C] + [(j % 16) | ((15 - j % 16) << 4) for j in range(16)], dtype=torch.uint8)
    levels, d, m = block_fields(block[None, :], "q4_0")
    assert d.tolist() == [[1.0]] and m is None
    assert levels[0, :16].tolist() == list(range(16)) and levels[0, 16:].tolist() == list(range(15, -1, -1))
    assert dequantize_blocks(block[None, :], "q4_0")[0, :3].tolist() == [-8.0, -7.0, -6.0]


KERNELS = kernel_ops() is not None  # glasslm's C++ kernels (glasslm.kernels) built on this machine


@pytest.mark.parametrize("qtype", ["q4_0", "q4_1", "q5_0", "q5_1", "q8_0"])
def test_the_kernel_path_matches_the_readable_path_within_its_bound(qtype):
    torch.manual_seed(1)
    weight, bias = torch.randn(90, 256) * 0.05, torch.randn(90)   # 90 rows: a panel of 16 cut short
    layer = BlockLinear.from_weight(weight, bias, qtype)
    assert torch.equal(layer.quantized_matrix().weight(), layer.dequantized_weight())  # the kernels' weights
    x = torch.randn(3, 5, 256)
    exact = F.linear(x, dequantize_blocks(layer.blocks(), qtype), bias)
    layer.impl = "readable"
    assert torch.allclose(layer(x), exact, atol=1e-5)
    layer.impl = "fast"
    fast = layer(x)
    assert fast.shape == (3, 5, 90)
    if KERNELS:  # int8 activations in blocks of 32: within half a step per input of the float product
        assert torch.all((fast - exact).abs() <= activation_error_bound(x, layer.quantized_matrix()).reshape(3, 5, 90))
        assert not torch.equal(fast, exact)  # (the bound above is doing work)
    elif qtype not in ("q4_0", "q4_1"):  # its float weight
        assert torch.allclose(fast, exact, atol=1e-5)
    else:  # PyTorch's int4 kernel: activations, scales and zeros in bf16 (8 bits of mantissa)
        assert torch.allclose(fast, exact, atol=2e-2 * exact.abs().max().item())


def trained_like_model() -> TransformerLM:
    torch.manual_seed(0)
    model = TransformerLM(get_preset("llama-tiny")).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)  # not the initial values
    return model


@pytest.mark.parametrize("qtype", ["q4_0", "q4_1"])
def test_the_transform_quantizes_every_block_sized_linear_and_a_checkpoint_reloads_it(qtype, tmp_path):
    model = trained_like_model()
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    before = model(ids)
    apply_transform(model, qtype)
    layers = {name: m for name, m in model.named_modules() if isinstance(m, BlockLinear)}
    assert "blocks.0.attn.qkv" in layers and all(m.qtype == qtype for m in layers.values())
    # llama-tiny's d_mlp (344) does not divide into blocks of 32: its down projection stays float.
    assert "blocks.0.mlp.down" not in layers and model.config.d_mlp % 32
    after = model(ids)
    assert 0 < (after - before).abs().max() < 0.5 * before.abs().max()
    save_checkpoint(tmp_path / "q", model)
    back, _, meta = load_checkpoint(tmp_path / "q")
    assert meta["transforms"] == [{"name": qtype, "layers": None}] == applied_transforms(back)
    assert torch.equal(back(ids), after)


def test_a_named_layer_list_is_checked():
    model = trained_like_model()
    with pytest.raises(ValueError, match="not Linear layers of this model"):
        apply_transform(model, "q4_0", layers=["blocks.0.nonsense"])
    apply_transform(model, "q4_0", layers=["blocks.0.attn.qkv"])
    assert isinstance(model.blocks[0].attn.qkv, BlockLinear) and not isinstance(model.blocks[1].attn.qkv, BlockLinear)
    with pytest.raises(ValueError, match="already quantized"):
        apply_transform(model, "q4_1", layers=["blocks.0.attn.qkv"])
    with pytest.raises(ValueError, match="already quantized"):
        apply_transform(model, "int8")


def test_lora_on_block_layers_gets_gradients_through_the_frozen_blocks():
    model = trained_like_model()
    apply_transform(model, "q4_1")
    add_lora(model, LoRAConfig(rank=4, sites=("q", "v", "mlp_up")))
    for name, p in model.named_parameters():
        if "lora_b" in name:
            torch.nn.init.normal_(p, std=0.1)  # B of zeros would hide a missing gradient to A
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    model.train()
    loss = torch.nn.functional.cross_entropy(model(ids)[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters() if p.requires_grad}
    assert grads and all(g is not None and g.abs().sum() > 0 for g in grads.values())
    # The first layer's adapters are reached only through every later (frozen, quantized) layer.
    assert any(name.startswith("blocks.0.") for name in grads)


@pytest.mark.skipif(not KERNELS, reason="without the kernels --dtype bfloat16 runs the whole model in bf16")
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_decoding_with_16_bit_weights_keeps_float32_activations(dtype):
    """`--dtype bfloat16|float16` when decoding on a CPU: the Linears' weights kept 16-bit (the bf16 / f16
    transforms), activations float32: the float model with its weights rounded to 16 bits, not a model
    whose every activation is rounded too."""
    import copy

    from glasslm.cli.common import RuntimeOptions, prepare_model

    model = trained_like_model()
    rounded = copy.deepcopy(model)
    with torch.no_grad():
        for module in rounded.modules():
            if isinstance(module, Linear):
                module.weight.copy_(module.weight.to(getattr(torch, dtype)).float())
    whole = copy.deepcopy(model).to(getattr(torch, dtype))
    prepared = prepare_model(model, RuntimeOptions(dtype=dtype), decoding=True)
    layers = [m for m in prepared.modules() if isinstance(m, BlockLinear)]
    assert layers and all(m.qtype == {"bfloat16": "bf16", "float16": "f16"}[dtype] for m in layers)
    assert not any(isinstance(m, Linear) for m in prepared.modules()) and prepared.embed.dtype == torch.float32
    ids = torch.randint(0, model.config.vocab_size, (2, 12))
    with torch.no_grad():
        ours, expected, everything16 = prepared(ids), rounded(ids), whole(ids).float()
    gap = (ours - expected).abs().max()
    assert gap < 1e-4 * expected.abs().max() and gap < 0.05 * (everything16 - expected).abs().max()


@pytest.mark.skipif(not KERNELS, reason="the one-pass prefill is the kernels'")
def test_prefill_activations_int8_rounds_a_prompts_activations_once():
    """`--prefill-activations int8` (prepare_model): a prompt of ONE_PASS_ROWS tokens or more through
    quantized layers takes one int8 pass per activation, as llama.cpp does; its logits leave int16's,
    but stay near the float model's; a shorter input (a decoding step) is untouched; int16 puts it back."""
    from glasslm.cli.common import RuntimeOptions, prepare_model
    from glasslm.kernels.qmatmul import ONE_PASS_ROWS, prefill_activations, set_prefill_activations

    model = trained_like_model()
    prompt = torch.randint(0, model.config.vocab_size, (1, ONE_PASS_ROWS + 8))
    with torch.no_grad():
        exact = model(prompt)
        prepared = prepare_model(model, RuntimeOptions(quantize="q8_0", prefill_activations="int8"))
        try:
            once, short_once = prepared(prompt), prepared(prompt[:, :6])
        finally:
            assert set_prefill_activations("int16") == "int8"
        twice, short_twice = prepared(prompt), prepared(prompt[:, :6])
    assert not torch.equal(once, twice) and torch.equal(short_once, short_twice)
    scale = exact.abs().max()
    assert (twice - exact).abs().max() < (once - exact).abs().max() < 0.05 * scale
    with prefill_activations("int8"), torch.no_grad():
        assert torch.equal(prepared(prompt), once)


@pytest.mark.parametrize("qtype", ["q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q4_k", "q5_k", "q6_k", "f16", "bf16"])
def test_a_packed_layer_keeps_one_copy_and_writes_the_files_bytes_back_exactly(qtype, tmp_path):
    """With the kernels, a layer holds only their layout of its weight; the file's bytes come back
    from it bit for bit (the K-quants' packed 6-bit scales, the fifth and sixth bits included), through
    a checkpoint and a move to another dtype alike."""
    torch.manual_seed(0)
    blocks = (random_blocks(qtype, 40, 512, seed=5) if qtype not in ("f16", "bf16")
              else quantize_blocks(torch.randn(40, 512), qtype))
    layer = BlockLinear.from_blocks(blocks, torch.randn(40), qtype)
    if KERNELS:
        assert layer._buffers["weight_blocks"] is None and layer.kernel_matrix() is not None
    assert torch.equal(layer.blocks(), blocks) and torch.equal(layer.state_dict()["weight_blocks"], blocks)
    x = torch.randn(3, 512)
    before = layer(x)
    layer.double()  # the bias follows; the bytes stand as they are
    assert torch.equal(layer.blocks(), blocks) and layer.bias.dtype == torch.float64
    back = BlockLinear(512, 40, qtype)
    back.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in layer.state_dict().items()})
    assert torch.equal(back.blocks(), blocks) and torch.equal(back(x), before)
