"""The fast decoding step (generation/fast.py) computes what the readable forward computes: every
family's logits within float32 rounding of a float64 readable run, greedy tokens identical, ragged
batches and sliding windows included; hooks and GLASSLM_KERNELS=off get the readable forward."""

from __future__ import annotations

import copy
import os
import subprocess
import sys

import pytest
import torch

from glasslm.core.model import TransformerLM
from glasslm.generation import DecodeWindow, generate
from glasslm.generation.fast import FastDecoder, native_block, unsupported
from glasslm.kernels.decode import decode_ops
from glasslm.presets import get_preset
from glasslm.transforms import apply_transform
from glasslm.transforms.ggml import BlockLinear
from tests.ggml_blocks import random_blocks

pytestmark = pytest.mark.skipif(decode_ops() is None, reason="the C++ kernels are not built here")

SHAPE = dict(vocab_size=97, n_layers=2, d_model=64, context_length=24, n_heads=4)
# Every family's decoding step: learned positions and LayerNorm (GPT-2), rotary and grouped heads with
# SwiGLU (Llama), q/k/v biases (Qwen2), parallel blocks with partial rotary (GPT-NeoX), post-norms, unit-offset
# norms, scaled embeddings, local rotary and sliding windows with per-head q/k norms (Gemma 3, Qwen3).
FAMILIES = {
    "gpt2": dict(preset="gpt2-small"),
    "llama": dict(preset="llama-tiny", n_kv_heads=2, d_mlp=96),
    "qwen2": dict(preset="qwen3-0.6b", n_kv_heads=2, d_mlp=96, qk_norm=False, attn_qkv_bias=True, d_head=16),
    "qwen3": dict(preset="qwen3-0.6b", n_kv_heads=2, d_mlp=96, d_head=16),
    "neox": dict(preset="pythia-160m", d_mlp=128),
    "gemma": dict(preset="gemma3-270m", n_kv_heads=2, d_mlp=96, d_head=16, sliding_window=5,
              global_layers=(1,)),
    # Gemma 2's logit soft-cap (the fast step caps the logits it makes; its attention cap is below).
    "gemma-capped-logits": dict(preset="gemma3-270m", n_kv_heads=2, d_mlp=96, d_head=16, sliding_window=5,
                                global_layers=(1,), qk_norm=False, logit_softcap=3.0),
}


def family_model(family: str, seed: int = 0, **overrides) -> TransformerLM:
    """A tiny model of `family` with every parameter perturbed (norm gains and biases included)."""
    spec = dict(FAMILIES[family])
    cfg = get_preset(spec.pop("preset"), **{**SHAPE, **spec, **overrides})
    torch.manual_seed(seed)
    model = TransformerLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return model


def greedy_logits(model: TransformerLM, rows: list[list[int]], steps: int, fast: bool) -> tuple[list, torch.Tensor]:
    """Greedy tokens and each step's logits (steps, batch, vocab) through a DecodeWindow, fast step on or off."""
    window = DecodeWindow(model, len(rows), max(map(len, rows)) + steps)
    assert (window.fast is not None) == fast or not fast
    if not fast:
        window.fast = None
    tokens, logits_per_step = [], []
    with torch.inference_mode():
        logits = window.prefill(rows)
        for _ in range(steps):
            token = logits.argmax(-1)
            tokens.append(token.tolist())
            logits = window.decode(token)
            logits_per_step.append(logits)
    return tokens, torch.stack(logits_per_step)


def assert_float_close(actual: torch.Tensor, reference: torch.Tensor) -> None:
    """float32 against float64 within 2e-5 of the logits' scale (tests/generation/test_generate.py's
    tolerance: float32 rounding measures ~2e-6 of it; a wrong position, mask or slot moves ~1e-1)."""
    scale = reference.abs().amax().item()
    torch.testing.assert_close(actual.double(), reference.double(), rtol=0, atol=2e-5 * scale)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_decodes_as_its_readable_forward(family):
    model = family_model(family)
    assert unsupported(model) is None
    rows = [[5, 9, 3, 7, 1, 2, 8], [4, 6]]  # ragged: the short row is left-padded and masked
    tokens, logits = greedy_logits(model, rows, 12, fast=True)
    reference = copy.deepcopy(model).double()  # float64: the readable forward (the fast step is float32 only)
    assert FastDecoder.for_model(reference) is None
    ref_tokens, ref_logits = greedy_logits(reference, rows, 12, fast=False)
    assert tokens == ref_tokens
    assert_float_close(logits, ref_logits)


