"""LoRA: low-rank adapters on a frozen model (Hu et al., 2021), its DoRA and rsLoRA variants, and
QLoRA's quantized base.

An adapted linear map computes

    y = base(x) + s * B (A dropout(x)),    s = alpha / rank   (rsLoRA: alpha / sqrt(rank))

with A (rank, d_in) drawn Kaiming-uniform and B (d_out, rank) zero, as in the paper: the adapted
model starts exactly equal to the base. Only A and B train. The base may be a float `Linear` or
an int8/int4 layer (QLoRA): gradients reach earlier layers through the dequantized base weight.

DoRA (Liu et al., 2024) splits each output row of the adapted weight W + s B A into a direction and
a learned length m (one per row, starting at the row's norm):

    y = (m / ||W + s B A||_row) * (W + s B A) x + bias

and, as the paper (section 4.3) and PEFT do, treats the norm as a constant in backward.

glasslm keeps q, k and v in one fused matrix (`attn.qkv`); adapting "q" and "v" there adds an
adapter on those row blocks only, so the model behaves as three separately adapted projections.
The token embedding ("embed") is adapted as the linear map from a one-hot token to its vector, whose
weight is the table transposed. A tied unembedding ("unembed" on a tied model) is adapted on its own:
the embedding lookup stays as it was, as in PEFT.

Besides the adapters, `bias` trains biases ("lora_only": those of the adapted maps; "all") and
`full` trains whole modules (the embedding, the unembedding: PEFT's `modules_to_save`); a tied
model is untied for that, so the two train apart. All of these are the adapter's state
(`lora_state_dict`).

A mixture of experts' stacked expert weights (`core/moe.py`) are adapted per expert (`LoRAExperts`):
"mlp_gate" and "mlp_up" together (one adapter over each expert's [gate | up] rows, as peft adapts
transformers' fused `gate_up_proj`) and "mlp_down"; each expert e adds s B_e A_e to its matrices.

Merging writes the adapted weight into the base (a float base only); un-merging puts back the exact
weight that was there before.

Example:
    >>> import torch
    >>> from glasslm.core.model import TransformerLM
    >>> from glasslm.presets import get_preset
    >>> model = TransformerLM(get_preset("llama-tiny", n_layers=1)).eval()
    >>> ids = torch.tensor([[1, 2, 3]])
    >>> before = model(ids)
    >>> add_lora(model, LoRAConfig(rank=4, sites=("q", "v", "mlp_down"), dora=True))
    >>> torch.allclose(model(ids), before, atol=1e-6)  # B starts at zero, each magnitude at its row's norm
    True
    >>> sorted({name.split(".")[-2] for name, p in model.named_parameters() if p.requires_grad})
    ['lora_a', 'lora_b', 'magnitude']
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import Tensor, nn

from glasslm.core.layers import Embedding, Linear, linear
from glasslm.core.moe import MoE
from glasslm.transforms.registry import Transform, applied_transforms

Site = Literal["q", "k", "v", "attn_out", "mlp_up", "mlp_gate", "mlp_down", "unembed", "embed"]
SITES: tuple[str, ...] = Site.__args__  # type: ignore[attr-defined]
FULL_MODULES = ("embed", "unembed")  # what `full` may name
BIAS_CHOICES = ("none", "lora_only", "all")
# Where each site lives in a glasslm model: the module's name ends with this.
_MODULE_OF = {"attn_out": "attn.out", "mlp_up": "mlp.up", "mlp_gate": "mlp.gate", "mlp_down": "mlp.down",
              "unembed": "unembed"}
_QKV = ("q", "k", "v")
_ADAPTER_PARAMETERS = ("lora_a", "lora_b", "magnitude")  # the ParameterLists every adapter holds


@dataclass(frozen=True)
class LoRAConfig:
    """Which maps get adapters, their size and variant, and what else trains with them."""

    rank: int = 8  # r: the adapters' inner width
    alpha: float = 16.0  # the update is scaled by alpha / rank (rsLoRA: alpha / sqrt(rank))
    dropout: float = 0.0  # dropout on the adapters' input while training
    sites: tuple[str, ...] = ("q", "v")  # any of q, k, v, attn_out, mlp_up, mlp_gate, mlp_down, unembed, embed
    rslora: bool = False  # rsLoRA (Kalajdzievski, 2023): scale by alpha / sqrt(rank)
    dora: bool = False  # DoRA: a learned length for each adapted output row
    # biases that train too: none, lora_only (those of the adapted maps), all
    bias: Literal["none", "lora_only", "all"] = "none"
    full: tuple[str, ...] = ()  # modules trained whole beside the adapters: embed, unembed (PEFT's modules_to_save)

    def __post_init__(self) -> None:
        object.__setattr__(self, "sites", tuple(self.sites))  # JSON gives back a list
        object.__setattr__(self, "full", tuple(self.full))
        if self.rank < 1:
            raise ValueError(f"LoRA rank must be >= 1, got {self.rank}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LoRA dropout must be in [0, 1), got {self.dropout}")
        unknown = [s for s in self.sites if s not in SITES]
        if unknown or not (self.sites or self.full):
            raise ValueError(f"unknown LoRA site(s) {unknown}; choose from {', '.join(SITES)}")
        if self.bias not in BIAS_CHOICES:
            raise ValueError(f"LoRA bias must be one of {', '.join(BIAS_CHOICES)}, got {self.bias!r}")
        if any(m not in FULL_MODULES for m in self.full) or set(self.full) & set(self.sites):
            raise ValueError(f"LoRA full modules must be among {', '.join(FULL_MODULES)} and not also adapted "
                             f"sites, got full={list(self.full)} with sites={list(self.sites)}")

    @property
    def scaling(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)


def dora_scale(weight: Float[Tensor, "rows d_in"], update: Float[Tensor, "rows d_in"],
               magnitude: Float[Tensor, " rows"]) -> Float[Tensor, " rows"]:
    """DoRA's factor for each output row: its learned length over the adapted row's norm, the norm a
    constant in backward (the paper's section 4.3)."""
    return magnitude / torch.linalg.norm(weight + update, dim=1).detach()


def base_weight(module: nn.Module) -> Float[Tensor, "d_out d_in"]:
    """The matrix a linear base computes with: a float weight, or a quantized one dequantized."""
    if hasattr(module, "dequantized_weight"):
        return module.dequantized_weight(torch.float32)
    return module.weight


class TiedUnembedding(nn.Module):
    """A tied model's unembedding as a map of its own, logits = x Eᵀ with E the embedding table (not a
    copy), so that an adapter can wrap it. The table stays the embedding's: it is saved once, there."""

    def __init__(self, embed: nn.Module):
        super().__init__()
        self._embed = [embed]  # in a list: not a submodule, so the table is not a second parameter

    @property
    def weight(self) -> Float[Tensor, "vocab d_model"]:
        return self._embed[0].weight

    @property
    def d_in(self) -> int:
        return self.weight.shape[1]

    @property
    def d_out(self) -> int:
        return self.weight.shape[0]

    def forward(self, x: Float[Tensor, "... d_model"]) -> Float[Tensor, "... vocab"]:
        return linear(x, self.weight)


class _Adapter(nn.Module):
    """What both adapters share: merging writes `merged_weight()` into the base's weight (`base.weight`),
    un-merging puts back the exact weight that was there."""

    base: nn.Module
    _unmerged_weight: Tensor | None = None
    disabled: bool = False  # set by `adapters_disabled`: the layer computes its base alone

    @property
    def merged(self) -> bool:
        return self._unmerged_weight is not None

    def merged_weight(self) -> Tensor:
        raise NotImplementedError

    def check_mergeable(self) -> None:
        """Raise if the base cannot take the adapter's update."""

    @torch.no_grad()
    def merge(self) -> None:
        self.check_mergeable()
        if not self.merged:
            self._unmerged_weight = self.base.weight.detach().clone()
            self.base.weight.copy_(self.merged_weight().to(self.base.weight.dtype))

    @torch.no_grad()
    def unmerge(self) -> None:
        if self.merged:
            self.base.weight.copy_(self._unmerged_weight)
            self._unmerged_weight = None


class LoRALinear(_Adapter):
    """`base` plus one low-rank adapter per adapted block of output rows.

    `row_blocks` lists the [start, end) output rows each adapter adds to: one block covering every
    row for an ordinary site; q, k and/or v's blocks for the fused qkv matrix. With DoRA each block
    has a `magnitude` per row; rows outside every block are the base's.
    """

    def __init__(self, base: nn.Module, d_in: int, row_blocks: list[tuple[int, int]], config: LoRAConfig):
        super().__init__()
        self.base, self.d_in, self.row_blocks = base, d_in, row_blocks
        self.scaling, self.dropout = config.scaling, config.dropout
        self.d_out = _d_out(base)
        self.lora_a = nn.ParameterList(nn.Parameter(torch.empty(config.rank, d_in)) for _ in row_blocks)
        self.lora_b = nn.ParameterList(nn.Parameter(torch.zeros(end - start, config.rank)) for start, end in row_blocks)
        for a in self.lora_a:  # nn.Linear's own init, as the paper's reference code uses
            nn.init.kaiming_uniform_(a, a=math.sqrt(5))
        self.magnitude: nn.ParameterList | None = None
        if config.dora:  # each row's length starts at its norm: the adapted model equals the base
            weight = base_weight(base).detach()
            self.magnitude = nn.ParameterList(nn.Parameter(torch.linalg.norm(weight[start:end], dim=1).float())
                                              for start, end in row_blocks)
        self._unmerged_weight = None

    def forward(self, x: Float[Tensor, "... d_in"]) -> Float[Tensor, "... d_out"]:
        y = self.base(x)  # a quantized base is differentiable in x (glasslm.transforms.quantize)
        if self.merged or self.disabled:
            return y
        adapter_in = F.dropout(x, self.dropout, self.training)                      # (..., d_in)
        if self.row_blocks == [(0, self.d_out)]:
            return y + self._block_update(0, adapter_in, y)                           # (..., d_out)
        pieces, cursor = [], 0
        for i, (start, end) in enumerate(self.row_blocks):
            pieces += [y[..., cursor:start], y[..., start:end] + self._block_update(i, adapter_in, y)]
            cursor = end
        return torch.cat(pieces + [y[..., cursor:]], dim=-1)                          # (..., d_out)

    def _block_update(self, i: int, adapter_in: Tensor, y: Tensor) -> Float[Tensor, "... rows"]:
        """What block i adds to the base's output rows."""
        (start, end), a, b = self.row_blocks[i], self.lora_a[i], self.lora_b[i]
        update = (adapter_in @ a.T) @ b.T * self.scaling                               # (..., rows)
        if self.magnitude is None:
            return update
        weight = base_weight(self.base)[start:end].to(update.dtype)                    # (rows, d_in)
        scale = dora_scale(weight, (b @ a) * self.scaling, self.magnitude[i])         # (rows,)
        if self.training and self.dropout > 0:  # as PEFT: the base's part then reads the dropped-out input too
            plain = adapter_in @ weight.T
        else:
            bias = getattr(self.base, "bias", None)
            plain = y[..., start:end] - (bias[start:end] if bias is not None else 0)  # W x without the bias
        return (scale - 1) * plain + scale * update

    def merged_weight(self) -> Float[Tensor, "d_out d_in"]:
        """The base weight with every adapter written in: W + s B A (DoRA: rescaled to each row's magnitude)."""
        weight = base_weight(self.base).detach().float()
        merged = weight.clone()
        for i, ((start, end), a, b) in enumerate(zip(self.row_blocks, self.lora_a, self.lora_b)):
            update = (b @ a).detach().float() * self.scaling
            merged[start:end] += update
            if self.magnitude is not None:
                merged[start:end] *= dora_scale(weight[start:end], update, self.magnitude[i].detach().float())[:, None]
        return merged

    def delta_weight(self) -> Float[Tensor, "d_out d_in"]:
        """What merging adds to the base weight (zero outside the adapted rows)."""
        return self.merged_weight() - base_weight(self.base).detach().float()

    def check_mergeable(self) -> None:
        if isinstance(self.base, TiedUnembedding):
            raise ValueError("this adapter's base is the tied embedding table; untie the model first "
                             "(merge_lora and remove_lora do)")
        if not isinstance(self.base, Linear):
            raise ValueError("only a float base merges; dequantize the model first (QLoRA keeps its adapters)")

    def extra_repr(self) -> str:
        dora = ", dora" if self.magnitude is not None else ""
        return f"rank={self.lora_a[0].shape[0]}, scaling={self.scaling:g}, row_blocks={self.row_blocks}{dora}"


class LoRAEmbedding(_Adapter):
    """A token embedding plus a low-rank adapter, the table read as the linear map from a one-hot token
    to its vector: W = tableᵀ (d_model, vocab) becomes W + s B A with A (rank, vocab) and B
    (d_model, rank), so a token's vector gains s B A[:, token] (DoRA: each of the d_model features
    rescaled to its magnitude). As in PEFT, A starts at zero and B random, no dropout is applied, and
    `weight` is the base table: a tied unembedding keeps reading it."""

    def __init__(self, base: Embedding, config: LoRAConfig):
        super().__init__()
        self.base = base
        self.d_out, self.d_in = base.weight.shape[1], base.weight.shape[0]  # d_model, vocab
        self.row_blocks, self.scaling = [(0, self.d_out)], config.scaling
        self.lora_a = nn.ParameterList([nn.Parameter(torch.zeros(config.rank, self.d_in))])
        self.lora_b = nn.ParameterList([nn.Parameter(torch.randn(self.d_out, config.rank))])
        self.magnitude: nn.ParameterList | None = None
        if config.dora:
            self.magnitude = nn.ParameterList([nn.Parameter(torch.linalg.norm(base.weight.detach().T, dim=1).float())])
        self._unmerged_weight = None

    @property
    def weight(self) -> Float[Tensor, "vocab d_model"]:
        return self.base.weight

    @property
    def device(self) -> torch.device:
        return self.base.device

    @property
    def dtype(self) -> torch.dtype:
        return self.base.dtype

    def forward(self, tokens: Int[Tensor, "batch seq"]) -> Float[Tensor, "batch seq d_model"]:
        y = self.base(tokens)
        if self.merged or self.disabled:
            return y
        a, b = self.lora_a[0], self.lora_b[0]
        update = F.embedding(tokens, a.T) @ b.T * self.scaling                          # (batch, seq, d_model)
        if self.magnitude is None:
            return y + update
        scale = dora_scale(self.base.weight.T, (b @ a) * self.scaling, self.magnitude[0])  # (d_model,)
        return scale * (y + update)

    def merged_weight(self) -> Float[Tensor, "vocab d_model"]:
        """The table with the adapter written in (the adapted W, transposed back)."""
        weight = self.base.weight.detach().float().T                                    # (d_model, vocab)
        update = (self.lora_b[0] @ self.lora_a[0]).detach().float() * self.scaling
        merged = weight + update
        if self.magnitude is not None:
            merged = merged * dora_scale(weight, update, self.magnitude[0].detach().float())[:, None]
        return merged.T

    def extra_repr(self) -> str:
        dora = ", dora" if self.magnitude is not None else ""
        return f"rank={self.lora_a[0].shape[0]}, scaling={self.scaling:g}{dora}"


# An expert adapter's groups of stacked projections: gate and up share one (peft's fused gate_up_proj).
EXPERT_GROUPS = {"gate_up": ("gate", "up"), "down": ("down",)}
EXPERT_SITES = {"gate_up": ("mlp_gate", "mlp_up"), "down": ("mlp_down",)}


class LoRAExperts(nn.Module):
    """A mixture of experts (`MoE`) with low-rank adapters on its stacked expert weights.

    For each adapted group ("gate_up": the [gate | up] rows of every expert, "down"): A (n_experts,
    rank, d_in) and B (n_experts, rows, rank); expert e computes with W_e + s B_e A_e. The adapted
    stacks are formed on each call and the base MoE runs with them (`torch.func.functional_call`),
    so routing, hooks and the training statistics are the base's own.
    """

    def __init__(self, base: MoE, groups: tuple[str, ...], config: LoRAConfig):
        super().__init__()
        self.base, self.groups, self.scaling = base, groups, config.scaling
        self.disabled = False
        self._unmerged: dict[str, Tensor] | None = None
        n, rank = base.n_experts, config.rank
        self.lora_a, self.lora_b = nn.ParameterList(), nn.ParameterList()
        for group in groups:
            parts = [getattr(base, p) for p in EXPERT_GROUPS[group]]          # (n, rows, d_in) each
            a = torch.empty(n, rank, parts[0].shape[2], device=parts[0].device)
            for e in range(n):  # as nn.Linear's own init, one expert at a time
                nn.init.kaiming_uniform_(a[e], a=math.sqrt(5))
            self.lora_a.append(nn.Parameter(a))
            rows = sum(p.shape[1] for p in parts)
            self.lora_b.append(nn.Parameter(torch.zeros(n, rows, rank, device=parts[0].device)))

    @property
    def merged(self) -> bool:
        return self._unmerged is not None

    def adapted_weights(self) -> dict[str, Float[Tensor, "n_experts d_out d_in"]]:
        """Each adapted stack with its update written in: {"gate": W_gate + s B[:, :d_expert] A, ...}."""
        out = {}
        for group, a, b in zip(self.groups, self.lora_a, self.lora_b):
            update = torch.bmm(b, a) * self.scaling                                     # (n, rows, d_in)
            names = EXPERT_GROUPS[group]
            pieces = update.split([getattr(self.base, p).shape[1] for p in names], dim=1)
            for name, piece in zip(names, pieces):
                out[name] = getattr(self.base, name) + piece.to(getattr(self.base, name).dtype)
        return out

    def forward(self, x: Float[Tensor, "batch seq d_model"]) -> Float[Tensor, "batch seq d_model"]:
        if self.merged or self.disabled:
            return self.base(x)
        return torch.func.functional_call(self.base, self.adapted_weights(), (x,), strict=False)

    def check_mergeable(self) -> None:
        """Expert stacks are float parameters: they always merge."""

    @torch.no_grad()
    def merge(self) -> None:
        if not self.merged:
            weights = self.adapted_weights()
            self._unmerged = {name: getattr(self.base, name).detach().clone() for name in weights}
            for name, value in weights.items():
                getattr(self.base, name).copy_(value)

    @torch.no_grad()
    def unmerge(self) -> None:
        if self.merged:
            for name, value in self._unmerged.items():
                getattr(self.base, name).copy_(value)
            self._unmerged = None

    def extra_repr(self) -> str:
        return f"rank={self.lora_a[0].shape[1]}, scaling={self.scaling:g}, groups={self.groups}"


def expert_groups(config: LoRAConfig) -> tuple[str, ...]:
    """The expert groups `config`'s sites adapt ("gate_up", "down"); gate without up (or up without
    gate) is refused: peft adapts the experts' [gate | up] stack as one."""
    gate_up = [site in config.sites for site in EXPERT_SITES["gate_up"]]
    if any(gate_up) and not all(gate_up):
        raise ValueError("LoRA on a mixture of experts adapts mlp_gate and mlp_up together (peft's gate_up_proj, "
                         f"each expert's [gate | up] rows, is one adapter); got sites {list(config.sites)}")
    return tuple(group for group, sites in EXPERT_SITES.items() if sites[0] in config.sites)


def _d_out(module: nn.Module) -> int:
    return module.weight.shape[0] if isinstance(module, Linear) else module.d_out


def _d_in(module: nn.Module) -> int:
    return module.weight.shape[1] if isinstance(module, Linear) else module.d_in


def _qkv_rows(attn: nn.Module) -> dict[str, tuple[int, int]]:
    """The output rows of q, k and v in the fused matrix."""
    q_rows, kv_rows = attn.n_heads * attn.d_head, attn.n_kv_heads * attn.d_head
    return {"q": (0, q_rows), "k": (q_rows, q_rows + kv_rows), "v": (q_rows + kv_rows, q_rows + 2 * kv_rows)}


def adaptable_modules(model: nn.Module) -> dict[str, dict[str, tuple[int, int]]]:
    """Every module LoRA can adapt in `model`: its name -> {site: the [start, end) output rows it
    covers} (three sites for the fused qkv; "unembed" of a tied model included: its rows are the
    vocabulary's, its weight the embedding table)."""
    found: dict[str, dict[str, tuple[int, int]]] = {}
    for name, module in model.named_modules():
        if name.endswith("attn") and hasattr(module, "qkv"):
            found[f"{name}.qkv"] = _qkv_rows(module)
        for site, suffix in _MODULE_OF.items():
            if name == suffix or name.endswith("." + suffix):
                found[name] = {site: (0, _d_out(module))}
    embed = getattr(model, "embed", None)
    if isinstance(embed, (Embedding, LoRAEmbedding)):
        found["embed"] = {"embed": (0, embed.weight.shape[1])}
    if getattr(model, "unembed", "absent") is None:
        found["unembed"] = {"unembed": (0, embed.weight.shape[0])}
    return found


def lora_targets(model: nn.Module, config: LoRAConfig) -> dict[str, list[tuple[int, int]]]:
    """Module name -> the output-row blocks to adapt, for every site `config` names in `model`."""
    return {name: [rows for site, rows in sites.items() if site in config.sites]
            for name, sites in adaptable_modules(model).items() if any(site in config.sites for site in sites)}


def untie_embeddings(model: nn.Module) -> None:
    """Give a tied model an unembedding of its own, a copy of the embedding table (the same logits),
    and say so in its config; a tied unembedding's adapter then adapts the copy. Does nothing to a
    model whose unembedding is already its own (untied, or a quantized copy)."""
    unembed = getattr(model, "unembed", "absent")
    tied_adapter = isinstance(unembed, LoRALinear) and isinstance(unembed.base, TiedUnembedding)
    if unembed is not None and not tied_adapter:
        return
    table = model.embed.weight
    with torch.device(table.device):  # on the meta device (a model being rebuilt), no memory is spent
        own = Linear(table.shape[1], table.shape[0], bias=False).to(table.dtype)
    with torch.no_grad():
        own.weight.copy_(table)
    own.weight.requires_grad_(False)
    if tied_adapter:
        unembed.base = own
    else:
        model.unembed = own
    model.config = model.config.replace(tie_embeddings=False)


def add_lora(model: nn.Module, config: LoRAConfig) -> None:
    """Freeze every parameter of `model`, wrap each targeted map in an adapter (`LoRALinear`,
    `LoRAEmbedding`), and let the adapters and what `config.bias` / `config.full` name train; in place."""
    if lora_layers(model):
        raise ValueError("this model already has LoRA adapters")
    _check_full_modules(model, config)
    _check_expert_sites(model, config)
    for p in model.parameters():
        p.requires_grad_(False)
    if config.full:
        untie_embeddings(model)  # as PEFT's modules_to_save copies the module: the two then train apart
    targets = lora_targets(model, config)
    experts = {name: module for name, module in model.named_modules() if isinstance(module, MoE)}
    groups = expert_groups(config) if experts else ()
    if not targets and not groups and config.sites:
        raise ValueError(f"no LoRA sites {config.sites} found in this model")
    for name, row_blocks in targets.items():
        _replace(model, name, lambda base: _adapter(model, base, row_blocks, config))
    for name in experts if groups else ():
        _replace(model, name, lambda base: LoRAExperts(base, groups, config))
    for p in trained_parameters(model, config).values():
        p.requires_grad_(True)


def _replace(model: nn.Module, name: str, wrap) -> None:
    """Put `wrap(the module called name)` in its place."""
    parent_name, _, child_name = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child_name, wrap(getattr(parent, child_name)))


