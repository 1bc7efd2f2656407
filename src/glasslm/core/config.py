"""One dataclass describes every model glasslm can build (named ones: glasslm.presets).

GPT-2, Llama and the original Vaswani decoder are all points in this one space: they differ in
positions, norm, activation, MLP shape, norm placement, biases and tying — each a field here.

Example:
    >>> from glasslm.core.config import ModelConfig
    >>> cfg = ModelConfig(d_model=768, n_heads=12)
    >>> cfg.d_head
    64
    >>> ModelConfig(d_model=100, n_heads=3)
    Traceback (most recent call last):
    ...
    ValueError: d_model (100) must be divisible by n_heads (3)
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import typing
from dataclasses import dataclass
from typing import Any, Literal

from glasslm.core.fields import checked

Positional = Literal["learned", "sinusoidal", "rope", "none"]
Norm = Literal["layernorm", "rmsnorm"]
Activation = Literal["gelu", "gelu_tanh", "relu", "silu"]
MLPKind = Literal["mlp", "swiglu", "none"]
NormPlacement = Literal["pre", "post"]
Init = Literal["gpt2", "truncated_normal", "xavier", "torch"]
AttnScaleBy = Literal["d_head", "d_model"]
AttentionImpl = Literal["fast", "readable"]
RopeScaling = Literal["none", "llama3", "linear", "dynamic", "yarn"]



# The per-site fields that follow a shorthand field while they are None.
_SHORTHANDS = {
    "bias": ("attn_qkv_bias", "attn_out_bias", "mlp_bias", "norm_bias"),
    "dropout": ("embed_dropout", "attn_dropout", "attn_out_dropout", "mlp_out_dropout"),
}


@dataclass
class ModelConfig:
    """Architecture of a decoder-only transformer. Validated on construction."""

    vocab_size: int = 50257  # token ids run from 0 to vocab_size - 1
    context_length: int = 1024  # the most positions the model attends over
    d_model: int = 768  # width of the residual stream
    n_layers: int = 12  # transformer blocks
    n_heads: int = 12  # attention heads per block (query heads, with grouped-query attention)
    n_kv_heads: int | None = None  # key/value heads; fewer than n_heads is grouped-query attention; None: n_heads
    d_mlp: int | None = None  # hidden width of the MLP; None: 4 * d_model
    positional: Positional = "learned"  # how positions enter: added learned/sinusoidal vectors, or rotary (RoPE)
    rope_theta: float = 10000.0  # RoPE base: larger rotates slower, for longer contexts
    norm: Norm = "layernorm"  # normalisation layer
    norm_eps: float = 1e-5  # added to the variance inside the norm (to the std with norm_unbiased_std)
    norm_unbiased_std: bool = False  # LayerNorm as g*(x-mean)/(unbiased std + eps)+b (seed 002's hand-written norm)
    activation: Activation = "gelu_tanh"  # MLP nonlinearity (gelu_tanh: GPT-2's approximation)
    mlp: MLPKind = "mlp"  # plain two-layer MLP, gated SwiGLU (Llama), or none (attention-only)
    norm_placement: NormPlacement = "pre"  # norm before each sublayer (GPT-2, Llama) or after the residual (Vaswani)
    final_norm: bool = True  # a norm before the unembedding
    bias: bool = True  # biases in the linear layers and norms (shorthand for every *_bias site left at None)
    tie_embeddings: bool = True  # the unembedding reuses the token embedding matrix
    scale_embeddings: bool = False  # multiply token embeddings by sqrt(d_model) (Vaswani)
    dropout: float = 0.0  # on embeddings, attention probabilities and residual outputs (sites left at None)
    init: Init = "gpt2"  # weight initialisation scheme (torch: PyTorch's own nn.Linear/nn.Embedding defaults)
    init_residual_scaling: bool = True  # gpt2 init: divide the std of residual output projections by sqrt(2 n_layers)
    xavier_embeddings: bool = False  # xavier init: embedding tables Xavier-uniform too (seed 002), not normal(d_model^-0.5)
    init_std: float = 0.02  # standard deviation of the normal initialisations
    impl: AttentionImpl = "fast"  # fast: PyTorch's fused kernels; readable: every step in plain tensor ops
    d_head: int | None = None  # per-head size; None means d_model // n_heads (Qwen2/Gemma may differ)
    attn_qkv_bias: bool | None = None  # biases on the q, k, v projections; None: follow bias (Qwen2: true)
    attn_out_bias: bool | None = None  # bias on the attention output projection; None: follow bias
    mlp_bias: bool | None = None  # biases in the MLP's linear layers; None: follow bias
    norm_bias: bool | None = None  # shift (bias) in LayerNorms; None: follow bias (RMSNorm never has one)
    unembed_bias: bool = False  # a bias on the logits (TransformerLens's b_U); not covered by bias
    attn_scale_by: AttnScaleBy = "d_head"  # attention scores are divided by sqrt of this size (tiny-transformer: d_model)
    attn_scale: float | None = None  # a fixed multiplier of the attention scores instead; None: from attn_scale_by
    embed_dropout: float | None = None  # dropout on the summed embeddings; None: dropout
    attn_dropout: float | None = None  # dropout on the attention probabilities; None: dropout
    attn_out_dropout: float | None = None  # dropout on the attention output, before the residual add; None: dropout
    mlp_hidden_dropout: float = 0.0  # dropout on the MLP hidden activations (after the nonlinearity); not covered by dropout
    mlp_out_dropout: float | None = None  # dropout on the MLP output, before the residual add; None: dropout
    sliding_window: int | None = None  # each query sees at most this many keys, itself included (Mistral)
    rope_scaling: RopeScaling = "none"  # llama3: Llama 3.1's stretch; linear: every frequency / rope_factor;
                                        # yarn: YaRN's ramp between the two, and cos/sin times rope_attention_factor;
                                        # dynamic: past rope_original_context, a larger base for each length (NTK)
    rope_factor: float = 8.0  # llama3, linear, dynamic, yarn scaling: how much the low frequencies are slowed down
    rope_low_freq_factor: float = 1.0  # llama3 scaling: wavelengths above original/low are scaled fully
    rope_high_freq_factor: float = 4.0  # llama3 scaling: wavelengths below original/high are kept
    rope_original_context: int = 8192  # llama3, dynamic, yarn scaling: the context the model was pre-trained at
    rope_beta_fast: float = 32.0  # yarn: pairs turning more than this often over the original context are kept
    rope_beta_slow: float = 1.0  # yarn: pairs turning less than this often are slowed by rope_factor
    rope_attention_factor: float | None = None  # yarn: cos and sin are multiplied by it; None: 0.1 ln(factor) + 1
    rotary_dims: int | None = None  # features per head RoPE rotates (the first ones); None: all d_head (Pythia: 1/4)
    rope_local_theta: float | None = None  # RoPE base of the sliding-window layers, never scaled; None: rope_theta
                                           # and rope_scaling as every layer (Gemma 3: 10000)
    global_layers: tuple[int, ...] = ()  # layers that see the whole context although sliding_window is set
                                         # (Gemma 3: every sixth); the others are local
    parallel_residual: bool = False  # x + attn(ln1(x)) + mlp(ln2(x)): both sublayers read the same x (GPT-NeoX)
    post_norms: bool = False  # a norm on each sublayer's output too, before the residual add (Gemma 3's sandwich)
    qk_norm: bool = False  # RMSNorm over each head's queries and keys before the rotary (Qwen3, Gemma 3)
    qk_norm_whole: bool = False  # the q/k RMSNorms span the whole projection (all heads' features at once,
                                 # OLMoE), not each head's d_head; needs qk_norm
    norm_unit_offset: bool = False  # RMSNorm scales by (1 + weight), its weights starting at 0 (Gemma)
    attn_softcap: float | None = None  # attention scores become cap * tanh(scores / cap) before the mask (Gemma 2: 50)
    logit_softcap: float | None = None  # logits become cap * tanh(logits / cap) (Gemma 2: 30); None: no cap
    n_experts: int = 0  # experts per mixture-of-experts feed-forward layer (SwiGLU experts); 0: dense MLPs
    experts_per_token: int = 2  # how many experts the router sends each token to (top-k)
    d_expert: int | None = None  # hidden width of each expert; None: d_mlp (the dense layers' width)
    moe_every: int = 1  # layer i is a mixture of experts when (i + 1) % moe_every == 0, the rest dense
                        # (Qwen's decoder_sparse_step)
    router_renormalize: bool = True  # the chosen experts' softmax weights rescaled to sum to 1 (Mixtral;
                                     # Qwen's norm_topk_prob); false: the raw probabilities (OLMoE)
    d_shared_expert: int | None = None  # an expert every token goes through, of this width, scaled by
                                        # sigmoid(a learned gate) (Qwen2-MoE); None: none
    moe_aux_loss_coef: float = 0.01  # training: weight of the load-balancing loss (mean over MoE layers)
    moe_z_loss_coef: float = 0.0  # training: weight of the router z-loss (ST-MoE: 0.001)

    def __post_init__(self) -> None:
        if self.d_head is None:
            if self.d_model % self.n_heads != 0:
                raise ValueError(f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})")
            self.d_head = self.d_model // self.n_heads
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        if self.d_mlp is None:
            self.d_mlp = 4 * self.d_model
        self.validate()

    def validate(self) -> None:
        for name in ("vocab_size", "context_length", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_mlp", "d_head"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name, allowed in _choices().items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        assert self.n_kv_heads is not None
        if self.n_kv_heads > self.n_heads or self.n_heads % self.n_kv_heads != 0:
            raise ValueError(
                f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})"
            )
        if self.positional == "rope" and self.d_head % 2 != 0:
            raise ValueError(f"rotary positions need an even head size, got d_head={self.d_head}")
        if self.positional == "sinusoidal" and self.d_model % 2 != 0:
            raise ValueError(f"sinusoidal positions need an even d_model, got {self.d_model}")
        for name in ("dropout", "embed_dropout", "attn_dropout", "attn_out_dropout", "mlp_hidden_dropout",
                     "mlp_out_dropout"):
            value = getattr(self, name)
            if value is not None and not 0.0 <= value < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {value}")
        if self.xavier_embeddings and self.init != "xavier":
            raise ValueError("xavier_embeddings only applies to init='xavier'")
        if self.norm_unbiased_std and self.norm != "layernorm":
            raise ValueError("norm_unbiased_std is a LayerNorm variant; it needs norm='layernorm'")
        if self.attn_scale is not None and not self.attn_scale > 0:
            raise ValueError(f"attn_scale must be positive, got {self.attn_scale}")
        if self.norm_eps <= 0 or self.rope_theta <= 0 or self.init_std <= 0:
            raise ValueError("norm_eps, rope_theta and init_std must be positive")
        if self.sliding_window is not None and (isinstance(self.sliding_window, bool) or self.sliding_window <= 0):
            raise ValueError(f"sliding_window must be a positive integer or None, got {self.sliding_window!r}")
        if self.rope_scaling in ("linear", "dynamic", "yarn") and not self.rope_factor >= 1:
            raise ValueError(f"{self.rope_scaling} rope scaling needs rope_factor >= 1, got {self.rope_factor}")
        if self.rope_scaling == "llama3" and not (
            self.rope_factor >= 1 and 0 < self.rope_low_freq_factor < self.rope_high_freq_factor
            and self.rope_original_context > 0
        ):
            raise ValueError("llama3 rope scaling needs rope_factor >= 1, 0 < rope_low_freq_factor < "
                             "rope_high_freq_factor and a positive rope_original_context")
        self._validate_layout()
        self._validate_experts()

    def _validate_experts(self) -> None:
        """The checks of the mixture-of-experts fields (only read when n_experts > 0)."""
        if isinstance(self.n_experts, bool) or not isinstance(self.n_experts, int) or self.n_experts < 0:
            raise ValueError(f"n_experts must be a non-negative integer, got {self.n_experts!r}")
        if self.n_experts == 0:
            return
        if self.mlp != "swiglu":
            raise ValueError(f"n_experts={self.n_experts} needs mlp='swiglu' (the experts are SwiGLU MLPs), "
                             f"got mlp={self.mlp!r}")
        if not 1 <= self.experts_per_token <= self.n_experts:
            raise ValueError(f"experts_per_token must be in [1, n_experts={self.n_experts}], "
                             f"got {self.experts_per_token}")
        if self.moe_every < 1:
            raise ValueError(f"moe_every must be a positive integer, got {self.moe_every}")
        for name in ("d_expert", "d_shared_expert"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or value <= 0):
                raise ValueError(f"{name} must be a positive integer or None, got {value!r}")
        if self.moe_aux_loss_coef < 0 or self.moe_z_loss_coef < 0:
            raise ValueError("moe_aux_loss_coef and moe_z_loss_coef must be non-negative")

    def moe_layer(self, layer: int) -> bool:
        """Whether `layer`'s feed-forward is a mixture of experts.

        >>> ModelConfig(n_layers=4, mlp="swiglu", n_experts=4, moe_every=2).moe_layer(1)
        True
        """
        return self.n_experts > 0 and (layer + 1) % self.moe_every == 0

    def _validate_layout(self) -> None:
        """The checks of the rotary-dims, per-layer and sandwich fields."""
        if self.rotary_dims is not None and not (0 < self.rotary_dims <= self.d_head and self.rotary_dims % 2 == 0):
            raise ValueError(f"rotary_dims must be an even number in (0, d_head={self.d_head}], got {self.rotary_dims}")
        if any(not 0 <= layer < self.n_layers for layer in self.global_layers):
            raise ValueError(f"global_layers must name layers in [0, {self.n_layers}), got {list(self.global_layers)}")
        if self.global_layers and self.sliding_window is None:
            raise ValueError("global_layers only applies with a sliding_window (the other layers' window)")
        if self.qk_norm_whole and not self.qk_norm:
            raise ValueError("qk_norm_whole says how wide the q/k norms are; it needs qk_norm=True")
        if self.norm_unit_offset and self.norm != "rmsnorm":
            raise ValueError("norm_unit_offset is an RMSNorm variant; it needs norm='rmsnorm'")
        if (self.parallel_residual or self.post_norms) and self.norm_placement != "pre":
            raise ValueError("parallel_residual and post_norms need norm_placement='pre'")
        if self.rope_scaling == "yarn" and not (self.rope_beta_fast > self.rope_beta_slow > 0):
            raise ValueError("yarn rope scaling needs rope_beta_fast > rope_beta_slow > 0")
        for name in ("attn_softcap", "logit_softcap"):
            cap = getattr(self, name)
            if cap is not None and not (isinstance(cap, (int, float)) and 0 < cap < math.inf):
                raise ValueError(f"{name} must be a positive number or None, got {cap!r}")

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of `layer` (None: it sees the whole context).

        >>> ModelConfig(n_layers=3, sliding_window=4, global_layers=(2,)).layer_window(1)
        4
        """
        return None if layer in self.global_layers else self.sliding_window

    def local_rope(self, layer: int) -> bool:
        """Whether `layer` uses the local RoPE table (rope_local_theta, unscaled) rather than the global one.

        >>> ModelConfig(n_layers=2, sliding_window=4, global_layers=(1,), rope_local_theta=1e4).local_rope(0)
        True
        """
        return self.rope_local_theta is not None and self.layer_window(layer) is not None

    def site_bias(self, site: str) -> bool:
        """Whether `site` (qkv, out, mlp, norm) has biases: its own switch, else `bias`.

        >>> ModelConfig(bias=False, mlp_bias=True).site_bias("mlp"), ModelConfig(bias=False).site_bias("qkv")
        (True, False)
        """
        own = {"qkv": self.attn_qkv_bias, "out": self.attn_out_bias, "mlp": self.mlp_bias, "norm": self.norm_bias}[site]
        return self.bias if own is None else own

    def site_dropout(self, site: str) -> float:
        """The dropout rate at `site` (embed, attn, attn_out, mlp_hidden, mlp_out): its own rate, else `dropout`."""
        own = getattr(self, f"{site}_dropout")
        return self.dropout if own is None else own

    @property
    def attn_score_scale(self) -> float:
        """What q·k is multiplied by before the softmax: attn_scale, else 1/sqrt(d_head or d_model)."""
        if self.attn_scale is not None:
            return self.attn_scale
        return 1.0 / math.sqrt(self.d_head if self.attn_scale_by == "d_head" else self.d_model)

    def replace(self, **changes: Any) -> "ModelConfig":
        """A copy with some fields changed (validated again).

        `bias` and `dropout` stay shorthands: changing one resets the per-site switches it covers
        (those not changed in the same call) to follow it.

        >>> cfg = ModelConfig(dropout=0.15, attn_dropout=0.1).replace(dropout=0.0)
        >>> cfg.site_dropout("attn"), cfg.site_dropout("embed")
        (0.0, 0.0)
        """
        checked(ModelConfig, changes, "ModelConfig")
        for shorthand, sites in _SHORTHANDS.items():
            if shorthand in changes:
                changes = {**{site: None for site in sites}, **changes}
        # Fields left at their derived default follow the field they derive from.
        if "n_kv_heads" not in changes and self.n_kv_heads == self.n_heads:
            changes["n_kv_heads"] = None
        if "d_mlp" not in changes and self.d_mlp == 4 * self.d_model:
            changes["d_mlp"] = None
        if "d_head" not in changes and self.d_head * self.n_heads == self.d_model:
            changes["d_head"] = None
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "ModelConfig") -> "ModelConfig":
        """From `to_dict`'s output (or JSON/TOML), type-checked; `where` names the source in errors."""
        return cls(**checked(cls, data, where))

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)


@functools.cache
def _choices() -> dict[str, tuple[str, ...]]:
    """Each Literal-typed field's allowed values, read from its annotation (the one list of them)."""
    hints = typing.get_type_hints(ModelConfig)
    return {f.name: typing.get_args(hints[f.name]) for f in dataclasses.fields(ModelConfig)
            if typing.get_origin(hints[f.name]) is Literal}
