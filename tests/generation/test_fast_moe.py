"""The fast decoding step on mixture-of-experts models (generation/fast.py's `_Experts`): the router and
core/moe.py's `route` pick each row's experts, and only those run, in one C++ call per layer where the
experts are kept in blocks (kernels/experts.cpp). Its logits are the readable step's (float experts: to
float32 summation order against float64; blocks: to the kernels' activation rounding), greedy tokens
equal, on random Mixtral / Qwen3-MoE / Qwen2-MoE / OLMoE models, on every instruction path, and on files
llama.cpp's quantizer wrote."""

from __future__ import annotations

import copy

import pytest
import torch

from glasslm.core.model import TransformerLM
from glasslm.generation.fast import FastDecoder, unsupported
from glasslm.kernels import build
from glasslm.kernels.decode import decode_ops
from glasslm.presets import get_preset
from glasslm.transforms import apply_transform
from tests.generation.test_fast import assert_float_close, greedy_logits
from tests.moe_models import perturbed_moe

pytestmark = pytest.mark.skipif(decode_ops() is None, reason="the C++ kernels are not built here")

_SMALL = dict(vocab_size=97, n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, d_mlp=96, context_length=32,
              n_experts=6, experts_per_token=2)
CONFIGS = {
    "mixtral": dict(_SMALL),
    "qwen3_moe": dict(_SMALL, qk_norm=True, d_head=16, d_expert=64, experts_per_token=3),
    "qwen2_moe": dict(_SMALL, attn_qkv_bias=True, d_expert=64, d_shared_expert=80, router_renormalize=False),
    # OLMoE: q/k norms over the whole projection (all heads' features at once), no renormalising.
    "olmoe": dict(_SMALL, n_kv_heads=4, qk_norm=True, qk_norm_whole=True, router_renormalize=False),
}
ROWS = [[5, 9, 3, 7, 1, 2, 8], [4, 6]]  # ragged: the short row left-padded and masked


def moe_model(family: str, seed: int = 0, **changes) -> TransformerLM:
    """Every weight perturbed, the routers' 10x so each token's experts are a clear choice."""
    return perturbed_moe(get_preset("llama-tiny", **{**CONFIGS[family], **changes}), scale=0.3, seed=seed)


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_float_experts_decode_as_the_readable_forward(family):
    model = moe_model(family)
    assert unsupported(model) is None
    fast = FastDecoder.for_model(model)
    assert all(layer.moe is not None and layer.moe.native is None for layer in fast.layers)  # (float experts)
    tokens, logits = greedy_logits(model, ROWS, 10, fast=True)
    reference = copy.deepcopy(model).double()
    ref_tokens, ref_logits = greedy_logits(reference, ROWS, 10, fast=False)
    assert tokens == ref_tokens
    assert_float_close(logits, ref_logits)


@pytest.mark.parametrize("isa", ["avx512", "avx2", "scalar"])
@pytest.mark.parametrize("qtype", ["q8_0", "q4_0", "f16"])
@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_experts_in_blocks_decode_in_cpp_as_the_readable_step(family, qtype, isa):
    if isa not in build.supported_isas():
        pytest.skip(f"this CPU has no {isa}")
    model = moe_model(family, seed=1)
    apply_transform(model, "expert_blocks", qtype=qtype)
    with build.use_isa(isa):
        fast = FastDecoder.for_model(model)
        assert all(layer.moe.native is not None for layer in fast.layers)  # one C++ call per layer
        tokens, logits = greedy_logits(model, ROWS, 10, fast=True)
        ref_tokens, ref_logits = greedy_logits(model, ROWS, 10, fast=False)
    assert tokens == ref_tokens
    # The same kernels on the same rows; the SwiGLU's SiLU is decode.cpp's there and ATen's here, which may
    # move a hidden value to the next int8 step: the dense layers' tolerance (tests/generation/test_fast.py)
    # for each of the k experts' down products a row adds.
    k = model.config.experts_per_token
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=ref_logits.abs().amax().item() / 127 / 256 * 8 * k)
    # And far from a float model's (the experts really are in q8_0 ...): not the float experts' logits.
    assert not torch.allclose(logits, greedy_logits(moe_model(family, seed=1), ROWS, 10, fast=False)[1])