def _adapter(model: nn.Module, base: nn.Module | None, row_blocks: list[tuple[int, int]],
             config: LoRAConfig) -> nn.Module:
    """The adapter wrapping `base` (None: a tied model's unembedding), on its weight's device."""
    if isinstance(base, Embedding):
        adapter: nn.Module = LoRAEmbedding(base, config)
    else:
        base = TiedUnembedding(model.embed) if base is None else base
        adapter = LoRALinear(base, _d_in(base), row_blocks, config)
    weight = base_weight(base) if not isinstance(base, Embedding) else base.weight
    return adapter.to(weight.device)


def _check_expert_sites(model: nn.Module, config: LoRAConfig) -> None:
    """What adapters on the experts cannot be (as peft's on transformers' fused expert parameters, whose
    ParamWrapper refuses the same): with dropout, DoRA, or beside a shared expert (Qwen2-MoE)."""
    mlp_sites = [site for site in config.sites if site.startswith("mlp_")]
    moe = [m for m in model.modules() if isinstance(m, MoE)]
    if not mlp_sites or not moe:
        return
    expert_groups(config)
    problems = [what for what, bad in (("dropout", config.dropout > 0), ("DoRA", config.dora),
                                       ("a shared expert", any(m.shared is not None for m in moe))) if bad]
    if problems:
        raise ValueError(f"LoRA sites {mlp_sites} on a mixture-of-experts model adapt the experts, which is not "
                         f"supported with {' or '.join(problems)}; adapt attention (q, k, v, attn_out) instead")


