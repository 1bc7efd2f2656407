"""kernels/experts.cpp: a decoding step's rows through their chosen experts only, on each instruction
path, equal to the readable definition (kernels/experts.py) to the int8 rounding of the activations,
and to a sum of the kernels' own single products in the same order exactly."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from glasslm.kernels import build
from glasslm.kernels.experts import experts_reference, native_experts
from glasslm.kernels.qmatmul import kernel_ops, qlinear
from glasslm.transforms.experts import ExpertBlocks
from tests.ggml_blocks import random_blocks

pytestmark = pytest.mark.skipif(kernel_ops() is None, reason="the C++ kernels are not built here")

N, D_MODEL, D_EXPERT = 6, 256, 256


def stacked(qtype: str, d_out: int, d_in: int, seed: int) -> ExpertBlocks:
    """Random experts in `qtype` (the K-quants' random valid blocks, the rest quantized from floats)."""
    if qtype in ("q4_k", "q5_k", "q6_k"):
        layer = ExpertBlocks(N, d_out, d_in, qtype)
        layer.weight_blocks = random_blocks(qtype, N * d_out, d_in, seed=seed)
        layer.prepare_for_compile()
        return layer
    torch.manual_seed(seed)
    return ExpertBlocks.from_weight(torch.randn(N, d_out, d_in) * 0.05, qtype)


@pytest.fixture(params=["avx512", "avx2", "scalar"])
def isa(request):
    if request.param not in build.supported_isas():
        pytest.skip(f"this CPU has no {request.param}")
    with build.use_isa(request.param):
        yield request.param


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("chosen", [2, 1])
@pytest.mark.parametrize("qtype", ["q8_0", "q4_0", "q4_k", "q6_k", "f16", "bf16", "f32"])
def test_chosen_experts_through_the_kernel_equal_the_definition(qtype, chosen, threads, isa):
    """Two experts a row on two threads: a thread per expert; one: each product split over the threads."""
    gate, up, down = stacked(qtype, D_EXPERT, D_MODEL, 1), stacked(qtype, D_EXPERT, D_MODEL, 2), \
        stacked(qtype, D_MODEL, D_EXPERT, 3)
    torch.manual_seed(4)
    x = torch.randn(3, D_MODEL)
    ids = torch.tensor([[5, 0], [2, 5], [3, 3]])[:, :chosen]  # a repeated expert too
    w = torch.softmax(torch.randn(3, 2), -1)[:, :chosen]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = native_experts(gate.expert_matrices(), up.expert_matrices(), down.expert_matrices())(x, ids, w)
    finally:
        torch.set_num_threads(before)
    want = experts_reference(x, ids, w, gate.weight, up.weight, down.weight)
    # The kernels round x (and the hidden SwiGLU rows) to two int8 passes: good to ~1/256 of a step.
    assert (got - want).abs().max() <= 2e-3 * want.abs().max()
    assert (got - want).abs().max() > 0 or qtype == "f32"  # (float weights: the products are float ones)
    # Exactly the sum of the kernels' own single products, in increasing expert id.
    by_products = torch.zeros_like(want)
    for r in range(3):
        for j in torch.argsort(ids[r], stable=True).tolist():  # (a row's experts, in increasing id)
            e = int(ids[r, j])
            hidden = F.silu(gate.expert(e, x[r:r + 1])) * up.expert(e, x[r:r + 1])
            by_products[r] = by_products[r] + down.expert(e, hidden)[0] * w[r, j]
    torch.testing.assert_close(got, by_products, rtol=0, atol=1e-6 * want.abs().max().item())


def test_only_the_chosen_experts_are_read():
    """Experts nobody chose may hold anything: zeroing or scrambling them changes nothing."""
    gate, up, down = stacked("q8_0", D_EXPERT, D_MODEL, 1), stacked("q8_0", D_EXPERT, D_MODEL, 2), \
        stacked("q8_0", D_MODEL, D_EXPERT, 3)
    x, ids, w = torch.randn(1, D_MODEL), torch.tensor([[1, 4]]), torch.tensor([[0.75, 0.25]])
    before = native_experts(gate.expert_matrices(), up.expert_matrices(), down.expert_matrices())(x, ids, w)
    views = [m.expert_matrices() for m in (gate, up, down)]
    for matrices in views:
        for e in (0, 2, 3, 5):
            matrices[e].levels.random_(0, 256)  # (views of the packed panels: the layers change with them)
    after = native_experts(*views)(x, ids, w)
    assert torch.equal(before, after)
    matrices = views[2]
    matrices[4].levels.random_(0, 256)
    assert not torch.equal(native_experts(*views)(x, ids, w), before)


def test_bad_calls_are_refused_by_name():
    gate, up, down = stacked("q8_0", D_EXPERT, D_MODEL, 1), stacked("q8_0", D_EXPERT, D_MODEL, 2), \
        stacked("q8_0", D_MODEL, D_EXPERT, 3)
    native = native_experts(gate.expert_matrices(), up.expert_matrices(), down.expert_matrices())
    with pytest.raises(RuntimeError, match="expert id 6 is not one of the 6 experts"):
        native(torch.randn(1, D_MODEL), torch.tensor([[6, 0]]), torch.tensor([[0.5, 0.5]]))
    with pytest.raises(RuntimeError, match="x must be float32"):
        native(torch.randn(1, 32), torch.tensor([[1, 0]]), torch.tensor([[0.5, 0.5]]))
    with pytest.raises(ValueError, match="every expert needs a gate, up and down matrix"):
        native_experts(gate.expert_matrices(), up.expert_matrices()[:3], down.expert_matrices())
