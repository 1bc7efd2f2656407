"""Named models: every preset maps a name to its architecture and, where one has been tried, its
training recipe (the TrainConfig fields that differ from TrainConfig's defaults).

Example:
    >>> from glasslm.presets import get_preset
    >>> get_preset("gpt2-small").d_head
    64
    >>> get_preset("llama-tiny", n_layers=2).n_layers
    2
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from glasslm.core.config import ModelConfig
from glasslm.core.fields import did_you_mean


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
    # Whether a character vocabulary built for this preset ends with <|endoftext|> (glasslm's char
    # tokenizer does, so exports have an eos); False where the preset reproduces a reference whose
    # character vocabulary has none (nanoGPT's shakespeare_char, seeds 001 and 004: vocabulary 65).
    char_end_of_text: bool = True


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
    "pythia-160m": Preset(
        ModelConfig(vocab_size=50304, context_length=2048, d_model=768, n_layers=12, n_heads=12, d_mlp=3072,
                    positional="rope", rotary_dims=16, norm="layernorm", activation="gelu", parallel_residual=True,
                    tie_embeddings=False),
        recipe=None, about="Pythia 160M (GPT-NeoX: parallel attention + MLP, rotary on a quarter of each head; "
                           "pretrained weights: convert --from-hf)"),
    "qwen3-0.6b": Preset(
        _llama(vocab_size=151936, context_length=40960, d_model=1024, n_layers=28, n_heads=16, n_kv_heads=8,
               d_head=128, d_mlp=3072, norm_eps=1e-6, rope_theta=1000000.0, qk_norm=True, tie_embeddings=True),
        recipe=None, about="Qwen3 0.6B (q/k RMSNorm per head; pretrained weights: convert --from-hf)"),
    "gemma3-270m": Preset(
        _llama(vocab_size=262144, context_length=32768, d_model=640, n_layers=18, n_heads=4, n_kv_heads=1,
               d_head=256, d_mlp=2048, norm_eps=1e-6, activation="gelu_tanh", rope_theta=1000000.0, rope_local_theta=10000.0,
               sliding_window=512, global_layers=(5, 11, 17), qk_norm=True, post_norms=True, norm_unit_offset=True,
               scale_embeddings=True, attn_scale=256 ** -0.5, tie_embeddings=True),
        recipe=None, about="Gemma 3 270M (GeGLU, (1 + w) RMSNorms around attention and MLP, q/k norms, sliding "
                           "window 512 with every sixth layer global; pretrained weights: convert --from-hf)"),
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
        recipe=dict(max_steps=5000, batch_size=64, warmup_steps=100, eval_interval=250, eval_iters=200),
        char_end_of_text=False),
    "shakespeare-char-cpu": Preset(
        _char_llama(context_length=64, d_model=128, n_layers=4, n_heads=4, d_mlp=336, qk_norm=True),
        about="nanoGPT's CPU tiny-Shakespeare size (4 layers, d_model 128, context 64) with Llama parts (RoPE, "
              "RMSNorm, SwiGLU), per-head q/k norms and Muon (momentum 0.85, 300 steps): nanoGPT's best val loss "
              "in about a quarter of its time (benchmarks/bench_time_to_loss.py)",
        recipe=dict(optimizer="muon", muon_lr=0.02, muon_momentum=0.85, lr=3e-3, min_lr=3e-4, beta2=0.95,
                    warmup_steps=20, max_steps=300, batch_size=16)),
    "shakespeare-char-cpu-moe": Preset(
        _char_llama(context_length=64, d_model=128, n_layers=4, n_heads=4, d_mlp=336, qk_norm=True, n_experts=4,
                    experts_per_token=2, d_expert=168),
        about="shakespeare-char-cpu with a mixture of 4 SwiGLU experts of 168 in every layer, 2 per token (the dense "
              "MLP's 336 active, twice its parameters), the load-balancing loss at 0.01: a Qwen3-MoE to train on a CPU",
        recipe=dict(optimizer="muon", muon_lr=0.02, muon_momentum=0.85, lr=3e-3, min_lr=3e-4, beta2=0.95,
                    warmup_steps=20, max_steps=300, batch_size=16)),
    "shakespeare-char-cpu-nanogpt": Preset(
        _char(context_length=64, d_model=128, n_layers=4, n_heads=4, dropout=0.0),
        about="nanoGPT's CPU recipe for tiny Shakespeare (TrainConfig's defaults are that recipe)",
        recipe={}, char_end_of_text=False),
    # --- the five seed systems (../shared/seeds), each reproduced exactly: tests/io/test_seeds.py ---
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
                    grad_clip=0.0, eval_interval=250, eval_iters=200),
        char_end_of_text=False),
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
        recipe=dict(max_steps=5000, batch_size=64, lr=9e-4, eval_interval=300),
        char_end_of_text=False),
    "induction-attn-only": Preset(
        ModelConfig(vocab_size=64, context_length=48, d_model=64, n_layers=2, n_heads=4, mlp="none",
                    positional="rope", tie_embeddings=False, dropout=0.0),
        about="a 2-layer attention-only model for the induction-head study (docs/induction.md, "
              "scripts/induction_study.py): trained on 24 random tokens repeated once, generated by the code",
        recipe=dict(max_steps=1500, batch_size=32, lr=1e-3, weight_decay=0.0)),
}

DEFAULT_RECIPE = "default"  # the recipe name meaning TrainConfig's own defaults


def lookup_preset(name: str) -> Preset:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}{did_you_mean(name, PRESETS)}; "
                         f"choose from {', '.join(sorted(PRESETS))}")
    return PRESETS[name]


def get_preset(name: str, **overrides: Any) -> ModelConfig:
    """The model of the preset called `name` (exact name), with optional field overrides."""
    return lookup_preset(name).model.replace(**overrides)


def presets_with_recipes() -> list[str]:
    return sorted(name for name, preset in PRESETS.items() if preset.recipe is not None)