def test_lora_on_the_experts_gets_the_readable_forward():
    from glasslm.transforms.lora import LoRAConfig, add_lora

    model = moe_model("mixtral")
    add_lora(model, LoRAConfig(rank=2, sites=("q", "mlp_gate", "mlp_up", "mlp_down")))
    assert unsupported(model) == "adapters on a mixture of experts' experts run the readable step"
    assert FastDecoder.for_model(model) is None


def test_a_hook_on_the_router_gets_the_readable_forward():
    model = moe_model("mixtral")
    apply_transform(model, "expert_blocks", qtype="q8_0")
    fast = FastDecoder.for_model(model)
    assert fast.usable()
    handle = model.blocks[0].mlp.hook_router_logits.register_forward_hook(lambda m, i, o: o)
    assert not fast.usable()
    handle.remove()
    assert fast.usable()


@pytest.mark.parametrize("family, ftype, kept", [("qwen3_moe", "q4_k_m", ("q4_k", "q6_k")), ("mixtral", "q8_0", ("q8_0",))])
def test_a_file_llama_cpps_quantizer_wrote_decodes_fast_as_the_readable_step(family, ftype, kept, tmp_path, capsys):
    """Random weights at a shape the K-quants take (rows of 256), exported f32 by glasslm, quantized by
    llama.cpp: every expert tensor stays in its blocks (Q4_K_M gives some layers' down experts Q6_K), the
    fast step reads them in C++, its greedy tokens and logits are the readable step's on the same blocks."""
    pytest.importorskip("llama_cpp")
    from glasslm.cli import main
    from glasslm.hf.gguf.exporter import export_gguf
    from glasslm.hf.gguf.importer import import_gguf
    from tests.llamacpp import llama_cpp_quantize

    model = moe_model(family, seed=2, d_model=256, d_expert=256, d_head=64, vocab_size=300)
    export_gguf(model, tmp_path / "f32.gguf", None, "f32")
    llama_cpp_quantize(tmp_path / "f32.gguf", tmp_path / "q.gguf", ftype)
    loaded = import_gguf(tmp_path / "q.gguf")
    experts = {name: m.qtype for name, m in loaded.model.named_modules() if type(m).__name__ == "ExpertBlocks"}
    assert len(experts) == 3 * model.config.n_layers and set(experts.values()) <= set(kept)
    assert not any(q in loaded.dequantized for q in kept)
    assert main(["info", "--checkpoint", str(tmp_path / "q.gguf")]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("tensors: "))
    counts = {q: list(experts.values()).count(q) for q in kept}
    assert all(f"{n} {q} (experts)" in line for q, n in counts.items() if n)  # `glasslm info` says they stay
    fast = FastDecoder.for_model(loaded.model)
    assert all(layer.moe.native is not None for layer in fast.layers)
    tokens, logits = greedy_logits(loaded.model, ROWS, 10, fast=True)
    ref_tokens, ref_logits = greedy_logits(loaded.model, ROWS, 10, fast=False)
    assert tokens == ref_tokens
    # As above, with rows of 256 (four times the inputs each rounding step gathers) and ten steps whose
    # differences pass on through the caches: measured 4.7 (Qwen3-MoE Q4_K_M) and 19.6 (Mixtral Q8_0, the
    # tenth step) of these steps.
    step = ref_logits.abs().amax().item() / 127 / 256
    gap = (logits - ref_logits).abs().max().item() / step
    print(f"{family} {ftype}: fast vs readable step, max |logit diff| {gap:.1f} activation steps")
    assert gap <= 16 * model.config.experts_per_token
