"""Sampling controls: the settings of a generation and how one token is picked from logits.

Every way of picking a token is a small function on a (batch, vocab) logits tensor, applied in
this order (as Hugging Face does): repetition penalty, temperature, top-k, top-p, min-p, then
argmax (temperature 0) or a draw from the softmax. Stop strings are matched here too, since both
the decoding loop and the text streamer need the same rule.

Example:
    >>> import torch
    >>> logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]])
    >>> filter_logits(logits, top_k=2)
    tensor([[2., 1., -inf, -inf]])
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from glasslm.tokenizers import eos_token_ids


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: Sequence[int]) -> str: ...


@dataclass
class GenerationConfig:
    """How to pick tokens and when to stop. The defaults sample from the model's own distribution.

    temperature 0 means greedy (argmax); top_k, top_p and min_p are then ignored.
    Stop tokens are not part of the output; stop strings cut the text just before them.
    """

    max_new_tokens: int = 256  # tokens to generate (fewer if a stop token or string comes first)
    temperature: float = 1.0  # divides the logits: < 1 sharpens, > 1 flattens; 0: greedy (argmax)
    top_k: int | None = None  # keep the k most likely tokens (and any tied with the k-th); None or 0: all
    top_p: float | None = None  # keep the smallest most-likely set with mass >= top_p; None: all
    min_p: float | None = None  # keep tokens with probability >= min_p * the top probability; None: all
    repetition_penalty: float = 1.0  # > 1 discourages tokens already in the prompt or output
    seed: int | None = None  # makes sampling reproducible; None: a fresh draw each time
    stop_tokens: Sequence[int] = ()  # stop at any of these token ids (not part of the output), besides eos
    ignore_eos: bool = False  # go on past the model's end-of-sequence tokens (see `with_eos`)
    stop_strings: Sequence[str] = ()  # stop before any of these texts (cut from the output)
    logprobs: bool = False  # also return log p(token) under the model's unmodified distribution
    window_keep: int | None = None  # tokens kept when the context slides; default context_length // 2
    window: Literal["refill", "recompute"] = "refill"  # past the context: refill now and then, or recompute on the last context_length every step
    pad_token: int = 0  # fills the left of shorter prompts; masked out, so any valid id works
    compile: bool = False  # decode with a torch.compile'd one-token step (prompts of one length; the first call compiles)
    # only ids below this are ever picked: the tokenizer's size, where the model's embedding table has
    # padding rows past it (Pythia, Qwen2); None: every row (see `with_vocab_limit`)
    vocab_limit: int | None = None

    def __post_init__(self) -> None:
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if self.temperature < 0 or not math.isfinite(self.temperature):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.top_k == 0:  # 0 has always meant "off" on the command line, as in transformers
            self.top_k = None
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be >= 1 (or 0 for off), got {self.top_k}")
        if self.top_p is not None and not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.min_p is not None and not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.vocab_limit is not None and self.vocab_limit < 1:
            raise ValueError(f"vocab_limit must be >= 1 (or None for every row), got {self.vocab_limit}")
        if self.window not in ("refill", "recompute"):
            raise ValueError(f"window must be 'refill' or 'recompute', got {self.window!r}")
        if any(s == "" for s in self.stop_strings):
            raise ValueError("stop strings must not be empty")
        self.stop_tokens = tuple(int(t) for t in self.stop_tokens)
        self.stop_strings = tuple(self.stop_strings)

    def replace(self, **changes: Any) -> "GenerationConfig":
        return dataclasses.replace(self, **changes)


def make_config(config: GenerationConfig | None = None, **controls: Any) -> GenerationConfig:
    """`config` (or the defaults) with keyword overrides, e.g. make_config(temperature=0)."""
    config = config or GenerationConfig()
    return config.replace(**controls) if controls else config


def eos_ids(model: Any, tokenizer: Any | None = None) -> tuple[int, ...]:
    """The model's end-of-sequence ids: those its checkpoint recorded (`model.eos_token_ids`, set
    by `load_checkpoint` / `load_model` from generation_config.json or the tokenizer), else the
    tokenizer's eos, else none (a model built in code, a character tokenizer)."""
    recorded = getattr(model, "eos_token_ids", None)
    if recorded is not None:
        return tuple(recorded)
    return eos_token_ids(tokenizer) if tokenizer is not None else ()


def with_eos(config: GenerationConfig, model: Any, tokenizer: Any | None = None) -> GenerationConfig:
    """`config` whose stop tokens include the model's eos ids (`eos_ids`), as transformers' `generate`
    stops at them by default; unchanged when `config.ignore_eos`.

    >>> from glasslm.presets import get_preset
    >>> from glasslm.core.model import TransformerLM
    >>> model = TransformerLM(get_preset("llama-tiny"))
    >>> model.eos_token_ids = (2,)
    >>> with_eos(GenerationConfig(stop_tokens=[5]), model).stop_tokens
    (5, 2)
    >>> with_eos(GenerationConfig(ignore_eos=True), model).stop_tokens
    ()
    """
    if config.ignore_eos:
        return config
    stops = tuple(dict.fromkeys((*config.stop_tokens, *eos_ids(model, tokenizer))))
    return config if stops == config.stop_tokens else config.replace(stop_tokens=stops)


