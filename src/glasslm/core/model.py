"""The decoder-only transformer: embeddings, a stack of blocks, final norm, unembedding.

Example:
    >>> import torch
    >>> from glasslm.presets import get_preset
    >>> model = TransformerLM(get_preset("llama-tiny"))
    >>> model(torch.zeros(2, 5, dtype=torch.long)).shape
    torch.Size([2, 5, 512])
"""

from __future__ import annotations

import math
from collections import Counter

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor, nn

from glasslm.core.attention import CausalSelfAttention, KVCache, StaticKVCache
from glasslm.core.config import ModelConfig
from glasslm.core.layers import (
    MLP, Embedding, HookPoint, Linear, RMSNorm, SwiGLU, dropout, linear, norm_for, softcap,
)
from glasslm.core.moe import MoE
from glasslm.core.positions import LearnedPositions, RotaryPositions, SinusoidalPositions


class Block(nn.Module):
    """Attention then MLP, each wrapped in a residual connection and a norm (before or after).

    With `parallel_residual` both read the same input and their outputs are added together
    (GPT-NeoX); with `post_norms` each output is normalised again before it is added (Gemma 3).
    `layer` picks this block's sliding window (`ModelConfig.layer_window`).
    """

    def __init__(self, config: ModelConfig, rotary: RotaryPositions | None, layer: int = 0):
        super().__init__()
        c = config
        impl = c.impl
        self.pre_norm, self.parallel = c.norm_placement == "pre", c.parallel_residual
        self.attn_out_dropout, self.mlp_out_dropout = c.site_dropout("attn_out"), c.site_dropout("mlp_out")
        self.impl = impl
        self.ln1 = norm_for(c)
        qk_norms = {}
        if c.qk_norm:  # always RMSNorm, over each head's d_head features (or all heads' at once: OLMoE)
            widths = {"q": c.d_head, "k": c.d_head}
            if c.qk_norm_whole:
                widths = {"q": c.n_heads * c.d_head, "k": c.n_kv_heads * c.d_head}
            qk_norms = {f"{x}_norm": RMSNorm(widths[x], c.norm_eps, impl, c.norm_unit_offset) for x in "qk"}
        self.attn = CausalSelfAttention(
            c.d_model, c.n_heads, c.n_kv_heads, c.site_bias("out"), c.site_dropout("attn"), impl, rotary,
            d_head=c.d_head, qkv_bias=c.site_bias("qkv"), sliding_window=c.layer_window(layer),
            scale=c.attn_score_scale, cap=c.attn_softcap, qk_norm_whole=c.qk_norm_whole, **qk_norms)
        self.ln1_post = norm_for(c) if c.post_norms else None
        self.ln2: nn.Module | None = None
        self.ln2_post: nn.Module | None = None
        self.mlp: nn.Module | None = None  # None: an attention-only block (mlp="none")
        if c.mlp != "none":
            self.ln2 = norm_for(c)
            self.ln2_post = norm_for(c) if c.post_norms else None
            if c.moe_layer(layer):
                self.mlp = MoE(c.d_model, c.d_expert or c.d_mlp, c.n_experts, c.experts_per_token,
                               c.router_renormalize, c.activation, impl, c.d_shared_expert)
            else:
                mlp_class = SwiGLU if c.mlp == "swiglu" else MLP
                self.mlp = mlp_class(c.d_model, c.d_mlp, c.activation, c.site_bias("mlp"), impl,
                                     hidden_dropout=c.mlp_hidden_dropout)
        self.hook_resid_pre, self.hook_attn_out, self.hook_resid_mid = HookPoint(), HookPoint(), HookPoint()
        self.hook_mlp_out, self.hook_resid_post = HookPoint(), HookPoint()
        # Opt-in hook points (TransformerLens's use_attn_in, use_split_qkv_input, use_hook_mlp_in): off,
        # the block runs exactly as above; on, attention gets one copy of the stream per head.
        self.use_attn_in = self.use_split_qkv_input = self.use_hook_mlp_in = False
        self.hook_attn_in, self.hook_q_input = HookPoint(), HookPoint()
        self.hook_k_input, self.hook_v_input, self.hook_mlp_in = HookPoint(), HookPoint(), HookPoint()

    def forward(
        self, x: Float[Tensor, "batch seq d_model"], positions: Tensor, kv_cache: KVCache | None = None,
        layer: int = 0, attn_mask: Tensor | None = None,
    ) -> Float[Tensor, "batch seq d_model"]:
        x = self.hook_resid_pre(x)
        if self.parallel:
            # GPT-NeoX: attention and MLP both read x; the stream gets both outputs at once.
            mid = self.hook_resid_mid(x + self._attention(self.ln1(x), positions, kv_cache, layer, attn_mask))
            x = mid + self._mlp(self.ln2(x))
        elif self.pre_norm:
            # GPT-2, Llama: each sublayer reads a normalised copy; the residual stream itself is never normalised.
            attended = self._attention(self._attention_input(x), positions, kv_cache, layer, attn_mask)
            x = self.hook_resid_mid(x + attended)
            if self.mlp is not None:
                x = x + self._mlp(self.ln2(self.hook_mlp_in(x) if self.use_hook_mlp_in else x))
        else:
            # The original Transformer: add the sublayer's output, then normalise the sum.
            x = self.ln1(self.hook_resid_mid(x + self._attention(x, positions, kv_cache, layer, attn_mask)))
            if self.mlp is not None:
                x = self.ln2(x + self._mlp(x))
        return self.hook_resid_post(x)

    def _attention_input(self, x: Float[Tensor, "batch seq d_model"]) -> Tensor | tuple[Tensor, Tensor, Tensor]:
        """ln1(x), or with split inputs (q_in, k_in, v_in): per-head copies (batch, seq, heads, d_model), normalised."""
        if not (self.use_attn_in or self.use_split_qkv_input):
            return self.ln1(x)
        n_heads, n_kv_heads = self.attn.n_heads, self.attn.n_kv_heads
        per_head = x.unsqueeze(2)  # (batch, seq, 1, d_model)
        if self.use_split_qkv_input:
            q_in = self.hook_q_input(per_head.expand(-1, -1, n_heads, -1).clone())
            k_in = self.hook_k_input(per_head.expand(-1, -1, n_kv_heads, -1).clone())
            v_in = self.hook_v_input(per_head.expand(-1, -1, n_kv_heads, -1).clone())
        else:
            if n_kv_heads != n_heads:
                raise ValueError("use_attn_in needs n_kv_heads == n_heads; use use_split_qkv_input with grouped heads")
            q_in = k_in = v_in = self.hook_attn_in(per_head.expand(-1, -1, n_heads, -1).clone())
        return self.ln1(q_in), self.ln1(k_in), self.ln1(v_in)

    def _attention(self, x: Tensor | tuple[Tensor, Tensor, Tensor], positions: Tensor, kv_cache: KVCache | None, layer: int,
                   attn_mask: Tensor | None) -> Tensor:
        out = self.attn(x, positions, kv_cache, layer, attn_mask)
        if self.ln1_post is not None:
            out = self.ln1_post(out)
        return self.hook_attn_out(dropout(out, self.attn_out_dropout, self.training, self.impl))

    def _mlp(self, x: Tensor) -> Tensor:
        out = self.mlp(x) if self.ln2_post is None else self.ln2_post(self.mlp(x))
        return self.hook_mlp_out(dropout(out, self.mlp_out_dropout, self.training, self.impl))


