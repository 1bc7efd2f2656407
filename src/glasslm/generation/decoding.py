"""The decoding loop: prefill once into a KV cache, then one token per step, for ragged batches.

Prefill runs the whole prompt through the model once, filling the key/value cache. Decode feeds
only the newest token, attending to the cached keys and values, picks the next token from the last
logits (glasslm.generation.sampling), and repeats: each step costs one pass over the weights, whatever the
position. Prompts of different lengths are left-padded with per-row positions, so each row equals
generating it alone.

Example:
    >>> from glasslm.presets import get_preset
    >>> from glasslm.core.model import TransformerLM
    >>> model = TransformerLM(get_preset("llama-tiny")).eval()
    >>> len(list(generate_tokens(model, [1, 2, 3], max_new_tokens=4, temperature=0.0)))
    4
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from glasslm.core.layers import Linear
from glasslm.core.model import TransformerLM
from glasslm.generation.compiled import StaticDecodeWindow
from glasslm.generation.cpu import low_precision_cpu, onednn_disabled
from glasslm.generation.fast import FastDecoder
from glasslm.generation.sampling import (
    GenerationConfig, Tokenizer, apply_repetition_penalty, find_stop, make_config, sample_next, with_eos,
    with_vocab_limit,
)


# --- the decoding loop ---------------------------------------------------------------------------

@dataclass
class Step:
    """One decoding step for every row of the batch."""

    tokens: Int[Tensor, "batch"]  # the token picked for each row
    logits: Float[Tensor, "batch vocab"]  # the model's raw (float32) logits it was picked from
    logprobs: Float[Tensor, "batch"] | None  # log p(token) under those raw logits (over the vocab_limit tokens), if asked for


class DecodeWindow:
    """A KV cache plus what batched decoding needs around it: left padding, per-row positions, and
    which cache slots hold real tokens (rather than padding) for the attention mask.

    Rows are right-aligned: every row's newest token sits at the cache cursor, and a shorter row has
    padding on its left. Besides prefill and decode, rows can join (`extend`) and leave
    (`keep_rows`) between steps, which is what a continuous-batching server needs.

    Example:
        >>> from glasslm.presets import get_preset
        >>> from glasslm.core.model import TransformerLM
        >>> model = TransformerLM(get_preset("llama-tiny")).eval()
        >>> window = DecodeWindow(model, batch=2, max_length=16)
        >>> window.prefill([[1, 2, 3], [4]]).shape  # (batch, vocab): each row's next-token logits
        torch.Size([2, 512])
        >>> window.pads.tolist()
        [0, 2]
        >>> newcomer = DecodeWindow(model, batch=1, max_length=16)
        >>> _ = newcomer.prefill([[5, 6]])
        >>> window.extend(newcomer)
        >>> window.keep_rows([1, 2])  # drops row 0; the shared padding column goes with it
        >>> window.pads.tolist(), window.rows
        ([1, 0], 2)
    """

    def __init__(self, model: TransformerLM, batch: int, max_length: int, pad_token: int = 0):
        self.model, self.pad_token = model, pad_token
        self.device = model.embed.device
        self._low_precision_cpu = low_precision_cpu(model.embed)  # float32 keys and values (generation.cpu)
        self.cache = model.new_kv_cache(batch, max_length, dtype=torch.float32 if self._low_precision_cpu else None)
        self.key_is_real: Bool[Tensor, "batch max_length"] | None = None  # None: no padding anywhere
        self.next_position: Int[Tensor, "batch"] = torch.zeros(batch, dtype=torch.long, device=self.device)
        self._set_pads(torch.zeros(batch, dtype=torch.long, device=self.device))
        self._fast: FastDecoder | None | bool = False  # built at the first decode (False: not yet)

    @property
    def fast(self) -> FastDecoder | None:
        """The C++ step kernels' step, where it runs this model (None: the readable forward). Built at the
        first decode, not here: a window that only prefills (a scored prompt, a newcomer joining a
        running batch) never pays for it (~4 ms for SmolLM2's 30 blocks)."""
        if self._fast is False:
            self._fast = FastDecoder.for_model(self.model)
        return self._fast

    @fast.setter
    def fast(self, decoder: FastDecoder | None) -> None:
        self._fast = decoder

    @property
    def full(self) -> bool:
        """True once every cache slot is written: the next token needs a re-prefill."""
        return self.cache.length >= self.cache.max_length

    @property
    def rows(self) -> int:
        return int(self.next_position.shape[0])

    @property
    def pads(self) -> Int[Tensor, "batch"]:
        """How many padding slots sit left of each row's first real token."""
        return self._pads

    def _set_pads(self, pads: Int[Tensor, "batch"]) -> None:
        """Keep the attention mask and the kernel choice in step with the rows' padding."""
        self._pads = pads
        slots = torch.arange(self.cache.max_length, device=self.device)
        # Pads sit left; later slots are real once written.
        self.key_is_real = None if int(pads.max()) == 0 else slots[None, :] >= pads[:, None]
        # One-row bf16 steps run ATen's own vector x matrix kernel (generation.cpu).
        self.use_native_gemv = self._low_precision_cpu and len(pads) == 1

    def prefill(self, rows: Sequence[Sequence[int]], every_position: bool = False) -> Float[Tensor, "batch ..."]:
        """Empty the cache and run the rows (left-padded to one length) through the model.

        Returns each row's next-token logits (batch, vocab), or with `every_position` the logits at
        every slot (batch, longest, vocab; row r's token j sits at slot j + pads[r]), for scoring prompts.
        """
        lengths = [len(r) for r in rows]
        longest = max(lengths)
        tokens = torch.tensor([[self.pad_token] * (longest - n) + list(r) for r, n in zip(rows, lengths)],
                              dtype=torch.long, device=self.device)
        self.next_position = torch.tensor(lengths, dtype=torch.long, device=self.device)
        self.cache.reset()
        n_pad = torch.tensor([longest - n for n in lengths], device=self.device)  # (batch,)
        self._set_pads(n_pad)
        if self.key_is_real is None:  # no padding: the model's own causal path is exact and fastest
            logits = self.model(tokens, kv_cache=self.cache, last_logits_only=not every_position)
            return logits.float() if every_position else logits[:, -1].float()
        # A real token at slot s of a row with p pads is that row's token number s - p.
        slots = torch.arange(longest, device=self.device)[None, :]  # (1, longest)
        positions = (slots - n_pad[:, None]).clamp_min(0)  # (batch, longest)
        causal = torch.ones(longest, longest, dtype=torch.bool, device=self.device).tril()
        mask = causal & self.key_is_real[:, None, :longest]  # (batch, query, key)
        # A pad query would see no key at all. glasslm's softmax and PyTorch 2.13's CPU kernels
        # return zeros for such a row, but some kernels (other versions, other devices) return NaN,
        # which would leak into real rows through NaN keys and values (0 * NaN = NaN). Letting
        # pads see themselves makes every row well defined on any kernel; real rows are unaffected.
        mask |= torch.eye(longest, dtype=torch.bool, device=self.device)
        logits = self.model(tokens, positions, self.cache, mask, last_logits_only=not every_position)
        return logits.float() if every_position else logits[:, -1].float()

    def decode(self, tokens: Int[Tensor, "batch"]) -> Float[Tensor, "batch vocab"]:
        """Feed one new token per row; its keys and values land in the next cache slot.

        The step runs `fast.FastDecoder` where it can (the same numbers up to float rounding), and
        the model's readable forward whenever hooks or TransformerLens-style options need it."""
        if self.fast is not None and self.fast.usable():
            logits = self.fast.step(tokens, self.cache, self.next_position, self.key_is_real)
            self.next_position += 1
            return logits
        positions = mask = None
        if self.key_is_real is not None:
            end = self.cache.length + 1
            positions = self.next_position[:, None]  # (batch, 1)
            mask = self.key_is_real[:, None, :end]  # (batch, 1, end): real keys, including this one
        # One query may see every cached key, so without padding no mask is needed at all.
        with onednn_disabled(self.use_native_gemv):
            logits = self.model(tokens[:, None], positions, self.cache, mask)[:, -1].float()
        self.next_position += 1  # only now: `positions` above is a view of this tensor
        return logits

    def extend(self, other: DecodeWindow) -> None:
        """Append `other`'s rows (same model) below this window's, keys and values included.

        Both caches are right-aligned at the longer one's cursor, so a row's real tokens still end
        there and each row decodes on exactly as it would have alone. The joined window has the
        larger of the two windows' slot counts.
        """
        capacity = max(self.cache.max_length, other.cache.max_length)
        length = max(self.cache.length, other.cache.length)
        shift_ours, shift_theirs = length - self.cache.length, length - other.cache.length
        for ours, theirs in ((self.cache.keys, other.cache.keys), (self.cache.values, other.cache.values)):
            for layer in range(len(ours)):
                ours[layer] = torch.cat([_shift(ours[layer], shift_ours, self.cache.length, capacity),
                                         _shift(theirs[layer], shift_theirs, other.cache.length, capacity)])
        self.cache.length, self.cache.max_length = length, capacity
        self.next_position = torch.cat([self.next_position, other.next_position])
        self._set_pads(torch.cat([self._pads + shift_ours, other.pads + shift_theirs]))

    def grow(self, max_length: int) -> None:
        """Give every row room for `max_length` slots (keys and values copied, the rest zero): a window
        sized for what its rows need now grows as they do, instead of holding the whole context from
        the start (SmolLM2: 377 MB a row at its 8,192 tokens)."""
        if max_length < self.cache.length:
            raise ValueError(f"cannot shrink a window holding {self.cache.length} slots to {max_length}")
        for store in (self.cache.keys, self.cache.values):
            for layer in range(len(store)):
                store[layer] = _shift(store[layer], 0, self.cache.length, max_length)
        self.cache.max_length = max_length
        self._set_pads(self._pads)

    @property
    def nbytes(self) -> int:
        """Bytes of keys and values allocated (every row, every slot)."""
        return sum(t.numel() * t.element_size() for t in (*self.cache.keys, *self.cache.values))

    def row_keys_values(self, row: int) -> tuple[list[Tensor], list[Tensor]]:
        """Row `row`'s keys and values per layer, (kv_heads, tokens it holds, d_head): views, no copy."""
        pad, end = int(self._pads[row]), self.cache.length
        return ([k[row, :, pad:end] for k in self.cache.keys], [v[row, :, pad:end] for v in self.cache.values])

    def load_prefix(self, keys: Sequence[Tensor], values: Sequence[Tensor]) -> None:
        """Start an empty one-row window from the keys and values of a prefix ((kv_heads, n, d_head) per
        layer, from `row_keys_values` of a window of the same model); `prefill_more` goes on after it."""
        if self.rows != 1 or self.cache.length:
            raise ValueError("load_prefix starts an empty one-row window")
        n = keys[0].shape[1]
        for layer, (k, v) in enumerate(zip(keys, values)):
            self.cache.keys[layer][0, :, :n] = k
            self.cache.values[layer][0, :, :n] = v
        self.cache.length = n
        self.next_position = torch.tensor([n], dtype=torch.long, device=self.device)

    def prefill_more(self, tokens: Sequence[int]) -> Float[Tensor, "1 vocab"]:
        """Run more tokens of a one-row window without padding after those cached (a prompt prefilled a
        chunk at a time, or after a cached prefix); returns the next-token logits."""
        if self.rows != 1 or self.key_is_real is not None:
            raise ValueError("prefill_more continues one row without padding")
        ids = torch.tensor([list(tokens)], dtype=torch.long, device=self.device)
        logits = self.model(ids, kv_cache=self.cache, last_logits_only=True)
        self.next_position += len(tokens)
        return logits[:, -1].float()

    def keep_rows(self, keep: Sequence[int]) -> None:
        """Keep only rows `keep` (in that order), and drop the left padding no kept row needs."""
        if not keep:
            raise ValueError("keep at least one row (drop the window instead)")
        index = torch.tensor(list(keep), device=self.device)
        pads = self._pads[index]
        trim = int(pads.min())
        for store in (self.cache.keys, self.cache.values):
            for layer in range(len(store)):
                store[layer] = _shift(store[layer][index], -trim, self.cache.length)
        self.cache.length -= trim
        self.next_position = self.next_position[index]
        self._set_pads(pads - trim)


def _shift(t: Float[Tensor, "batch heads slots d"], by: int, length: int,
           slots: int | None = None) -> Float[Tensor, "batch heads slots d"]:
    """Move cache slots [0, length) right by `by` (left if negative) into a tensor of `slots` slots (default:
    as many as `t` has); vacated slots are zero."""
    slots = t.shape[2] if slots is None else slots
    if by == 0 and slots == t.shape[2]:
        return t
    out = t.new_zeros(t.shape[0], t.shape[1], slots, t.shape[3])
    if by >= 0:
        out[:, :, by:by + length] = t[:, :, :length]
    else:
        out[:, :, :length + by] = t[:, :, -by:length]
    return out


def _window_keep(model: TransformerLM, config: GenerationConfig) -> int:
    """How many tokens a row keeps when its window slides past the context (checked)."""
    context = model.config.context_length
    keep = config.window_keep or max(1, context // 2)
    if not 1 <= keep < context:
        raise ValueError(f"window_keep must be in [1, context_length={context}), got {keep}")
    if config.window == "recompute":
        keep = context  # slide by one token: every step re-runs the last context_length tokens
    return keep


def _checked_rows(prompts: Sequence[Sequence[int]], vocab: int) -> list[list[int]]:
    """The prompts as lists of ints, after checking there is at least one and each is a valid token row."""
    if len(prompts) == 0:
        raise ValueError("no prompts given")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt must contain at least one token")
    rows = [list(map(int, p)) for p in prompts]
    for row in rows:
        if min(row) < 0 or max(row) >= vocab:
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
    return rows


def _new_window(model: TransformerLM, rows: list[list[int]], config: GenerationConfig) -> DecodeWindow | StaticDecodeWindow:
    """The cache for these rows: room for the longest prompt plus the new tokens, never beyond the
    context; compiled steps (`config.compile`) where the rows are of one length."""
    max_length = min(model.config.context_length, max(len(r) for r in rows) + config.max_new_tokens)
    if config.compile and len({len(r) for r in rows}) == 1:
        return StaticDecodeWindow(model, len(rows), max_length)
    return DecodeWindow(model, len(rows), max_length, config.pad_token)


def decode_steps(
    model: TransformerLM, prompts: Sequence[Sequence[int]], config: GenerationConfig | None = None,
) -> Iterator[Step]:
    """The raw loop: yield one `Step` per new token for every row, config.max_new_tokens times.

    Rows never stop here (callers decide when a row is done and ignore its later tokens). Prompts
    of different lengths are left-padded; each row gets positions 0..n-1 and a mask hiding the
    padding, so it decodes as it would alone. When a row reaches the context length its window
    slides: the cache is refilled with its last `window_keep` tokens (default context_length // 2),
    so the cost of re-running them is paid once every context_length - window_keep tokens.
    With `window="recompute"` the row is instead re-run on its last context_length tokens at every
    step past the context (as seed 004's `autocomplete` crops and recomputes): each prediction sees
    a full context, at the cost of a full forward pass per token.
    With `compile`, prompts of one length decode through a compiled step (`compiled.StaticDecodeWindow`);
    ragged batches decode eagerly.
    """
    config = config or GenerationConfig()
    rows = _checked_rows(prompts, model.config.vocab_size)
    keep = _window_keep(model, config)
    context = model.config.context_length
    device = model.embed.device
    vocab = model.config.vocab_size
    batch = len(prompts)
    generator = torch.Generator(device=device).manual_seed(config.seed) if config.seed is not None else None
    seen = None
    if config.repetition_penalty != 1.0:
        seen = torch.zeros(batch, vocab, dtype=torch.bool, device=device)
        for i, row in enumerate(rows):
            seen[i, row] = True

    window = _new_window(model, rows, config)
    with torch.inference_mode():
        in_cache = [r[-context:] for r in rows]  # each row's tokens the cache holds (its window)
        logits = window.prefill(in_cache)
        for step in range(config.max_new_tokens):
            scores = logits if seen is None else apply_repetition_penalty(logits, seen, config.repetition_penalty)
            tokens = sample_next(scores, config.temperature, config.top_k, config.top_p, generator, config.min_p,
                                 config.vocab_limit)
            logprobs = None
            if config.logprobs:
                # under the distribution sampling draws from (padding rows past vocab_limit masked)
                logprobs = torch.log_softmax(logits[..., :config.vocab_limit], dim=-1).gather(-1, tokens[:, None])[:, 0]
            yield Step(tokens, logits, logprobs)
            if step == config.max_new_tokens - 1:
                break  # the next token's logits would never be used
            for row, held, token in zip(rows, in_cache, tokens.tolist()):
                row.append(token)
                held.append(token)
            if seen is not None:
                seen[torch.arange(batch, device=device), tokens] = True
            if window.full:
                # A row whose own window reached the context slides to its last `keep` tokens; the
                # others are re-run unchanged, dropping their padding. So each row slides exactly
                # when it would alone, and batched rows match unbatched ones beyond the context too.
                in_cache = [row[-keep:] if len(held) > context else held for row, held in zip(rows, in_cache)]
                logits = window.prefill(in_cache)
            else:
                logits = window.decode(tokens)


@dataclass
class Generation:
    """What one prompt produced. `text` is set when a tokenizer was given."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] | None = None
    text: str | None = None
    finish_reason: str = "length"  # "length", "stop_token" or "stop_string"


def generate(
    model: TransformerLM, prompts: Sequence[Sequence[int]], config: GenerationConfig | None = None,
    tokenizer: Tokenizer | None = None, **controls: Any,
) -> list[Generation]:
    """Generate for a batch of token prompts (of any lengths); each row stops on its own.

    Stop strings need `tokenizer` (they are checked on the decoded text). Rows stop at the model's
    eos ids unless `ignore_eos` (`with_eos`), and never pick an id past the tokenizer (`with_vocab_limit`).
    Each row's result is the same as generating it alone (greedy tokens identical, logits equal to
    float tolerance).
    """
    config = with_vocab_limit(with_eos(make_config(config, **controls), model, tokenizer), model, tokenizer)
    if config.stop_strings and tokenizer is None:
        raise ValueError("stop strings are matched on text, so they need a tokenizer")
    results = [Generation(logprobs=[] if config.logprobs else None) for _ in prompts]
    done = [False] * len(prompts)
    stop_tokens = set(config.stop_tokens)
    if config.max_new_tokens > 0:
        for step in decode_steps(model, prompts, config):
            step_logprobs = step.logprobs.tolist() if step.logprobs is not None else None
            for i, token in enumerate(step.tokens.tolist()):
                if done[i]:
                    continue
                if token in stop_tokens:
                    done[i], results[i].finish_reason = True, "stop_token"
                    continue
                results[i].tokens.append(token)
                if step_logprobs is not None:
                    results[i].logprobs.append(step_logprobs[i])
                if config.stop_strings and find_stop(tokenizer.decode(results[i].tokens), config.stop_strings) >= 0:
                    done[i], results[i].finish_reason = True, "stop_string"
            if all(done):
                break
    if tokenizer is not None:
        for result in results:
            text = tokenizer.decode(result.tokens)
            cut = find_stop(text, config.stop_strings)
            result.text = text if cut < 0 else text[:cut]
    return results


def generate_tokens(
    model: TransformerLM, prompt: Sequence[int], max_new_tokens: int | None = None,
    temperature: float | None = None, top_k: int | None = None, top_p: float | None = None,
    seed: int | None = None, stop_tokens: Sequence[int] = (), config: GenerationConfig | None = None,
    **controls: Any,
) -> Iterator[int]:
    """Yield new token ids one at a time as they are produced (for streaming); stops before a stop
    token or one of the model's eos ids (unless `ignore_eos`; see `with_eos`).

    Keyword controls override `config`; see `GenerationConfig` for all of them.
    """
    given = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    controls.update({k: v for k, v in given.items() if v is not None})
    if stop_tokens:
        controls["stop_tokens"] = stop_tokens
    config = with_eos(make_config(config, **controls), model)
    stops = set(config.stop_tokens)
    if config.max_new_tokens == 0:
        return
    for step in decode_steps(model, [prompt], config):
        token = int(step.tokens[0])
        if token in stops:
            return
        yield token


# --- speed ---------------------------------------------------------------------------------------

def optimize_for_decoding(model: TransformerLM) -> TransformerLM:
    """Re-lay float32 matrices on CPU column-major ((d_in, d_out) in memory) for one-token steps.

    Values, shapes and the parameters' identity are unchanged; only strides change, so training,
    saving and loading work as before. Why: decoding one token multiplies a vector by every weight
    matrix, which is bound by how fast memory streams the weights. For float32, MKL's
    vector-matrix kernel streams an (in, out) layout about twice as fast as the (out, in) one on the
    CPUs measured (see docs/generation.md). bfloat16 kernels prefer the usual layout: left alone.
    """
    for module in model.modules():
        weights = []
        if isinstance(module, Linear):
            weights.append(module.weight)
        if module is model.embed and model.unembed is None:
            weights.append(module.weight)  # the tied unembedding: the largest matrix of all
        for weight in weights:
            if weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.is_contiguous():
                weight.data = weight.data.T.contiguous().T
    return model