def vocab_limit(model: Any, tokenizer: Any | None) -> int | None:
    """The tokenizer's size where the model has more embedding rows than it (the padding rows past
    it are no token: Pythia's 50,304 rows for 50,277 tokens, Qwen2's 151,936 for ~151,665); else None.

    >>> from glasslm.presets import get_preset
    >>> from glasslm.core.model import TransformerLM
    >>> from glasslm.tokenizers import CharTokenizer
    >>> model = TransformerLM(get_preset("llama-tiny", vocab_size=8))
    >>> vocab_limit(model, CharTokenizer.from_text("abc")), vocab_limit(model, None)
    (4, None)
    """
    size, rows = getattr(tokenizer, "vocab_size", None), getattr(getattr(model, "config", None), "vocab_size", None)
    return size if size is not None and rows is not None and size < rows else None


def with_vocab_limit(config: GenerationConfig, model: Any, tokenizer: Any | None) -> GenerationConfig:
    """`config` that never picks the model's padding rows (`vocab_limit`), as vLLM masks them."""
    limit = vocab_limit(model, tokenizer)
    if limit is None or (config.vocab_limit is not None and config.vocab_limit <= limit):
        return config
    return config.replace(vocab_limit=limit)


# --- choosing a token ----------------------------------------------------------------------------

def apply_repetition_penalty(
    logits: Float[Tensor, "batch vocab"], seen: Bool[Tensor, "batch vocab"], penalty: float
) -> Float[Tensor, "batch vocab"]:
    """Make already-seen tokens less likely (CTRL, Keskar et al. 2019, as Hugging Face applies it):
    a positive logit is divided by the penalty, a negative one multiplied, so both move down.

    >>> apply_repetition_penalty(torch.tensor([[2.0, -2.0, 1.0]]), torch.tensor([[True, True, False]]), 2.0)
    tensor([[ 1., -4.,  1.]])
    """
    if penalty == 1.0:
        return logits
    penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, penalized, logits)


def filter_logits(
    logits: Float[Tensor, "batch vocab"], top_k: int | None = None, top_p: float | None = None,
    min_p: float | None = None,
) -> Float[Tensor, "batch vocab"]:
    """Set to -inf every logit outside the top-k, top-p and min-p sets, applied in that order,
    each to the (renormalized) distribution the previous one left.

    Ties are kept together: a token as likely as the last one kept is kept too, so the result never
    depends on how a sort happened to order equal values.

    >>> filter_logits(torch.tensor([[3.0, 2.0, 2.0, 1.0]]), top_k=2)
    tensor([[3., 2., 2., -inf]])
    """
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]  # (batch, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        probs = torch.softmax(logits.float(), dim=-1)
        sorted_probs = probs.sort(dim=-1, descending=True).values
        # The smallest prefix with mass >= top_p ends at the first token whose cumulative mass
        # reaches top_p; every token at least as likely as that one stays.
        cumulative = sorted_probs.cumsum(dim=-1)
        last_kept = (cumulative < top_p).sum(dim=-1, keepdim=True).clamp_max(logits.shape[-1] - 1)
        threshold = sorted_probs.gather(-1, last_kept)  # (batch, 1)
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    if min_p is not None and min_p > 0.0:
        probs = torch.softmax(logits.float(), dim=-1)
        threshold = min_p * probs.amax(dim=-1, keepdim=True)
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    return logits


# Below float32's smallest normal number a temperature cannot divide the logits safely (it may read
# as 0): such temperatures are greedy, the limit sampling tends to as the temperature goes to 0.
SMALLEST_TEMPERATURE = float(torch.finfo(torch.float32).tiny)


def sample_next(
    logits: Float[Tensor, "batch vocab"], temperature: float = 1.0, top_k: int | None = None,
    top_p: float | None = None, generator: torch.Generator | None = None, min_p: float | None = None,
    vocab_limit: int | None = None,
) -> Int[Tensor, "batch"]:
    """Pick one token id per row: argmax when temperature == 0, else sample the filtered softmax.

    Only ids below `vocab_limit` can be picked (the rest are a padded embedding table's rows).
    The logits are shifted so their maximum is 0 before dividing by the temperature, so no
    temperature overflows them; one under `SMALLEST_TEMPERATURE` (1.2e-38) is greedy.

    >>> sample_next(torch.tensor([[0.0, 5.0, 1.0]]), temperature=0.0)
    tensor([1])
    >>> sample_next(torch.tensor([[0.0, 5.0, 1.0]]), temperature=0.0, vocab_limit=1)
    tensor([0])
    """
    if vocab_limit is not None and vocab_limit < logits.shape[-1]:
        logits = logits[..., :vocab_limit]  # the padding rows are no token
    if temperature < SMALLEST_TEMPERATURE:
        return logits.argmax(dim=-1)
    logits = logits.float()
    shifted = (logits - logits.amax(dim=-1, keepdim=True)) / temperature  # <= 0: exp cannot overflow
    probs = torch.softmax(filter_logits(shifted, top_k, top_p, min_p), dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def find_stop(text: str, stop_strings: Sequence[str]) -> int:
    """Index where the earliest stop string starts in `text`, or -1."""
    hits = [i for i in (text.find(s) for s in stop_strings) if i >= 0]
    return min(hits) if hits else -1