class TransformerLM(nn.Module):
    """A decoder-only language model built from a `ModelConfig`: tokens (batch, seq) -> logits."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        config.validate()
        self.config = c = config
        self.embed = Embedding(c.vocab_size, c.d_model)
        self.pos_embed: nn.Module | None = None
        rotary: dict[bool, RotaryPositions] = {}  # local -> table (Gemma 3: a local and a global one)
        if c.positional == "learned":
            self.pos_embed = LearnedPositions(c.context_length, c.d_model)
        elif c.positional == "sinusoidal":
            self.pos_embed = SinusoidalPositions(c.context_length, c.d_model)
        elif c.positional == "rope":
            rotary = {local: RotaryPositions.from_config(c, local) for local in {c.local_rope(i) for i in range(c.n_layers)}}
        self.hook_embed, self.hook_pos_embed = HookPoint(), HookPoint()
        self.blocks = nn.ModuleList(Block(c, rotary.get(c.local_rope(i)), i) for i in range(c.n_layers))
        self.ln_final = norm_for(c) if c.final_norm else None
        self.unembed = None if c.tie_embeddings else Linear(c.d_model, c.vocab_size, bias=False)
        # A bias on the logits (TransformerLens's b_U), kept apart from `unembed` so a tied model can have one too.
        self.unembed_bias = nn.Parameter(torch.zeros(c.vocab_size)) if c.unembed_bias else None
        self.hook_unembed = HookPoint()  # the logits (TransformerLens's hook_unembed); registered last: forward order
        init_weights(self, c)

    def forward(
        self,
        tokens: Int[Tensor, "batch seq"],
        positions: Int[Tensor, "seq"] | Int[Tensor, "batch seq"] | None = None,
        kv_cache: KVCache | None = None,
        attn_mask: Bool[Tensor, "batch seq k_seq"] | None = None,
        last_logits_only: bool = False,
    ) -> Float[Tensor, "batch out_seq vocab"]:
        """Logits for the next token at every position (out_seq = seq), or the last one (out_seq = 1).

        With a `kv_cache`, `tokens` continue the cached sequence: positions default to the slots
        after the cached ones, and the cache cursor advances by seq. `attn_mask` (True = may attend)
        replaces the causal mask, e.g. to hide left padding in batched generation.
        `last_logits_only` returns logits for the last position only (batch, 1, vocab): generation
        needs nothing else, and it skips a (seq x vocab) unembedding matmul when prefilling a prompt.
        """
        c = self.config
        self.check_tokens(tokens)
        seq = tokens.shape[1]
        static = isinstance(kv_cache, StaticKVCache)
        if static:
            # Compile-friendly decoding: the caller names the slots; no Python cursor moves per step.
            if positions is None:
                raise ValueError("with a StaticKVCache, pass positions (the slots these tokens occupy)")
        else:
            start = kv_cache.length if kv_cache is not None else 0
            if positions is None:
                positions = torch.arange(start, start + seq, device=tokens.device)
            if start + seq > c.context_length and c.positional != "none":
                raise ValueError(
                    f"sequence of {start + seq} tokens is longer than the context length {c.context_length}"
                )

        x = self.embed(tokens)  # (batch, seq, d_model)
        if c.scale_embeddings:
            x = x * math.sqrt(c.d_model)
        x = self.hook_embed(x)  # after the scaling: what the stream gets (TransformerLens's hook_embed)
        if self.pos_embed is not None:
            pos = self.pos_embed(positions)  # (seq, d_model), or (batch, seq, d_model) for per-row positions
            x = x + self.hook_pos_embed(pos.expand_as(x))  # a view, one row per example as TransformerLens's
        x = dropout(x, c.site_dropout("embed"), self.training, c.impl)
        for layer, block in enumerate(self.blocks):
            x = block(x, positions, kv_cache, layer, attn_mask)
        if kv_cache is not None and not static:
            kv_cache.advance(seq)
        if last_logits_only:
            x = x[:, -1:]
        return self.logits(x)

    def logits(self, resid: Float[Tensor, "*any d_model"]) -> Float[Tensor, "*any vocab"]:
        """Final norm and unembedding of residual-stream vectors (also what the logit lens reads)."""
        x = self.ln_final(resid) if self.ln_final is not None else resid
        if self.unembed is None:  # tied: the embedding table read backwards
            logits = linear(x, self.embed.weight)
        else:
            logits = self.unembed(x)  # a Linear, or an Int8Linear once quantized
        if self.unembed_bias is not None:
            logits = logits + self.unembed_bias
        if self.config.logit_softcap is not None:  # Gemma 2: every logit within (-cap, cap)
            logits = softcap(logits, self.config.logit_softcap, self.config.impl)
        return self.hook_unembed(logits)

    def check_tokens(self, tokens: Tensor) -> None:
        if not isinstance(tokens, Tensor) or tokens.dim() != 2:
            shape = tuple(tokens.shape) if isinstance(tokens, Tensor) else type(tokens).__name__
            raise ValueError(f"tokens must be a 2-D (batch, seq) tensor, got {shape}")
        if tokens.dtype not in (torch.long, torch.int32):
            raise ValueError(f"tokens must be integer ids (torch.long), got {tokens.dtype}")
        if tokens.shape[1] == 0:
            raise ValueError("tokens must contain at least one position")
        if tokens.device.type != "cpu" or torch.compiler.is_compiling():
            # Reading ids back from an accelerator would stall it on every forward (and break a
            # compiled graph); there the embedding's own index check catches an out-of-range id.
            return
        lo, hi = (int(v) for v in torch.aminmax(tokens))
        if lo < 0 or hi >= self.config.vocab_size:
            bad = lo if lo < 0 else hi
            raise ValueError(f"token id {bad} is outside the vocabulary [0, {self.config.vocab_size})")

    def new_kv_cache(self, batch: int, max_length: int | None = None,
                     device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> KVCache:
        """Empty key/value buffers for generating up to max_length (default: the context length)."""
        c = self.config
        ref = self.embed  # (its device and dtype: what the activations will be)
        return KVCache(c.n_layers, batch, c.n_kv_heads, max_length or c.context_length, c.d_head,
                       device=device or ref.device, dtype=dtype or ref.dtype)

    def new_static_kv_cache(self, batch: int, max_length: int | None = None,
                            device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> StaticKVCache:
        """Position-addressed buffers for compiled decoding (see `attention.StaticKVCache`)."""
        c, ref = self.config, self.embed
        return StaticKVCache(c.n_layers, batch, c.n_kv_heads, max_length or c.context_length, c.d_head,
                             device=device or ref.device, dtype=dtype or ref.dtype)

    def router_losses(self) -> dict[str, Tensor] | None:
        """The mixture-of-experts training terms of the last training forward pass (None: no MoE layer).

        "aux": moe_aux_loss_coef x the mean load-balancing loss + moe_z_loss_coef x the mean router
        z-loss over the MoE layers (what training adds to the loss); "balance" and "z" unweighted;
        "load": (moe layers, n_experts), each layer's fraction of the assignments per expert.
        """
        # (every MoE module, also one an adapter wraps: transforms/lora.py's LoRAExperts)
        stats = [m.aux for m in self.blocks.modules() if isinstance(m, MoE) and m.aux is not None]
        if not stats:
            return None
        balance = torch.stack([s.balance for s in stats]).mean()
        z = torch.stack([s.z for s in stats]).mean()
        aux = self.config.moe_aux_loss_coef * balance + self.config.moe_z_loss_coef * z
        return {"aux": aux, "balance": balance, "z": z, "load": torch.stack([s.load for s in stats])}

    def num_parameters(self, by_component: bool = False) -> int | dict[str, int]:
        """Count parameters once each (a tied unembedding shares the embedding's)."""
        if not by_component:
            return sum(p.numel() for p in self.parameters())
        counts: Counter[str] = Counter()
        for name, p in self.named_parameters():
            parts = name.split(".")
            key = f"{parts[0]}.*.{parts[2]}" if parts[0] == "blocks" else parts[0]
            key = "unembed" if key == "unembed_bias" else key  # the logits' bias belongs to the unembedding
            counts[key] += p.numel()
        return dict(counts)


def _fan_slices(name: str, module: Linear, config: ModelConfig) -> list[slice]:
    """Row ranges of `module.weight` that are separate matrices in the maths.

    The fused q/k/v projection is three matrices (Q, K, V) stacked; fan-based schemes (Xavier,
    truncated normal) must see each one's own fan-out, not the stack's.
    """
    if name.endswith("attn.qkv"):
        d_q, d_kv = config.n_heads * config.d_head, config.n_kv_heads * config.d_head
        return [slice(0, d_q), slice(d_q, d_q + d_kv), slice(d_q + d_kv, d_q + 2 * d_kv)]
    return [slice(0, module.weight.shape[0])]


@torch.no_grad()
def init_weights(model: TransformerLM, config: ModelConfig) -> None:
    """Initialise every weight by the config's scheme (norms start at scale 1, shift 0).

    gpt2: normal(init_std), residual output projections / sqrt(2 n_layers) if init_residual_scaling;
    truncated_normal (CS336): std sqrt(2 / (fan_in + fan_out)) cut at 3 std, embeddings std 1;
    xavier: Xavier-uniform matrices, biases as nn.Linear starts them; torch: what nn.Linear / nn.Embedding
    start with. Each expert of a mixture of experts starts as the Linear it stands for would.
    """
    c = config
    for name, module in model.named_modules():
        if isinstance(module, Linear):
            if module.bias is not None:
                _init_bias(module.bias, module.weight.shape[1], c)
            _init_matrix(module.weight, name, _fan_slices(name, module, c), c)
        elif isinstance(module, MoE):
            for part in ("gate", "up", "down"):
                for expert in getattr(module, part):  # (d_out, d_in) views, one per expert
                    _init_matrix(expert, f"{name}.{part}", [slice(0, expert.shape[0])], c)
        elif isinstance(module, (Embedding, LearnedPositions)):
            _init_table(module.weight, c)
    if model.unembed_bias is not None:
        _init_bias(model.unembed_bias, c.d_model, c)  # as nn.Linear(d_model, vocab) would start its bias


def _init_matrix(w: Tensor, name: str, fan_slices: list[slice], config: ModelConfig) -> None:
    """A (d_out, d_in) weight by the scheme; `fan_slices`: its row ranges that are separate matrices."""
    c, d_in = config, w.shape[1]
    if c.init == "gpt2":
        std = c.init_std
        # Residual outputs add up over 2 per layer; scaling keeps the stream's variance flat.
        if c.init_residual_scaling and name.endswith(("attn.out", "mlp.down")):
            std /= math.sqrt(2 * c.n_layers)
        nn.init.normal_(w, mean=0.0, std=std)
    elif c.init == "torch":
        nn.init.kaiming_uniform_(w, a=math.sqrt(5))  # nn.Linear's reset_parameters
    else:
        for rows in fan_slices:
            part = w[rows]  # a view: initialising it initialises those rows of w
            d_out = part.shape[0]
            if c.init == "truncated_normal":
                std = math.sqrt(2.0 / (d_in + d_out))
                nn.init.trunc_normal_(part, mean=0.0, std=std, a=-3 * std, b=3 * std)
            else:
                nn.init.xavier_uniform_(part)


def _init_table(weight: Tensor, config: ModelConfig) -> None:
    """An embedding (token or learned position) table by the scheme."""
    c = config
    if c.init == "gpt2":
        nn.init.normal_(weight, mean=0.0, std=c.init_std)
    elif c.init == "truncated_normal":
        nn.init.trunc_normal_(weight, mean=0.0, std=1.0, a=-3.0, b=3.0)
    elif c.init == "torch":
        nn.init.normal_(weight, mean=0.0, std=1.0)  # nn.Embedding's default
    elif c.xavier_embeddings:  # every matrix alike, as "xavier_uniform_ on all p.dim() > 1" does
        nn.init.xavier_uniform_(weight)
    else:
        # Scaled embeddings (x sqrt(d_model)) need rows of norm ~1 to start at unit scale.
        nn.init.normal_(weight, mean=0.0, std=c.d_model ** -0.5)


def _init_bias(bias: nn.Parameter, fan_in: int, config: ModelConfig) -> None:
    """Zero, or where the scheme leaves biases as nn.Linear starts them, U(-1/sqrt(fan_in), 1/sqrt(fan_in)).

    Xavier init (seed 002, the Annotated Transformer) runs xavier_uniform_ on every parameter with
    p.dim() > 1, so each bias keeps nn.Linear's default rather than starting at zero."""
    if config.init in ("torch", "xavier"):
        nn.init.uniform_(bias, -fan_in ** -0.5, fan_in ** -0.5)
    else:
        nn.init.zeros_(bias)
