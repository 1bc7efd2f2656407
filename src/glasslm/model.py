"""The decoder-only transformer: embeddings, a stack of blocks, final norm, unembedding.

Example:
    >>> import torch
    >>> from glasslm.config import get_preset
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

from .attention import CausalSelfAttention, KVCache
from .config import ModelConfig
from .layers import MLP, Embedding, HookPoint, Linear, SwiGLU, dropout, make_norm
from .positions import LearnedPositions, RotaryPositions, SinusoidalPositions


class Block(nn.Module):
    """Attention then MLP, each wrapped in a residual connection and a norm (before or after)."""

    def __init__(self, config: ModelConfig, rotary: RotaryPositions | None):
        super().__init__()
        c = config
        impl = c.impl
        self.pre_norm = c.norm_placement == "pre"
        self.dropout_p, self.impl = c.dropout, impl
        self.ln1 = make_norm(c.norm, c.d_model, c.norm_eps, c.bias, impl)
        self.attn = CausalSelfAttention(c.d_model, c.n_heads, c.n_kv_heads, c.bias, c.dropout, impl, rotary,
                                        d_head=c.d_head, qkv_bias=c.attn_qkv_bias, sliding_window=c.sliding_window)
        self.ln2 = make_norm(c.norm, c.d_model, c.norm_eps, c.bias, impl)
        mlp_class = SwiGLU if c.mlp == "swiglu" else MLP
        self.mlp = mlp_class(c.d_model, c.d_mlp, c.activation, c.bias, impl)
        self.hook_resid_pre, self.hook_attn_out, self.hook_resid_mid = HookPoint(), HookPoint(), HookPoint()
        self.hook_mlp_out, self.hook_resid_post = HookPoint(), HookPoint()

    def forward(
        self, x: Float[Tensor, "batch seq d_model"], positions: Tensor, kv_cache: KVCache | None = None,
        layer: int = 0, attn_mask: Tensor | None = None,
    ) -> Float[Tensor, "batch seq d_model"]:
        x = self.hook_resid_pre(x)
        attn_in = self.ln1(x) if self.pre_norm else x
        attn_out = self.attn(attn_in, positions, kv_cache, layer, attn_mask)
        attn_out = self.hook_attn_out(dropout(attn_out, self.dropout_p, self.training, self.impl))
        x = self.hook_resid_mid(x + attn_out)
        if not self.pre_norm:
            x = self.ln1(x)
        mlp_out = self.mlp(self.ln2(x) if self.pre_norm else x)
        mlp_out = self.hook_mlp_out(dropout(mlp_out, self.dropout_p, self.training, self.impl))
        x = x + mlp_out
        if not self.pre_norm:
            x = self.ln2(x)
        return self.hook_resid_post(x)


class TransformerLM(nn.Module):
    """A decoder-only language model built from a `ModelConfig`: tokens (batch, seq) -> logits."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        config.validate()
        self.config = c = config
        self.embed = Embedding(c.vocab_size, c.d_model)
        self.pos_embed: nn.Module | None = None
        rotary = None
        if c.positional == "learned":
            self.pos_embed = LearnedPositions(c.context_length, c.d_model)
        elif c.positional == "sinusoidal":
            self.pos_embed = SinusoidalPositions(c.context_length, c.d_model)
        elif c.positional == "rope":
            rotary = RotaryPositions.from_config(c)
        self.hook_embed, self.hook_pos_embed = HookPoint(), HookPoint()
        self.blocks = nn.ModuleList(Block(c, rotary) for _ in range(c.n_layers))
        self.ln_final = make_norm(c.norm, c.d_model, c.norm_eps, c.bias, c.impl) if c.final_norm else None
        self.unembed = None if c.tie_embeddings else Linear(c.d_model, c.vocab_size, bias=False)
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
        start = kv_cache.length if kv_cache is not None else 0
        if positions is None:
            positions = torch.arange(start, start + seq, device=tokens.device)
        if start + seq > c.context_length and c.positional != "none":
            raise ValueError(
                f"sequence of {start + seq} tokens is longer than the context length {c.context_length}"
            )

        x = self.hook_embed(self.embed(tokens))  # (batch, seq, d_model)
        if c.scale_embeddings:
            x = x * math.sqrt(c.d_model)
        if self.pos_embed is not None:
            x = x + self.hook_pos_embed(self.pos_embed(positions))  # broadcast over batch
        x = dropout(x, c.dropout, self.training, c.impl)
        for layer, block in enumerate(self.blocks):
            x = block(x, positions, kv_cache, layer, attn_mask)
        if kv_cache is not None:
            kv_cache.advance(seq)
        if last_logits_only:
            x = x[:, -1:]
        if self.ln_final is not None:
            x = self.ln_final(x)
        if self.unembed is None:  # tied: the embedding table read backwards
            return x @ self.embed.weight.T  # (batch, out_seq, vocab)
        return self.unembed(x)  # (batch, out_seq, vocab)

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
        ref = self.embed.weight
        return KVCache(c.n_layers, batch, c.n_kv_heads, max_length or c.context_length, c.d_head,
                       device=device or ref.device, dtype=dtype or ref.dtype)

    def num_parameters(self, by_component: bool = False) -> int | dict[str, int]:
        """Count parameters once each (a tied unembedding shares the embedding's)."""
        if not by_component:
            return sum(p.numel() for p in self.parameters())
        counts: Counter[str] = Counter()
        for name, p in self.named_parameters():
            parts = name.split(".")
            key = f"{parts[0]}.*.{parts[2]}" if parts[0] == "blocks" else parts[0]
            counts[key] += p.numel()
        return dict(counts)


def init_weights(model: TransformerLM, config: ModelConfig) -> None:
    """Initialise every weight by the config's scheme (norms start at scale 1, shift 0)."""
    for name, module in model.named_modules():
        if isinstance(module, Linear):
            if module.bias is not None:
                nn.init.zeros_(module.bias)
            w = module.weight
            if config.init == "gpt2":
                std = config.init_std
                # Residual outputs add up over 2 per layer; scaling keeps the stream's variance flat.
                if name.endswith(("attn.out", "mlp.down")):
                    std /= math.sqrt(2 * config.n_layers)
                nn.init.normal_(w, mean=0.0, std=std)
            elif config.init == "truncated_normal":
                d_out, d_in = w.shape
                std = math.sqrt(2.0 / (d_in + d_out))
                nn.init.trunc_normal_(w, mean=0.0, std=std, a=-3 * std, b=3 * std)
            else:
                nn.init.xavier_uniform_(w)
        elif isinstance(module, (Embedding, LearnedPositions)):
            if config.init == "gpt2":
                nn.init.normal_(module.weight, mean=0.0, std=config.init_std)
            elif config.init == "truncated_normal":
                nn.init.trunc_normal_(module.weight, mean=0.0, std=1.0, a=-3.0, b=3.0)
            else:
                # Scaled embeddings (x sqrt(d_model)) need rows of norm ~1 to start at unit scale.
                nn.init.normal_(module.weight, mean=0.0, std=config.d_model ** -0.5)