@pytest.mark.parametrize("transform", ["int8", "int4"])
def test_quantized_layers_decode_as_the_readable_forward(transform):
    """The fast step calls the model's own quantized layers: its logits are theirs, to the kernels'
    activation rounding (inputs that differ by float rounding may round to the next int8 step)."""
    model = family_model("llama")
    apply_transform(model, transform)
    rows = [[5, 9, 3, 7], [4, 6, 2, 2]]
    tokens, logits = greedy_logits(model, rows, 10, fast=True)
    ref_tokens, ref_logits = greedy_logits(model, rows, 10, fast=False)
    assert tokens == ref_tokens
    # The kernels' activations are good to 1/256 of a step of max|x| / 127 (kernels/qmatmul.py).
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=ref_logits.abs().amax().item() / 127 / 256 * 8)


def window_logits(model: TransformerLM, fast: FastDecoder, rows: list[list[int]], steps: int) -> torch.Tensor:
    """Each step's logits (steps, batch, vocab) decoding the given tokens through `fast`."""
    window = DecodeWindow(model, len(rows), max(map(len, rows)) + steps)
    window.fast = fast
    with torch.inference_mode():
        logits = [window.prefill(rows)]
        for step in range(steps):
            logits.append(window.decode(torch.tensor([(7 * step + row) % 90 for row in range(len(rows))])))
    return torch.stack(logits)


@pytest.mark.parametrize("transform", ["int8", "int4", "q8_0", "q4_1", "q5_0", "q5_1", "f16", "bf16"])
@pytest.mark.parametrize("family", FAMILIES)
def test_native_blocks_step_as_the_python_step(family, transform):
    """kernels/block.cpp runs a whole block in C++: every family's quantized blocks, ragged rows included,
    give the Python step's logits (the same kernels in the same order; LayerNorm and activations are
    ATen's there, which may move an activation to the next int8 step)."""
    model = family_model(family, seed=1)
    apply_transform(model, transform)
    native, python, per_block = FastDecoder(model), FastDecoder(model, native_blocks=False), FastDecoder(model)
    assert all(isinstance(step, torch.ScriptMethod) for step in native.steps)  # every block in one C++ call
    assert not any(isinstance(step, torch.ScriptMethod) for step in python.steps)
    assert native.native_stack is not None and python.native_stack is None  # all blocks in one call
    per_block.native_stack = None  # the same Blocks, one Python call each
    rows = [[5, 9, 3, 7, 1], [4, 6]]
    expected = window_logits(model, python, rows, 8)
    got = window_logits(model, native, rows, 8)
    torch.testing.assert_close(got, expected, rtol=0, atol=expected.abs().amax().item() / 127 / 256 * 8)
    assert torch.equal(window_logits(model, per_block, rows, 8), got)


