"""A mixture of experts' stacked matrices kept in llama.cpp's block formats: `ExpertBlocks`, and the
`expert_blocks` transform that puts them in a model.

A GGUF file holds each projection of a layer's experts as ONE 3-D tensor (ffn_gate_exps, ffn_up_exps:
(n_experts, d_expert, d_model); ffn_down_exps: (n_experts, d_model, d_expert)), each row of each
expert in its blocks, the experts one after another: the n_experts * d_out rows of one 2-D matrix.
`ExpertBlocks` is that matrix as a `BlockLinear` (so it packs into the kernels' panels as the bytes
arrive, keeps one copy, and writes the file's bytes back bit for bit), read one expert at a time:
expert e is rows e * d_out ... (e + 1) * d_out, which, when d_out is a multiple of the kernels' panel
of 16 rows, are whole panels: `expert_matrices()` gives each expert's packed matrix as a view of
them, no copy. `MoE.expert` (core/moe.py) calls `expert(e, x)` for a projection kept this way, and the
fast decoding step hands the views to the C++ `Experts` (kernels/experts.cpp), which reads only the
chosen experts' panels.

The transform: `apply_transform(model, "expert_blocks", qtype="q8_0")` quantizes every MoE layer's
float experts to one of the formats glasslm writes; a GGUF import records which layers it kept in
which format (`layers`: name -> qtype), and `rebuild` gives an empty model those layers.

Example:
    >>> import torch
    >>> from glasslm.core.model import TransformerLM
    >>> from glasslm.core.config import ModelConfig
    >>> from glasslm.transforms import apply_transform
    >>> model = TransformerLM(ModelConfig(vocab_size=64, context_length=16, d_model=64, n_layers=1, n_heads=2,
    ...     d_mlp=32, positional="rope", norm="rmsnorm", mlp="swiglu", n_experts=4, experts_per_token=2)).eval()
    >>> x = torch.tensor([[1, 2, 3]])
    >>> before = model(x)
    >>> apply_transform(model, "expert_blocks", qtype="q8_0")
    >>> gate = model.blocks[0].mlp.gate
    >>> type(gate).__name__, tuple(gate.shape), gate.qtype
    ('ExpertBlocks', (4, 32, 64), 'q8_0')
    >>> bool((model(x) - before).abs().max() < 0.05 * before.abs().max())
    True
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from jaxtyping import Float
from torch import Tensor, nn

from glasslm.kernels.qmatmul import PANEL, PackedMatrix, qlinear
from glasslm.transforms.ggml import FORMATS, QUANTIZABLE, BlockLinear, dequantize_blocks, quantize_blocks
from glasslm.transforms.registry import Transform

PROJECTIONS = ("gate", "up", "down")  # MoE's stacked expert parameters


class ExpertBlocks(BlockLinear):
    """A stacked expert projection (n_experts, d_out, d_in) as one BlockLinear of n_experts * d_out rows
    (see the module docstring); `expert(e, x)` is x @ W_e.T."""

    def __init__(self, n_experts: int, d_out: int, d_in: int, qtype: str, impl: str = "fast"):
        super().__init__(d_in, n_experts * d_out, qtype, bias=False, impl=impl)
        self.n_experts, self.expert_rows = n_experts, d_out
        self._views: tuple[PackedMatrix, list[PackedMatrix]] | None = None  # (packed matrix, its experts' views)

    @classmethod
    def from_weight(cls, weight: Float[Tensor, "n d_out d_in"], qtype: str, impl: str = "fast") -> ExpertBlocks:
        """`weight` quantized to `qtype` (one of the formats glasslm writes), row by row as llama.cpp would."""
        n, d_out, d_in = weight.shape
        layer = cls(n, d_out, d_in, qtype, impl)
        layer.weight_blocks = quantize_blocks(weight.reshape(n * d_out, d_in), qtype)
        layer.prepare_for_compile()
        return layer

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.n_experts, self.expert_rows, self.d_in))

    @property
    def weight(self) -> Float[Tensor, "n d_out d_in"]:
        """All experts as float32 (export, analysis); a decoding step reads only the chosen ones."""
        return self.dequantized_weight().reshape(self.shape)

    def __getitem__(self, e: int) -> Float[Tensor, "d_out d_in"]:
        """Expert e's matrix as float32 (as the stacked float parameter would give it)."""
        return dequantize_blocks(self.blocks()[e * self.expert_rows:(e + 1) * self.expert_rows], self.qtype)

    def expert_matrices(self) -> list[PackedMatrix] | None:
        """Each expert's packed matrix, a view of its panels, or of its rows for float weights (None: the
        layer is not packed for the kernels, or an expert's rows are not whole panels of 16)."""
        kernel = self.kernel_matrix()
        if kernel is None or self.expert_rows % PANEL:
            return None
        if self._views is None or self._views[0] is not kernel:
            # (float weights are the matrix's own rows; packed ones, panels of 16 rows)
            step = self.expert_rows if kernel.scales is None else self.expert_rows // PANEL

            def rows_of(t: Tensor | None, e: int) -> Tensor | None:
                return None if t is None else t[e * step:(e + 1) * step]

            views = [dataclasses.replace(kernel, levels=rows_of(kernel.levels, e), scales=rows_of(kernel.scales, e),
                                         mins=rows_of(kernel.mins, e), super_scales=rows_of(kernel.super_scales, e),
                                         super_mins=rows_of(kernel.super_mins, e), d_out=self.expert_rows)
                     for e in range(self.n_experts)]
            self._views = (kernel, views)
        return self._views[1]

    def expert(self, e: int, x: Float[Tensor, "... d_in"]) -> Float[Tensor, "... d_out"]:
        """x @ W_e.T: through the kernels on expert e's panels, else with its rows dequantized."""
        views = self.expert_matrices() if x.is_cpu and not (torch.is_grad_enabled() and x.requires_grad) else None
        if views is not None:
            return qlinear(x, views[e])
        return F.linear(x, self[e].to(x.dtype))

    def _restore_blocks(self) -> None:
        self._views = None
        super()._restore_blocks()

    def extra_repr(self) -> str:
        return f"n_experts={self.n_experts}, d_out={self.expert_rows}, d_in={self.d_in}, qtype={self.qtype}"


