"""Prefix caching and chunked prefill: what a server's engine does before a request's first token.

Many requests begin alike: the same system prompt, or a whole conversation whose earlier turns the
server has just computed. A prompt's keys and values at position p depend only on tokens 0..p, so
those of a shared beginning can be kept and reused. `PrefixCache` keeps them in blocks of `block`
tokens (32 by default), each found by the tokens of the whole prefix it ends (a chain: block i's key
is (block i-1's key, block i's tokens)), within a memory budget: when full, the least recently used
blocks go first (a block is always used after its parent, so leaves go before the prefixes they
extend). A request then prefills only what follows its longest cached prefix.

`Prefill` is one request's prompt on its way into the cache, a chunk at a time: while other rows are
decoding, the engine runs one chunk per step (so a long prompt delays their next tokens by a chunk,
never by the whole prompt), and the whole rest at once when nothing else is running.

Example:
    >>> import torch
    >>> cache = PrefixCache(budget_bytes=1 << 20, block=2)
    >>> keys = [torch.arange(12.0).reshape(1, 6, 2)]  # one layer: (kv_heads, tokens, d_head)
    >>> cache.insert([5, 6, 7, 8, 9, 10], keys, keys)
    >>> n, found, _ = cache.lookup([5, 6, 7, 8, 1, 2, 3])  # the first two blocks match
    >>> n, found[0][0, :, 0].tolist()
    (4, [0.0, 2.0, 4.0, 6.0])
    >>> cache.lookup([5, 6, 7, 8])[0]  # at least one token is left to prefill (its logits are needed)
    2
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from glasslm.generation.decoding import DecodeWindow


@dataclass
class _Block:
    parent: Any  # the key of the block before it (None for the first)
    tokens: tuple[int, ...]
    keys: Float[Tensor, "layers kv_heads block d_head"]
    values: Float[Tensor, "layers kv_heads block d_head"]

    @property
    def bytes(self) -> int:
        return 2 * self.keys.numel() * self.keys.element_size()


class PrefixCache:
    """Keys and values of prompt prefixes, in blocks of `block` tokens, at most `budget_bytes` of them."""

    def __init__(self, budget_bytes: int, block: int = 32):
        if budget_bytes < 0 or block < 1:
            raise ValueError("budget_bytes must be >= 0 and block >= 1")
        self.budget, self.block = budget_bytes, block
        self.blocks: collections.OrderedDict[Any, _Block] = collections.OrderedDict()  # oldest use first
        self.bytes = 0
        self.stats: collections.Counter[str] = collections.Counter()  # hit/looked-up tokens, evicted blocks

    def _keys(self, tokens: list[int], blocks: int) -> list[tuple[Any, tuple[int, ...], Any]]:
        """(key, block tokens, parent key) of the first `blocks` blocks of `tokens`."""
        out, parent = [], None
        for i in range(blocks):
            chunk = tuple(tokens[i * self.block:(i + 1) * self.block])
            key = hash((parent, chunk))
            out.append((key, chunk, parent))
            parent = key
        return out

    def _matched(self, tokens: list[int]) -> list[tuple[Any, _Block]]:
        matched = []
        for key, chunk, parent in self._keys(tokens, (len(tokens) - 1) // self.block):
            found = self.blocks.get(key)
            if found is None or found.tokens != chunk or found.parent != parent:
                break
            matched.append((key, found))
        return matched

    def cached(self, tokens: list[int]) -> int:
        """How many tokens `lookup` would find (nothing counted, nothing moved)."""
        return len(self._matched(tokens)) * self.block

    def lookup(self, tokens: list[int]) -> tuple[int, list[Tensor], list[Tensor]]:
        """(n, keys, values): the longest cached prefix of `tokens`, in whole blocks and shorter than
        `tokens` (the last token's logits must still be computed); per layer (kv_heads, n, d_head)."""
        found = self._matched(tokens)
        for key, _ in found:
            self.blocks.move_to_end(key)
        matched = [block for _, block in found]
        n = len(matched) * self.block
        self.stats["looked_up_tokens"] += len(tokens)
        self.stats["hit_tokens"] += n
        if not matched:
            return 0, [], []
        keys = torch.cat([b.keys for b in matched], dim=2)  # (layers, kv_heads, n, d_head)
        values = torch.cat([b.values for b in matched], dim=2)
        return n, list(keys.unbind(0)), list(values.unbind(0))

    def insert(self, tokens: list[int], keys: list[Tensor], values: list[Tensor]) -> None:
        """Keep the whole blocks of `tokens`, whose keys and values per layer are (kv_heads, >= len, d_head)."""
        if self.budget == 0:
            return
        for i, (key, chunk, parent) in enumerate(self._keys(tokens, len(tokens) // self.block)):
            if key in self.blocks:
                self.blocks.move_to_end(key)
                continue
            span = slice(i * self.block, (i + 1) * self.block)
            block = _Block(parent, chunk, torch.stack([k[:, span] for k in keys]).clone(),
                           torch.stack([v[:, span] for v in values]).clone())
            self.blocks[key] = block
            self.bytes += block.bytes
        while self.bytes > self.budget and self.blocks:
            _, evicted = self.blocks.popitem(last=False)
            self.bytes -= evicted.bytes
            self.stats["evicted_blocks"] += 1


@dataclass
class Prefill:
    """One prompt going into its own one-row window, a chunk at a time (after a cached prefix, if any)."""

    job: Any  # the engine's Job: `held` are the tokens to prefill
    window: DecodeWindow
    done: int = 0  # tokens of job.held already in the window's cache
    logits: Tensor | None = field(default=None, repr=False)

    @classmethod
    def start(cls, job: Any, model: Any, capacity: int, cache: PrefixCache | None) -> Prefill:
        """A window for `job`, its cached prefix (if any) copied in."""
        window = DecodeWindow(model, 1, capacity)
        prefill = cls(job, window)
        if cache is not None:
            n, keys, values = cache.lookup(job.held)
            if n:
                window.load_prefix(keys, values)
                prefill.done = n
        return prefill

    @property
    def left(self) -> int:
        return len(self.job.held) - self.done

    def advance(self, budget: int | None) -> bool:
        """Prefill up to `budget` more tokens (None: all the rest); True once the whole prompt is in."""
        take = self.job.held[self.done:] if budget is None else self.job.held[self.done:self.done + budget]
        if self.done == 0:
            self.logits = self.window.prefill([take])
        else:
            self.logits = self.window.prefill_more(take)
        self.done += len(take)
        return self.left == 0
