"""A mixture-of-experts feed-forward layer: a router sends each token to a few of many SwiGLU experts.

Each token's vector x goes through a router (a Linear to one logit per expert); the softmax of the
logits picks the `k` most probable experts, and the layer's output is the chosen experts' outputs
weighted by their probabilities (renormalised to sum to 1 with `renormalize`, as Mixtral does;
Qwen's `norm_topk_prob`; OLMoE does not):

    p = softmax(router(x))                      (n_experts,)
    chosen = the k largest of p                 (k,)  their ids and weights w (w = p[chosen], maybe / sum)
    y = sum_j w_j * down_e(act(gate_e(x)) * up_e(x)),   e = chosen[j]

Qwen2-MoE adds a shared expert every token goes through, scaled by sigmoid(shared_gate(x)).

The experts' weights are ONE stacked tensor per projection, as llama.cpp's ffn_gate_exps /
ffn_up_exps / ffn_down_exps and transformers' fused layouts store them:
gate and up (n_experts, d_expert, d_model), down (n_experts, d_model, d_expert).

`route` (the router's choice) is a function of its own so faster paths can call it. `impl="readable"`
runs the definition token by token; `impl="fast"` groups the tokens by expert and runs one batched
product per expert. Tests hold the two equal, gradients included.

Training adds the load-balancing loss (Switch Transformer, in Mixtral's top-k form) and the router
z-loss (ST-MoE) of each MoE layer (`MoE.aux`); `TransformerLM.router_losses` collects them.

Example:
    >>> import torch
    >>> moe = MoE(d_model=8, d_expert=16, n_experts=4, k=2)
    >>> y = moe(torch.randn(2, 3, 8))
    >>> y.shape
    torch.Size([2, 3, 8])
    >>> weights, experts = route(torch.tensor([[0.0, 2.0, 1.0, -1.0]]), k=2, renormalize=True)
    >>> experts.tolist(), [round(w, 4) for w in weights[0].tolist()]
    ([[1, 2]], [0.7311, 0.2689])
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import Tensor, nn

from glasslm.core.layers import HookPoint, Linear, SwiGLU, activation, any_hooked


def route(
    router_logits: Float[Tensor, "tokens n_experts"], k: int, renormalize: bool,
) -> tuple[Float[Tensor, "tokens k"], Int[Tensor, "tokens k"]]:
    """The k experts each token goes to (most probable first) and their weights (float32).

    The softmax runs in float32 (as transformers' routers do): in bf16 near-equal experts would swap.
    Renormalised, the weights are the softmax over the chosen k logits.
    """
    probs = torch.softmax(router_logits.float(), dim=-1)  # (tokens, n_experts)
    weights, experts = torch.topk(probs, k, dim=-1)  # (tokens, k) each
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


def load_balancing_loss(
    router_logits: Float[Tensor, "tokens n_experts"], experts: Int[Tensor, "tokens k"],
) -> Float[Tensor, ""]:
    """Switch Transformer's auxiliary loss in its top-k form (Mixtral's): n_experts * sum_e f_e * P_e.

    f_e: the fraction of the tokens sent to expert e (over all k choices, so the f_e sum to k);
    P_e: the mean router probability of e. Its minimum, k, is when both are uniform; it pushes the
    router towards spreading the tokens (f is not differentiable, P is).
    """
    n_experts = router_logits.shape[-1]
    probs = torch.softmax(router_logits.float(), dim=-1)  # (tokens, n_experts)
    sent = F.one_hot(experts, n_experts).float().sum(dim=1)  # (tokens, n_experts): 1 where chosen
    return n_experts * (sent.mean(dim=0) * probs.mean(dim=0)).sum()


def router_z_loss(router_logits: Float[Tensor, "tokens n_experts"]) -> Float[Tensor, ""]:
    """ST-MoE's router z-loss: the mean over tokens of logsumexp(logits)^2 (keeps the logits small)."""
    return torch.logsumexp(router_logits.float(), dim=-1).pow(2).mean()


@dataclass
class RouterStats:
    """One MoE layer's training signals from its last forward pass."""

    balance: Float[Tensor, ""]  # load_balancing_loss
    z: Float[Tensor, ""]  # router_z_loss
    load: Float[Tensor, "n_experts"]  # fraction of the token-to-expert assignments each expert got (sums to 1)