def test_mixed_formats_of_a_k_quant_file_step_in_cpp_as_in_python():
    """A Q4_K_M-like block: q|k in Q4_K and v in Q6_K (a row split of the fused qkv), the MLP in Q5_K and
    Q6_K, the output in Q8_0: one C++ call per block, as the Python step, as the readable forward."""
    model = family_model("llama", d_model=256, d_mlp=256, n_heads=4, n_kv_heads=2)
    kv_rows = 2 * 64  # two key (and two value) heads of 64
    apply_transform(model, "row_split", layers={f"blocks.{i}.attn.qkv": [256 + kv_rows, kv_rows] for i in range(2)})
    formats = {"attn.qkv.parts.0": "q4_k", "attn.qkv.parts.1": "q6_k", "attn.out": "q8_0", "mlp.gate": "q5_k",
               "mlp.up": "q4_k", "mlp.down": "q6_k"}
    for i, block in enumerate(model.blocks):
        for name, qtype in formats.items():
            parent, _, child = name.rpartition(".")
            layer = block.get_submodule(name)
            blocks = random_blocks(qtype, layer.weight.shape[0], layer.weight.shape[1], seed=i)
            setattr(block.get_submodule(parent), child, BlockLinear.from_blocks(blocks, None, qtype))
    native, python = FastDecoder(model), FastDecoder(model, native_blocks=False)
    assert native.native_stack is not None
    rows = [[5, 9, 3, 7, 1], [4, 6]]
    expected = window_logits(model, python, rows, 6)
    got = window_logits(model, native, rows, 6)
    torch.testing.assert_close(got, expected, rtol=0, atol=expected.abs().amax().item() / 127 / 256 * 8)
    # And the readable forward on the blocks' exact values (float64), within the kernels' activation rounding.
    reference = copy.deepcopy(model)
    for module in reference.modules():
        if hasattr(module, "impl"):
            module.impl = "readable"
    tokens, logits = greedy_logits(model, rows, 6, fast=True)
    ref_tokens, ref_logits = greedy_logits(reference.double(), rows, 6, fast=False)
    assert tokens == ref_tokens
    torch.testing.assert_close(logits.double(), ref_logits.double(), rtol=0, atol=ref_logits.abs().amax().item() * 2e-3)


def test_blocks_with_float_or_adapted_products_keep_the_python_step():
    model = family_model("llama")
    assert native_block(FastDecoder(model, native_blocks=False).layers[0]) is None  # float32 weights
    apply_transform(model, "int8")
    assert native_block(FastDecoder(model, native_blocks=False).layers[0]) is not None
    assert FastDecoder(model).native_stack is not None
    apply_transform(model, "lora")  # adapters on q and v: the qkv product is no longer a packed matrix
    assert not any(isinstance(step, torch.ScriptMethod) for step in FastDecoder(model).steps)
    assert FastDecoder(model).native_stack is None


def test_a_native_stack_given_the_wrong_caches_says_so():
    model = family_model("llama")
    apply_transform(model, "int8")
    stack, cache = FastDecoder(model).native_stack, model.new_kv_cache(1, 8)
    x = torch.randn(1, 1, model.config.d_model)
    with pytest.raises(RuntimeError, match="Stack.step: 2 blocks, 1 key and 2 value caches"):
        stack.step(x, cache.keys[:1], cache.values, 0, torch.tensor([0]), None)


def test_a_window_builds_its_fast_step_at_the_first_decode(monkeypatch):
    """Serve's newcomers and scored prompts only prefill: they must not pay for the C++ Blocks."""
    model = family_model("llama")
    apply_transform(model, "int8")
    built = []
    original = FastDecoder.for_model
    monkeypatch.setattr(FastDecoder, "for_model", classmethod(lambda cls, m: built.append(m) or original(m)))
    window = DecodeWindow(model, 1, 8)
    with torch.inference_mode():
        logits = window.prefill([[1, 2, 3]])
        assert built == []
        for _ in range(2):
            logits = window.decode(logits.argmax(-1))
    assert built == [model] and window.fast.native_stack is not None


def test_rows_joining_and_leaving_decode_as_the_readable_step():
    """What `glasslm serve`'s continuous batches do to a window (extend, keep_rows), through the fast step."""
    model = family_model("llama")
    results = {}
    for fast in (True, False):
        window, newcomer = DecodeWindow(model, 2, 20), DecodeWindow(model, 1, 20)
        if not fast:
            window.fast = newcomer.fast = None
        with torch.inference_mode():
            logits = [window.prefill([[1, 2, 3, 4], [5, 6]])]
            logits.append(window.decode(logits[-1].argmax(-1)))
            newcomer.prefill([[7, 8, 9, 1, 2, 3]])
            window.extend(newcomer)
            logits.append(window.decode(torch.tensor([3, 4, 5])))
            window.keep_rows([2, 1])
            logits.append(window.decode(logits[-1][[2, 1]].argmax(-1)))
            for _ in range(3):
                logits.append(window.decode(logits[-1].argmax(-1)))
        results[fast] = logits
    for fast_logits, readable_logits in zip(results[True], results[False]):
        torch.testing.assert_close(fast_logits, readable_logits, rtol=0, atol=2e-5 * readable_logits.abs().max().item())