def _check_full_modules(model: nn.Module, config: LoRAConfig) -> None:
    for name in config.full:
        module = getattr(model, name, None)
        if module is not None and not isinstance(module, (Linear, Embedding)):
            raise ValueError(f"LoRA full={list(config.full)}: the model's {name} is a {type(module).__name__} "
                             "(quantized?), which cannot train whole")


def trained_parameters(model: nn.Module, config: LoRAConfig) -> dict[str, nn.Parameter]:
    """What trains beside the frozen base, and what an adapter checkpoint stores: every adapter's
    tensors, the biases `config.bias` names and the weights of the modules in `config.full`."""
    adapted = {f"{name}.base." for name in lora_layers(model)}
    full = {f"{name}.weight" for name in config.full}
    out = {}
    for name, p in model.named_parameters():
        parts = name.split(".")
        is_adapter = len(parts) > 2 and parts[-2] in _ADAPTER_PARAMETERS and not any(
            name.startswith(prefix) for prefix in adapted)
        is_bias = parts[-1].endswith("bias") and (config.bias == "all" or (
            config.bias == "lora_only" and any(name == f"{prefix}bias" for prefix in adapted)))
        if is_adapter or is_bias or name in full:
            out[name] = p
    return out


LORA = Transform("lora", add_lora, options=LoRAConfig, kind="adapter",
                 summary="low-rank adapters W + (alpha/r) B A on chosen sites (DoRA, rsLoRA); the base is frozen")


