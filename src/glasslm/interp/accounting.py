"""Parameter and FLOP accounting per component, for any ModelConfig, without allocating weights.

Conventions (the same as the tables in Kaplan et al. 2020 and Hoffmann et al. 2022):

* A matrix multiply by a (d_in, d_out) weight costs 2·d_in·d_out FLOPs per token (a multiply and
  an add per weight). Biases, norms, activations, softmax and embedding look-ups are O(d) per
  token rather than O(d²) and are left out.
* Attention's two matmuls over the sequence, q·kᵀ and pattern·v, each cost 2·context·(n_heads·d_head)
  FLOPs per token per layer. We charge every token the FULL context (as those tables do): the exact
  causal average is (context + 1)/2 keys per query, about half, so our attention term is an upper
  bound at the given context length. A sliding-window layer is charged its window instead, where shorter.
* A mixture-of-experts layer costs its router and the k experts a token runs (experts_per_token of
  n_experts): its parameters count all n, its FLOPs k.
* The unembedding is a matmul by the (vocab, d_model) matrix, 2·d_model·vocab FLOPs, even when the
  matrix is shared with the embedding (tied), where it adds no parameters.
* Training costs 3× the forward pass per token: the backward pass computes gradients with respect
  to both activations and weights, each about as costly as the forward (hence the familiar 6·N).

Example:
    >>> from glasslm.presets import get_preset
    >>> cfg = get_preset("gpt2-small")
    >>> parameter_count(cfg)
    124439808
    >>> forward_flops_per_token(cfg) == 2 * 12 * 12 * 768**2 + 4 * 12 * 1024 * 768 + 2 * 768 * 50257
    True
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass


from glasslm.io.build import empty_model
from glasslm.core.config import ModelConfig
from glasslm.core.layers import Linear
from glasslm.core.moe import MoE

ATTENTION_MIXING = "attention q·kᵀ and pattern·v"


@dataclass(frozen=True)
class ComponentCost:
    """One row of the accounting table: a component's parameters and forward FLOPs per token."""

    name: str
    parameters: int
    forward_flops_per_token: int


def _component(module_name: str) -> str:
    """Group names like num_parameters(by_component=True): 'blocks.3.attn.qkv' -> 'blocks.*.attn'."""
    parts = module_name.split(".")
    return f"blocks.*.{parts[2]}" if parts[0] == "blocks" else parts[0]


def cost_table(config: ModelConfig, context_length: int | None = None) -> list[ComponentCost]:
    """Per component: parameters and forward FLOPs per token at `context_length` (default: the config's).

    Components follow the module tree (`embed`, `pos_embed`, `blocks.*.ln1`, `blocks.*.attn`,
    `blocks.*.ln2`, `blocks.*.mlp`, `ln_final`, `unembed`), plus a parameter-free row for the
    attention matmuls over the sequence.
    """
    context = context_length or config.context_length
    model = empty_model(config)  # meta device: shapes only, even a 70B config costs no memory
    params = model.num_parameters(by_component=True)
    flops: Counter[str] = Counter()
    for name, module in model.named_modules():
        if isinstance(module, Linear):
            flops[_component(name)] += 2 * module.weight.numel()
        elif isinstance(module, MoE):  # a token runs k of the experts: their weights, not all n
            per_expert = module.gate[0].numel() + module.up[0].numel() + module.down[0].numel()
            flops[_component(name)] += 2 * module.k * per_expert
    if model.unembed is None:  # tied: the embedding matrix is used again as the output matmul
        flops["unembed"] += 2 * model.embed.weight.numel()
    c = config
    # A sliding-window layer's queries see at most its window of keys (Mistral, Gemma 3's local layers).
    keys = [min(context, c.layer_window(i) or context) for i in range(c.n_layers)]
    flops[ATTENTION_MIXING] = 2 * 2 * sum(keys) * c.n_heads * c.d_head

    # Module-tree order, with the attention matmuls right after the attention projections and the
    # unembedding last even when it is tied (and so has no parameters of its own).
    order = [name for name in params if name != "unembed"]
    order.insert(order.index("blocks.*.attn") + 1, ATTENTION_MIXING)
    order.append("unembed")
    rows = []
    for name in order:
        label = "unembed (tied to embed)" if name == "unembed" and model.unembed is None else name
        rows.append(ComponentCost(label, params.get(name, 0), flops.get(name, 0)))
    return rows


def parameter_count(config: ModelConfig) -> int:
    """Total parameters (a tied unembedding counted once)."""
    return empty_model(config).num_parameters()


def forward_flops_per_token(config: ModelConfig, context_length: int | None = None) -> int:
    """Matmul FLOPs of one forward pass, per token, at `context_length` (see the module docstring)."""
    return sum(row.forward_flops_per_token for row in cost_table(config, context_length))


def training_flops_per_token(config: ModelConfig, context_length: int | None = None) -> int:
    """Forward + backward FLOPs per trained token: 3 × forward (≈ 6·N plus 3× the attention term)."""
    return 3 * forward_flops_per_token(config, context_length)


def format_cost_table(config: ModelConfig, context_length: int | None = None, title: str = "model") -> str:
    """A plain-text table of `cost_table`, with totals, for the `glasslm info` command."""
    context = context_length or config.context_length
    rows = cost_table(config, context)
    width = max(len(row.name) for row in rows) + 2
    lines = [f"{title}: {parameter_count(config):,} parameters; FLOPs per token at context {context:,} "
             f"(blocks.* rows sum all {config.n_layers} layers)",
             f"  {'component':<{width}} {'parameters':>15} {'forward FLOPs/token':>22}"]
    for row in rows:
        lines.append(f"  {row.name:<{width}} {row.parameters:>15,} {row.forward_flops_per_token:>22,}")
    forward = forward_flops_per_token(config, context)
    lines.append(f"  {'total':<{width}} {parameter_count(config):>15,} {forward:>22,}")
    lines.append(f"training FLOPs per token (3 x forward): {training_flops_per_token(config, context):,} "
                 f"(6N alone would be {6 * parameter_count(config):,})")
    return "\n".join(lines)