def test_hooks_get_the_readable_forward():
    model = family_model("llama")
    seen = []
    handle = model.blocks[1].hook_resid_post.register_forward_hook(lambda module, args, out: seen.append(out.shape))
    window = DecodeWindow(model, 1, 16)
    assert not window.fast.usable()
    with torch.inference_mode():
        window.prefill([[1, 2, 3]])
        window.decode(torch.tensor([4]))
    assert len(seen) == 2  # the prefill and the decoding step both ran the hook point
    handle.remove()
    assert window.fast.usable()


@pytest.mark.parametrize("option", ["use_attn_result", "use_split_qkv_input", "training"])
def test_transformer_lens_options_and_training_get_the_readable_forward(option):
    model = family_model("llama")
    fast = FastDecoder.for_model(model)
    assert fast.usable()
    if option == "training":
        model.train()
    elif option == "use_attn_result":
        model.blocks[0].attn.use_attn_result = True
    else:
        model.blocks[1].use_split_qkv_input = True
    assert not fast.usable()


def test_bf16_and_post_norm_blocks_run_the_readable_forward():
    assert "float32" in unsupported(family_model("llama").to(torch.bfloat16))
    assert "post-norm" in unsupported(TransformerLM(get_preset("vaswani-decoder", **SHAPE)))


def test_generate_through_the_fast_step_equals_the_readable_step(monkeypatch):
    model = family_model("neox")
    prompts = [[3, 1, 4, 1, 5], [9, 2]]
    fast = [g.tokens for g in generate(model, prompts, max_new_tokens=30, temperature=0.0)]  # past the context
    monkeypatch.setattr(FastDecoder, "usable", lambda self: False)
    readable = [g.tokens for g in generate(model, prompts, max_new_tokens=30, temperature=0.0)]
    assert fast == readable


def test_kernels_off_gives_the_readable_forward():
    code = ("import torch; from glasslm.presets import get_preset; from glasslm.core.model import TransformerLM; "
            "from glasslm.generation import DecodeWindow; "
            "print(DecodeWindow(TransformerLM(get_preset('llama-tiny')).eval(), 1, 8).fast)")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "GLASSLM_KERNELS": "off"},
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "None"


def test_soft_capped_attention_falls_back_to_the_readable_step():
    """kernels/decode.cpp's attention has no score cap: a model with one (Gemma 2) is refused by the fast
    step, by name, and decodes through the readable forward, ragged rows included, as it computes."""
    model = family_model("gemma-capped-logits", attn_softcap=2.0)
    assert unsupported(model) == "soft-capped attention scores (Gemma 2) run the readable step"
    assert FastDecoder.for_model(model) is None
    rows = [[5, 9, 3, 7, 1, 2, 8], [4, 6]]
    window = DecodeWindow(model, 2, 20)
    with torch.inference_mode():
        window.prefill(rows)
        window.decode(torch.tensor([1, 2]))
    assert window.fast is None
    tokens, logits = greedy_logits(model, rows, 12, fast=False)
    ref_tokens, ref_logits = greedy_logits(copy.deepcopy(model).double(), rows, 12, fast=False)
    assert tokens == ref_tokens
    assert_float_close(logits, ref_logits)
    uncapped = copy.deepcopy(model)
    for block in uncapped.blocks:
        block.attn.cap = None
    assert (greedy_logits(uncapped, rows, 12, fast=False)[1] - logits).abs().max() > 0.1  # the cap matters here