def lora_layers(model: nn.Module) -> dict[str, LoRALinear | LoRAEmbedding | LoRAExperts]:
    return {name: m for name, m in model.named_modules() if isinstance(m, (LoRALinear, LoRAEmbedding, LoRAExperts))}


@contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[nn.Module]:
    """Within the block `model` computes its base alone, every adapter skipped (PEFT's
    `disable_adapter`): DPO's reference model when LoRA trains. Biases and whole modules trained
    beside the adapters (`bias`, `full`) are not undone, and merged adapters cannot be skipped.

    >>> from glasslm.core.model import TransformerLM
    >>> from glasslm.presets import get_preset
    >>> model = TransformerLM(get_preset("llama-tiny", n_layers=1)).eval()
    >>> ids = torch.tensor([[1, 2, 3]])
    >>> before = model(ids)
    >>> add_lora(model, LoRAConfig(rank=2))
    >>> with torch.no_grad():
    ...     _ = [b.add_(1.0) for layer in lora_layers(model).values() for b in layer.lora_b]
    >>> with adapters_disabled(model):
    ...     torch.allclose(model(ids), before, atol=1e-6)
    True
    >>> torch.allclose(model(ids), before, atol=1e-6)
    False
    """
    layers = list(lora_layers(model).values())
    if any(layer.merged for layer in layers):
        raise ValueError("merged adapters are part of the base weights and cannot be disabled; unmerge them first")
    for layer in layers:
        layer.disabled = True
    try:
        yield model
    finally:
        for layer in layers:
            layer.disabled = False