class MoE(nn.Module):
    """Mixture-of-experts SwiGLU feed-forward (Mixtral, Qwen-MoE, OLMoE); see the module docstring.

    gate, up: (n_experts, d_expert, d_model); down: (n_experts, d_model, d_expert); router: a Linear
    (n_experts, d_model). `d_shared`: a shared SwiGLU expert of that width with a sigmoid gate (Qwen2-MoE).
    While training, `aux` holds the last forward's `RouterStats`.
    """

    def __init__(self, d_model: int, d_expert: int, n_experts: int, k: int, renormalize: bool = True,
                 act: str = "silu", impl: str = "fast", d_shared: int | None = None):
        super().__init__()
        self.n_experts, self.k, self.renormalize, self.impl = n_experts, k, renormalize, impl
        self.act = activation(act, impl)
        self.router = Linear(d_model, n_experts, bias=False)
        self.gate = nn.Parameter(torch.empty(n_experts, d_expert, d_model).normal_(std=0.02))
        self.up = nn.Parameter(torch.empty(n_experts, d_expert, d_model).normal_(std=0.02))
        self.down = nn.Parameter(torch.empty(n_experts, d_model, d_expert).normal_(std=0.02))
        self.shared: SwiGLU | None = None
        self.shared_gate: Linear | None = None
        if d_shared is not None:
            self.shared = SwiGLU(d_model, d_shared, act, bias=False, impl=impl)
            self.shared_gate = Linear(d_model, 1, bias=False)
        self.hook_router_logits = HookPoint()  # (batch, seq, n_experts)
        self.hook_expert_weights = HookPoint()  # (batch, seq, k): the chosen experts' weights
        self.aux: RouterStats | None = None

    def forward(self, x: Float[Tensor, "batch seq d_model"]) -> Float[Tensor, "batch seq d_model"]:
        batch, seq, d_model = x.shape
        logits = self.hook_router_logits(self.router(x))  # (batch, seq, n_experts)
        weights, experts = route(logits.reshape(batch * seq, -1), self.k, self.renormalize)  # (tokens, k)
        if any_hooked(self.hook_expert_weights):
            weights = self.hook_expert_weights(weights.reshape(batch, seq, -1)).reshape(batch * seq, -1)
        if self.training:
            self.aux = self._stats(logits.reshape(batch * seq, -1), experts)
        flat = x.reshape(batch * seq, d_model)
        weights = weights.to(x.dtype)
        mixed = (self.experts_readable if self.impl == "readable" else self.experts_grouped)(flat, weights, experts)
        out = mixed.reshape(batch, seq, d_model)
        if self.shared is not None:
            out = out + torch.sigmoid(self.shared_gate(x)) * self.shared(x)
        return out

    def expert(self, e: int, x: Float[Tensor, "rows d_model"]) -> Float[Tensor, "rows d_model"]:
        """Expert e's SwiGLU on some rows: down_e(act(gate_e x) * up_e x)."""
        return self.project("down", e, self.act(self.project("gate", e, x)) * self.project("up", e, x))

    def project(self, name: str, e: int, x: Float[Tensor, "rows d_in"]) -> Float[Tensor, "rows d_out"]:
        """x @ W_e.T for projection `name` (gate, up or down) of expert e. A projection kept in another form
        than a float tensor (a GGUF file's blocks: glasslm.transforms.experts.ExpertBlocks) is a module
        with an `expert(e, x)` of its own, which reads only expert e's rows."""
        stacked = getattr(self, name)
        return F.linear(x, stacked[e]) if isinstance(stacked, Tensor) else stacked.expert(e, x)

    def experts_readable(self, x: Float[Tensor, "tokens d_model"], weights: Float[Tensor, "tokens k"],
                         experts: Int[Tensor, "tokens k"]) -> Float[Tensor, "tokens d_model"]:
        """The definition, one token and one choice at a time."""
        rows = []
        for t in range(x.shape[0]):
            row = torch.zeros_like(x[t])
            for j in range(self.k):
                row = row + weights[t, j] * self.expert(int(experts[t, j]), x[t:t + 1])[0]
            rows.append(row)
        return torch.stack(rows)

    def experts_grouped(self, x: Float[Tensor, "tokens d_model"], weights: Float[Tensor, "tokens k"],
                        experts: Int[Tensor, "tokens k"]) -> Float[Tensor, "tokens d_model"]:
        """The same sum with the (token, choice) pairs sorted by expert: one product per expert used.

        Only the chosen experts' weights are read, which is what makes a token cost k experts, not n.
        """
        flat_experts = experts.reshape(-1)  # (tokens * k,): pair p is token p // k's choice p % k
        order = torch.argsort(flat_experts, stable=True)  # pairs grouped by expert
        counts = torch.bincount(flat_experts, minlength=self.n_experts).tolist()
        tokens_of = order // self.k
        pair_weights = weights.reshape(-1)[order]  # (tokens * k,) in the grouped order
        out = torch.zeros_like(x)
        start = 0
        for e, count in enumerate(counts):
            if count == 0:
                continue
            rows = tokens_of[start:start + count]  # (count,): the tokens expert e serves
            y = self.expert(e, x[rows]) * pair_weights[start:start + count, None]  # (count, d_model)
            out = out.index_add(0, rows, y)
            start += count
        return out

    def _stats(self, logits: Float[Tensor, "tokens n_experts"], experts: Int[Tensor, "tokens k"]) -> RouterStats:
        load = torch.bincount(experts.reshape(-1).detach(), minlength=self.n_experts).float() / experts.numel()
        return RouterStats(load_balancing_loss(logits, experts), router_z_loss(logits), load)
