"""A GGUF file's `{arch}.*` metadata checked for type and range before anything is built from it.

GGUF files come from strangers, and every number in one is a claim: a head count of 0 divides by
zero, a block count of 2**31 makes a loop of 2**31 layers, a context of 2**40 positions asks for a
rotary table of terabytes. The families' GGUF forms read only what `checked_values` hands them: each
key llama.cpp's architectures use that glasslm reads, of the kind the key holds (a whole number where
a count is meant; a float32-stored 24.0 is not a block count) and in a range no real model leaves.
Keys outside the table are left out, so a form cannot read an unchecked value by accident.

Example:
    >>> checked_values("llama", {"block_count": 2, "embedding_length": 64, "context_length": 128,
    ...                          "feed_forward_length": 96, "attention.head_count": 4, "x.y": "?"}, n_tensors=20)
    {'block_count': 2, 'embedding_length': 64, 'context_length': 128, 'feed_forward_length': 96, 'attention.head_count': 4}
    >>> checked_values("llama", {"block_count": 2, "embedding_length": 64, "context_length": 128,
    ...                          "feed_forward_length": 96, "attention.head_count": 0}, n_tensors=20)
    Traceback (most recent call last):
    ...
    ValueError: llama.attention.head_count is 0; it must be a whole number from 1 to 4,096
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

# The longest context read from a file without being asked (--context-length): a rotary model's
# position tables grow with it. Qwen2.5's 1M-token models (1,010,000) fit.
MAX_CONTEXT = 2 ** 20
# Rotary tables hold context x rotated dims numbers (cos and sin each); no file asks past this
# (Llama 3.1 asks 131,072 x 128 = 2**24).
MAX_ROTARY_TABLE = 2 ** 27


@dataclasses.dataclass(frozen=True)
class Rule:
    """What one key may hold: a whole number, a (finite) number, a string or a flag, and the range."""

    kind: str  # "int", "float", "str", "bool"
    low: float = 0
    high: float = math.inf
    low_open: bool = False  # (low, high] rather than [low, high]

    def problem(self, value: Any) -> str | None:
        """Why `value` is not one (None: it is)."""
        if self.kind == "str":
            return None if isinstance(value, str) else "text"
        if self.kind == "bool":
            return None if isinstance(value, bool) or value in (0, 1) else "true or false"
        whole = isinstance(value, int) and not isinstance(value, bool)
        number = whole or (self.kind == "float" and isinstance(value, float) and math.isfinite(value))
        if number and (value > self.low if self.low_open else value >= self.low) and value <= self.high:
            return None
        if self.kind == "int":
            return f"a whole number from {self.low:,} to {self.high:,}"
        return f"a number {'above' if self.low_open else 'from'} {self.low:g} to {self.high:g}"


def _count(high: int, low: int = 1) -> Rule:
    return Rule("int", low, high)


def _positive(high: float = 1e12) -> Rule:
    return Rule("float", 0, high, low_open=True)


RULES: dict[str, Rule] = {
    "context_length": _count(2 ** 40),  # (checked against MAX_CONTEXT apart: --context-length may replace it)
    "embedding_length": _count(2 ** 17), "block_count": _count(4096), "feed_forward_length": _count(2 ** 20),
    "attention.head_count": _count(4096), "attention.head_count_kv": _count(4096),
    "attention.key_length": _count(2 ** 14), "attention.value_length": _count(2 ** 14),
    "rope.dimension_count": _count(2 ** 14), "rope.freq_base": _positive(), "rope.freq_base_swa": _positive(),
    "rope.scaling.type": Rule("str"), "rope.scaling.factor": Rule("float", 1, 1e6),
    "rope.scaling.original_context_length": _count(2 ** 40), "rope.scaling.attn_factor": _positive(1e3),
    "rope.scaling.yarn_beta_fast": _positive(1e6), "rope.scaling.yarn_beta_slow": _positive(1e6),
    "attention.layer_norm_rms_epsilon": _positive(1.0), "attention.layer_norm_epsilon": _positive(1.0),
    "attention.sliding_window": _count(2 ** 40, low=0), "attention.sliding_window_pattern": _count(4096),
    "attn_logit_softcapping": _positive(1e6), "final_logit_softcapping": _positive(1e6),
    "use_parallel_residual": Rule("bool"),
    "expert_count": _count(4096), "expert_used_count": _count(4096), "expert_feed_forward_length": _count(2 ** 20),
    "expert_shared_feed_forward_length": _count(2 ** 20),
}
# What every architecture glasslm reads says (llama.cpp refuses a file without them, too).
REQUIRED = ("context_length", "embedding_length", "block_count", "feed_forward_length", "attention.head_count")


def checked_values(arch: str, values: Mapping[str, Any], n_tensors: int, context_given: bool = False) -> dict[str, Any]:
    """The `{arch}.*` values (keys without the prefix) that `RULES` knows, each checked; ValueError
    naming the first key that is missing, of another kind or out of range. `n_tensors` bounds the
    block count (every block has tensors of its own); `context_given`: the caller chose the context
    length, so the file's may exceed `MAX_CONTEXT`."""
    missing = [key for key in REQUIRED if key not in values]
    if missing:
        raise ValueError(f"the file has no {arch}.{missing[0]}, which every {arch} model states")
    out = {}
    for key, value in values.items():
        rule = RULES.get(key)
        if rule is None:
            continue
        problem = rule.problem(value)
        if problem is not None:
            raise ValueError(f"{arch}.{key} is {_shown(value)}; it must be {problem}")
        out[key] = value
    if out["block_count"] > n_tensors:
        raise ValueError(f"{arch}.block_count is {out['block_count']:,}, but the file holds {n_tensors} tensors")
    if not context_given and out["context_length"] > MAX_CONTEXT:
        raise ValueError(f"{arch}.context_length is {out['context_length']:,}, past the {MAX_CONTEXT:,} glasslm reads "
                         "unasked; `glasslm convert --from-gguf FILE --context-length N` (import_gguf(..., context_length=N)) "
                         "loads it with a context of N")
    return out


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def rotary_table_problem(context_length: int, rotary_dims: int) -> str | None:
    """Why a rotary model of this context and rotated head size is not built (None: it is)."""
    if context_length * rotary_dims <= MAX_ROTARY_TABLE:
        return None
    return (f"its rotary tables would hold {context_length:,} positions x {rotary_dims} dims, past the "
            f"{MAX_ROTARY_TABLE:,} glasslm builds; `glasslm convert --from-gguf FILE --context-length N` "
            "(import_gguf(..., context_length=N)) loads it with a shorter context")
