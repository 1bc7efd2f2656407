"""One dataclass describes every model glasslm can build, plus named presets.

GPT-2, Llama and the original Vaswani decoder are all points in this one space: they differ in
positions, norm, activation, MLP shape, norm placement, biases and tying — each a field here.
`PRESETS` is the one registry of names: each holds a model and its training recipe (or none).

Example:
    >>> from glasslm.core.config import ModelConfig, get_preset
    >>> cfg = get_preset("gpt2-small")
    >>> cfg.d_head
    64
    >>> ModelConfig(d_model=100, n_heads=3)
    Traceback (most recent call last):
    ...
    ValueError: d_model (100) must be divisible by n_heads (3)
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from ..schema import checked, did_you_mean

if TYPE_CHECKING:
    from ..train import TrainConfig

Positional = Literal["learned", "sinusoidal", "rope", "none"]
Norm = Literal["layernorm", "rmsnorm"]
Activation = Literal["gelu", "gelu_tanh", "relu", "silu"]
MLPKind = Literal["mlp", "swiglu"]
NormPlacement = Literal["pre", "post"]
Init = Literal["gpt2", "truncated_normal", "xavier", "torch"]
AttnScaleBy = Literal["d_head", "d_model"]
AttentionImpl = Literal["fast", "readable"]
RopeScaling = Literal["none", "llama3"]

_CHOICES: dict[str, tuple[str, ...]] = {
    "positional": ("learned", "sinusoidal", "rope", "none"),
    "norm": ("layernorm", "rmsnorm"),
    "activation": ("gelu", "gelu_tanh", "relu", "silu"),
    "mlp": ("mlp", "swiglu"),
    "norm_placement": ("pre", "post"),
    "init": ("gpt2", "truncated_normal", "xavier", "torch"),
    "attn_scale_by": ("d_head", "d_model"),
    "impl": ("fast", "readable"),
    "rope_scaling": ("none", "llama3"),
}


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
    mlp: MLPKind = "mlp"  # plain two-layer MLP, or gated SwiGLU (Llama)
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
    rope_scaling: RopeScaling = "none"  # "llama3": Llama 3.1's frequency-dependent stretch of RoPE
    rope_factor: float = 8.0  # llama3 scaling: how much the low frequencies are slowed down
    rope_low_freq_factor: float = 1.0  # llama3 scaling: wavelengths above original/low are scaled fully
    rope_high_freq_factor: float = 4.0  # llama3 scaling: wavelengths below original/high are kept
    rope_original_context: int = 8192  # llama3 scaling: the context the model was pre-trained at

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
        for name, allowed in _CHOICES.items():
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
        if self.rope_scaling == "llama3" and not (
            self.rope_factor >= 1 and 0 < self.rope_low_freq_factor < self.rope_high_freq_factor
            and self.rope_original_context > 0
        ):
            raise ValueError("llama3 rope scaling needs rope_factor >= 1, 0 < rope_low_freq_factor < "
                             "rope_high_freq_factor and a positive rope_original_context")

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


def _gpt2(d_model: int, n_layers: int, n_heads: int) -> ModelConfig:
    return ModelConfig(vocab_size=50257, context_length=1024, d_model=d_model, n_layers=n_layers, n_heads=n_heads)


def _llama(**kw: Any) -> ModelConfig:
    base: dict[str, Any] = dict(
        positional="rope", norm="rmsnorm", activation="silu", mlp="swiglu", bias=False,
        tie_embeddings=False, init="gpt2",
    )
    base.update(kw)
    return ModelConfig(**base)


def _char(**kw: Any) -> ModelConfig:
    # nanoGPT-style character model: GPT-2 architecture with exact GELU and no biases.
    base: dict[str, Any] = dict(vocab_size=65, activation="gelu", bias=False)
    base.update(kw)
    return ModelConfig(**base)


def _char_llama(**kw: Any) -> ModelConfig:
    # A character model with Llama's parts; embeddings stay tied (65 x d_model is most of the vocabulary cost).
    base: dict[str, Any] = dict(vocab_size=65, positional="rope", norm="rmsnorm", activation="silu", mlp="swiglu",
                                bias=False, tie_embeddings=True)
    base.update(kw)
    return ModelConfig(**base)


@dataclass(frozen=True)
class Preset:
    """A named model and, where one has been tried, how to train it."""

    model: ModelConfig
    recipe: dict[str, Any] | None  # the TrainConfig fields that differ from TrainConfig's defaults;
                                   # None: no recipe (pretrained weights, or a schedule TrainConfig lacks)
    about: str = ""  # where the numbers come from


# One registry: every preset name maps to its architecture and its training recipe.
PRESETS: dict[str, Preset] = {
    "gpt2-small": Preset(
        _gpt2(768, 12, 12), about="GPT-2 124M; recipe from nanoGPT's config/train_gpt2.py (~0.5M tokens a step)",
        recipe=dict(max_steps=600_000, batch_size=12, grad_accum_steps=40, lr=6e-4, min_lr=6e-5, warmup_steps=2000,
                    beta2=0.95, eval_interval=1000, eval_iters=200, log_interval=10, dtype="bfloat16")),
    "gpt2-medium": Preset(_gpt2(1024, 24, 16), recipe=None, about="GPT-2 350M (pretrained weights: convert --from-hf)"),
    "gpt2-large": Preset(_gpt2(1280, 36, 20), recipe=None, about="GPT-2 774M (pretrained weights: convert --from-hf)"),
    "gpt2-xl": Preset(_gpt2(1600, 48, 25), recipe=None, about="GPT-2 1.5B (pretrained weights: convert --from-hf)"),
    "llama-tiny": Preset(
        _llama(vocab_size=512, context_length=256, d_model=128, n_layers=4, n_heads=8, n_kv_heads=2, d_mlp=344,
               norm_eps=1e-5),
        about="a small Llama-architecture model for tests and CPU runs",
        recipe=dict(max_steps=5000, batch_size=32, lr=1e-3, min_lr=1e-4, beta2=0.95, warmup_steps=200,
                    eval_interval=250, eval_iters=50)),
    "tinyllama-1.1b": Preset(
        _llama(vocab_size=32000, context_length=2048, d_model=2048, n_layers=22, n_heads=32, n_kv_heads=4,
               d_mlp=5632, norm_eps=1e-5),
        recipe=None, about="TinyLlama 1.1B (pretrained weights: convert --from-hf)"),
    "llama2-7b": Preset(
        _llama(vocab_size=32000, context_length=4096, d_model=4096, n_layers=32, n_heads=32, d_mlp=11008,
               norm_eps=1e-5),
        recipe=None, about="Llama 2 7B (pretrained weights: convert --from-hf)"),
    "llama3-8b": Preset(
        _llama(vocab_size=128256, context_length=8192, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8,
               d_mlp=14336, norm_eps=1e-5, rope_theta=500000.0),
        recipe=None, about="Llama 3 8B (pretrained weights: convert --from-hf)"),
    "vaswani-decoder": Preset(
        ModelConfig(vocab_size=37000, context_length=512, d_model=512, n_layers=6, n_heads=8, d_mlp=2048,
                    positional="sinusoidal", norm="layernorm", norm_eps=1e-6, activation="relu",
                    norm_placement="post", final_norm=False, bias=True, tie_embeddings=True, scale_embeddings=True,
                    dropout=0.1, init="xavier"),
        recipe=None, about="the base model of Attention Is All You Need as a decoder (its inverse-square-root "
                           "schedule is not TrainConfig's warmup + cosine)"),
    "shakespeare-char": Preset(
        _char(context_length=256, d_model=384, n_layers=6, n_heads=6, dropout=0.2),
        about="nanoGPT's config/train_shakespeare_char.py",
        recipe=dict(max_steps=5000, batch_size=64, warmup_steps=100, eval_interval=250, eval_iters=200)),
    "shakespeare-char-cpu": Preset(
        _char_llama(context_length=64, d_model=128, n_layers=4, n_heads=4, d_mlp=336),
        about="nanoGPT's CPU tiny-Shakespeare size (4 layers, d_model 128, context 64) with Llama parts (RoPE, "
              "RMSNorm, SwiGLU) and Muon: nanoGPT's best val loss in a third of its time "
              "(benchmarks/bench_time_to_loss.py)",
        recipe=dict(optimizer="muon", muon_lr=0.02, lr=3e-3, min_lr=3e-4, beta2=0.95, warmup_steps=50,
                    max_steps=600, batch_size=16)),
    "shakespeare-char-cpu-nanogpt": Preset(
        _char(context_length=64, d_model=128, n_layers=4, n_heads=4, dropout=0.0),
        about="nanoGPT's CPU recipe for tiny Shakespeare (TrainConfig's defaults are that recipe)",
        recipe={}),
    # --- the five seed systems (../shared/seeds), each reproduced exactly: tests/test_seeds.py ---
    "arena-gpt2": Preset(
        _gpt2(768, 12, 12).replace(tie_embeddings=False, unembed_bias=True, init_residual_scaling=False),
        recipe=None,
        about="seed 000, ARENA's GPT-2 'almost from scratch' (TransformerLens naming): untied W_U with a bias b_U, "
              "every weight normal(0.02) with no residual scaling. The seed freezes b_U (requires_grad=False); "
              "here it is an ordinary parameter, so it trains unless you freeze it. No training recipe in the seed"),
    "lightning-char-gpt": Preset(
        _char(context_length=256, d_model=384, n_layers=6, n_heads=6, attn_qkv_bias=False, attn_out_bias=False,
              mlp_bias=True, norm_bias=True, tie_embeddings=False, dropout=0.1),
        about="seed 001, 'Transformers in a Nutshell' (PyTorch Lightning + W&B): exact GELU, no attention biases, MLP "
              "and LayerNorm biases, untied bias-free head, GPT-2 init with residual scaling, emb/attn/residual "
              "dropout. Its printed block normalises the residual stream itself (x = ln1(x); x = x + attn(x)); its "
              "text says pre-norm (LayerNorm before each sublayer), which this preset follows. The tutorial does "
              "not print its sizes: these are character-level Shakespeare's usual ones (nanoGPT's). Recipe: plain "
              "Adam (AdamW with no weight decay), constant learning rate, no gradient clipping (Lightning's default)",
        recipe=dict(max_steps=5000, batch_size=64, lr=3e-4, min_lr=3e-4, warmup_steps=0, weight_decay=0.0,
                    grad_clip=0.0, eval_interval=250, eval_iters=200)),
    "aiayn-decoder-prenorm": Preset(
        ModelConfig(vocab_size=37000, context_length=512, d_model=512, n_layers=6, n_heads=8, d_mlp=2048,
                    positional="sinusoidal", norm="layernorm", norm_unbiased_std=True, norm_eps=1e-6, activation="relu",
                    norm_placement="pre", final_norm=True, attn_qkv_bias=False, attn_out_bias=False, mlp_bias=True,
                    norm_bias=True, tie_embeddings=False, unembed_bias=True, scale_embeddings=True, dropout=0.1,
                    mlp_hidden_dropout=0.1, init="xavier", xavier_embeddings=True),
        recipe=None,
        about="seed 002, a decoder-only 'Attention Is All You Need' model: sqrt(d_model)-scaled embeddings, "
              "sinusoidal positions, pre-norm with its own LayerNorm (unbiased std + eps), a final norm, bias-free "
              "attention, ReLU FFN with biases and dropout inside, an untied projection with a bias, Xavier init. "
              "(vaswani-decoder is the paper's post-norm model.) No training recipe in the seed"),
    "cs336-lm": Preset(
        _llama(vocab_size=10000, context_length=256, d_model=512, n_layers=4, n_heads=16, d_mlp=1344,
               norm_eps=1e-5, rope_theta=10000.0, init="truncated_normal"),
        recipe=None,
        about="seed 003, Stanford CS336 assignment 1's TransformerLM: RMSNorm, SwiGLU, interleaved-pair RoPE, "
              "pre-norm, no biases, untied lm_head, truncated-normal init (std sqrt(2/(fan_in+fan_out)) per matrix, "
              "embeddings std 1, cut at 3 std); the assignment's TinyStories sizes. No training recipe in the seed"),
    "tiny-transformer": Preset(
        ModelConfig(vocab_size=65, context_length=256, d_model=195, n_layers=5, n_heads=5, activation="relu",
                    norm="layernorm", positional="learned", attn_qkv_bias=False, bias=True, tie_embeddings=False,
                    unembed_bias=True, attn_scale_by="d_model", dropout=0.15, attn_dropout=0.1,
                    attn_out_dropout=0.1, init="torch"),
        about="seed 004, tiny-transformer: character model, 5 blocks x 5 heads, 195 wide, context 256; scores "
              "scaled by 1/sqrt(d_model); no q/k/v biases, biases elsewhere; lm_head with a bias; dropout 0.1 on "
              "attention probabilities and output, 0.15 on embeddings and the FFN output; PyTorch's default init. "
              "Its printed multihead calls head(head_size), which cannot run; the text (head(embeds, block, "
              "head_size)) is followed. Recipe: the tutorial's batch 64, lr 9e-4, 5000 iterations, eval every 300 "
              "(optimizer settings it does not state are TrainConfig's)",
        recipe=dict(max_steps=5000, batch_size=64, lr=9e-4, eval_interval=300)),
}

DEFAULT_RECIPE = "default"  # the recipe name meaning TrainConfig's own defaults


def _lookup(name: str) -> Preset:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}{did_you_mean(name, PRESETS)}; "
                         f"choose from {', '.join(sorted(PRESETS))}")
    return PRESETS[name]


def get_preset(name: str, **overrides: Any) -> ModelConfig:
    """The model of the preset called `name` (exact name), with optional field overrides."""
    return _lookup(name).model.replace(**overrides)


def get_recipe(name: str, **overrides: Any) -> "TrainConfig":
    """The training recipe of the preset called `name` as a TrainConfig, with optional overrides.

    `name` may also be "default" (TrainConfig's defaults). A preset with no recipe is refused
    rather than trained with defaults meant for a 0.8M-parameter model:

    >>> get_recipe("shakespeare-char").batch_size
    64
    >>> get_recipe("llama3-8b")
    Traceback (most recent call last):
    ...
    ValueError: preset 'llama3-8b' has no training recipe (...); pick one: recipe 'default' (...) or a preset's: ...
    """
    from ..train import TrainConfig  # train.py imports this module, so import it late

    if name == DEFAULT_RECIPE:
        recipe: dict[str, Any] = {}
    else:
        preset = _lookup(name)
        if preset.recipe is None:
            raise ValueError(
                f"preset {name!r} has no training recipe ({preset.about}); pick one: recipe "
                f"'{DEFAULT_RECIPE}' (TrainConfig's defaults) or a preset's: {', '.join(presets_with_recipes())}")
        recipe = preset.recipe
    return TrainConfig(**{**recipe, **overrides})


def presets_with_recipes() -> list[str]:
    return sorted(name for name, preset in PRESETS.items() if preset.recipe is not None)