def recorded_lora_config(model: nn.Module) -> LoRAConfig | None:
    """The options the "lora" transform was applied to `model` with (None if it was not)."""
    for record in applied_transforms(model):
        if record["name"] == "lora":
            return LoRAConfig(**{k: v for k, v in record.items() if k != "name"})
    return None


def lora_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """The adapter's tensors (what a LoRA checkpoint stores): the adapters, and the biases and whole
    modules the recorded transform trains too."""
    config = recorded_lora_config(model) or LoRAConfig()
    return {name: p.detach() for name, p in trained_parameters(model, config).items()}


def load_lora_state_dict(model: nn.Module, weights: dict[str, Tensor], source: str = "adapters") -> None:
    """Copy adapter tensors (as `lora_state_dict` gives them) into `model`'s adapters, naming any
    missing, unexpected or mis-shaped one; the base weights are left as they are."""
    expected = lora_state_dict(model)
    missing, unexpected = sorted(set(expected) - set(weights)), sorted(set(weights) - set(expected))
    if missing or unexpected:
        raise ValueError(f"{source}: the adapters do not match the model's: missing {missing}, unexpected {unexpected}")
    for name, tensor in weights.items():
        if tensor.shape != expected[name].shape:
            raise ValueError(f"{source}: adapter {name} has shape {tuple(tensor.shape)}, "
                             f"the model's is {tuple(expected[name].shape)}")
    model.load_state_dict(weights, strict=False)