@dataclass(frozen=True)
class ExpertBlockOptions:
    """`qtype`: the format to quantize every MoE layer's experts to (apply); `layers`: projection name
    (`blocks.{i}.mlp.gate`) -> its format, as a GGUF import records it (rebuild; apply quantizes those only)."""

    qtype: str = "q8_0"
    layers: dict[str, str] | None = None


def _expert_targets(model: nn.Module, options: ExpertBlockOptions) -> dict[str, str]:
    """Projection name -> format: the named ones (each must be a MoE layer's projection), else all."""
    moes = {name for name, m in model.named_modules() if all(hasattr(m, p) for p in PROJECTIONS) and hasattr(m, "router")}
    every = {f"{name}.{p}": options.qtype for name in sorted(moes) for p in PROJECTIONS}
    if options.layers is None:
        if not every:
            raise ValueError("expert_blocks: this model has no mixture-of-experts layers")
        return every
    wrong = sorted(set(options.layers) - set(every))
    if wrong:
        raise ValueError(f"expert_blocks: layers {wrong[:4]} are not experts' projections of this model")
    unknown = sorted({q for q in options.layers.values() if q not in FORMATS})
    if unknown:
        raise ValueError(f"expert_blocks: layers formats {unknown} unknown; choose from {', '.join(FORMATS)}")
    return dict(options.layers)


def _apply(model: nn.Module, options: ExpertBlockOptions, quantize: bool) -> None:
    if options.qtype not in FORMATS:
        raise ValueError(f"expert_blocks: qtype {options.qtype!r} unknown; choose from {', '.join(FORMATS)}")
    impl = getattr(getattr(model, "config", None), "impl", "fast")
    for name, qtype in _expert_targets(model, options).items():
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        stacked = getattr(parent, child)
        if isinstance(stacked, ExpertBlocks):
            raise ValueError(f"expert_blocks: {name} is already kept in {stacked.qtype} blocks")
        if quantize and qtype not in QUANTIZABLE:
            raise ValueError(f"glasslm cannot write {qtype} blocks; it quantizes experts to {', '.join(QUANTIZABLE)}")
        n, d_out, d_in = stacked.shape
        if d_in % FORMATS[qtype].inputs:
            raise ValueError(f"expert_blocks: {name}'s rows of {d_in} do not divide into {qtype} blocks")
        if quantize:
            layer = ExpertBlocks.from_weight(stacked.detach(), qtype, impl)
        else:
            with torch.device(stacked.device):  # (a checkpoint's empty model: meta, no bytes zeroed)
                layer = ExpertBlocks(n, d_out, d_in, qtype, impl)
        delattr(parent, child)  # (a parameter's name takes only a parameter until it is removed)
        setattr(parent, child, layer)


EXPERT_BLOCKS = Transform(
    "expert_blocks", lambda model, options: _apply(model, options, quantize=True), options=ExpertBlockOptions,
    rebuild=lambda model, options: _apply(model, options, quantize=False),
    summary="a mixture of experts' stacked matrices in llama.cpp's blocks (q8_0 ...; a GGUF file's formats on import)")