def _untie_if_merging_changes_both(model: nn.Module) -> None:
    """Merging an adapter of a tied table would change the embedding and the unembedding alike; the
    adapters change one of them, so the model is untied first."""
    if getattr(model.config, "tie_embeddings", False) and any(
            isinstance(m, LoRAEmbedding) or isinstance(getattr(m, "base", None), TiedUnembedding)
            for m in lora_layers(model).values()):
        untie_embeddings(model)


def merge_lora(model: nn.Module) -> None:
    """Write every adapter into its base weight; the model then computes the same without adapters
    (a tied model whose embedding or unembedding is adapted is untied first)."""
    _untie_if_merging_changes_both(model)
    for layer in lora_layers(model).values():
        layer.merge()


def unmerge_lora(model: nn.Module) -> None:
    """Undo `merge_lora` exactly: each base weight is the one it was before merging."""
    for layer in lora_layers(model).values():
        layer.unmerge()


def remove_lora(model: nn.Module, merge: bool = True) -> None:
    """Replace each adapter by its base (merged first unless `merge=False`): a plain model again."""
    if merge:
        _untie_if_merging_changes_both(model)
    for name, layer in lora_layers(model).items():
        if merge:
            layer.merge()
        parent_name, _, child_name = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child_name, None if isinstance(layer.base, TiedUnembedding) else layer.base)
