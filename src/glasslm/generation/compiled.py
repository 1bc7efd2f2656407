"""Compiled decoding: the one-token step traced once by `torch.compile` and replayed, gpt-fast style.

An eager decoding step of a small model spends a large share of its time outside the matmuls:
Python, module calls and a few dozen small operators per layer, each a separate kernel launch
(benchmarks/bench_llamacpp.py --profile). Compiling the step fuses the small operators into a few
generated loops and runs the whole step as one call. A compiled step must see the same shapes and no
changing Python numbers every time, so it decodes into an `attention.StaticKVCache` (slots addressed
by a positions tensor) rather than the cursor cache, and only rows of one length (no padding mask).

The first steps pay for compiling (seconds to a minute; PyTorch keeps compiled code on disk, so a
second process with the same model shapes is much quicker), so compiling pays off over long
generations, the same model used again, or a server's lifetime, not for a few dozen tokens.

Example:
    >>> from glasslm.presets import get_preset
    >>> from glasslm.core.model import TransformerLM
    >>> model = TransformerLM(get_preset("llama-tiny", n_layers=1)).eval()
    >>> window = StaticDecodeWindow(model, batch=1, max_length=12)
    >>> window.cache.max_length  # slots are rounded up, so nearby lengths share one compiled step
    64
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from jaxtyping import Float, Int
from torch import Tensor

from glasslm.core.model import TransformerLM
from glasslm.generation.cpu import low_precision_cpu, onednn_disabled

# Slot counts are rounded up to a multiple of this, so generations of nearby lengths reuse one
# compiled step (each distinct count is a separate compile); attention reads every slot, so the
# rounding costs a little per step.
SLOT_MULTIPLE = 64


def compiled_step(model: TransformerLM) -> torch.nn.Module:
    """`model` compiled for decoding steps (made once per model and kept on it).

    Layers that make something on first use (a quantized layer's packed weight) make it now, outside
    the graph, through their `prepare_for_compile` method; that runs on every call, so weights loaded
    since the last call are re-packed (the compiled step then retraces).
    """
    for module in model.modules():
        prepare = getattr(module, "prepare_for_compile", None)
        if prepare is not None:
            prepare()
    step = model.__dict__.get("_compiled_decoding_step")
    if step is None:
        started = time.perf_counter()
        step = torch.compile(model, dynamic=False)  # the first call in a process loads the compiler (seconds)
        _charge_clocks(time.perf_counter() - started)
        # Set past nn.Module's __setattr__: a submodule would put the wrapper in the state dict.
        object.__setattr__(model, "_compiled_decoding_step", step)
    return step


# New tokens after which a compiled step has paid for its compiling, by model size (parameters):
# compile seconds / seconds saved per token, with PyTorch's compile cache warm (the first compile
# on a machine costs several times more); None where the compiled step was not faster per token.
# Measured by benchmarks/bench_compile.py (one thread, batch 1, float32) on the shared 2-core AMD
# EPYC: docs/generation.md, "When --compile pays off".
BREAK_EVEN_TOKENS: tuple[tuple[int, int | None], ...] = ((787_712, 3_517), (10_745_088, None), (124_439_808, None))


def compile_break_even(n_parameters: int) -> int | None:
    """New tokens after which compiling a model of `n_parameters` pays for itself (warm cache): the
    figure of the nearest measured size (BREAK_EVEN_TOKENS, nearest in log parameters); None where
    compiling never pays.

    Example:
        >>> compile_break_even(800_000), compile_break_even(7_000_000), compile_break_even(350_000_000)
        (3517, None, None)
    """
    return min(BREAK_EVEN_TOKENS, key=lambda size: abs(math.log(max(n_parameters, 1) / size[0])))[1]


def compile_advice(n_parameters: int, new_tokens: int) -> str | None:
    """One line advising to drop --compile when `new_tokens` are too few to win the compiling back
    (`compile_break_even`); None when compiling should pay off."""
    tokens = compile_break_even(n_parameters)
    if tokens is not None and new_tokens >= tokens:
        return None
    size = f"a compiled step of a {n_parameters / 1e6:.1f}M-parameter model"
    why = (f"{size} was no faster per token than the eager one" if tokens is None else
           f"{size} wins its compiling back after about {tokens:,} new tokens (with PyTorch's compile cache warm)"
           f" and --max-new-tokens is {new_tokens:,}")
    return (f"note: --compile will not pay off here: {why} (measured: docs/generation.md, \"When --compile pays "
            "off\"); without --compile this finishes sooner (compiling anyway, as asked)")


@dataclass
class CompileClock:
    """Seconds spent compiling (`compile_clock`): what a compiled decode spends before its steps run."""

    seconds: float = 0.0
    compiles: int = 0  # compilations finished (each new shape or recompile is one)


_RUNNING_CLOCKS: list[CompileClock] = []


def _charge_clocks(seconds: float) -> None:
    for clock in _RUNNING_CLOCKS:
        clock.seconds += seconds


@contextmanager
def compile_clock() -> Iterator[CompileClock]:
    """Count the time spent compiling while the block runs, so that a decoding speed can leave it
    out: loading the compiler (importing Dynamo, `torch.compile` itself: seconds, once a process),
    then each compilation, Dynamo's tracing and Inductor's code generation (through Dynamo's
    compile callbacks).

    Example:
        >>> with compile_clock() as clock:
        ...     pass
        >>> clock.compiles
        0
    """
    started = time.perf_counter()
    from torch._dynamo.callback import callback_handler

    clock, compiling = CompileClock(), []
    _RUNNING_CLOCKS.append(clock)
    _charge_clocks(time.perf_counter() - started)

    def start(_: object) -> None:
        compiling.append(time.perf_counter())

    def end(_: object) -> None:
        if compiling:
            clock.seconds += time.perf_counter() - compiling.pop()
            clock.compiles += 1

    callback_handler.register_start_callback(start)
    callback_handler.register_end_callback(end)
    try:
        yield clock
    finally:
        callback_handler.remove_start_callback(start)
        callback_handler.remove_end_callback(end)
        _RUNNING_CLOCKS.remove(clock)


class StaticDecodeWindow:
    """What `decoding.DecodeWindow` does for rows of one length, with a compiled one-token step.

    Prefill runs eagerly (its length varies); each decode step runs the compiled model on one token per
    row at one shared position. Sliding past the context works as in `DecodeWindow`: `full` turns true
    when the last slot is written, and the caller re-prefills the rows' last tokens.
    """

    def __init__(self, model: TransformerLM, batch: int, max_length: int):
        self.model = model
        self.device = model.embed.device
        slots = min(model.config.context_length, -(-max_length // SLOT_MULTIPLE) * SLOT_MULTIPLE)
        # bf16 weights on a CPU: float32 keys and values, and one-row steps off oneDNN (generation.cpu).
        low_precision = low_precision_cpu(model.embed)
        self.cache = model.new_static_kv_cache(batch, slots, dtype=torch.float32 if low_precision else None)
        self.native_gemv = low_precision and batch == 1
        self.step = compiled_step(model)
        self.position = 0  # the next token's position, the same for every row

    @property
    def full(self) -> bool:
        """True once the step's position would be past the last slot: the next token needs a re-prefill."""
        return self.position >= self.cache.max_length

    def prefill(self, rows: Sequence[Sequence[int]]) -> Float[Tensor, "batch vocab"]:
        """Run the rows (all of one length) from position 0; each row's next-token logits."""
        if len({len(r) for r in rows}) != 1:
            raise ValueError("a StaticDecodeWindow decodes rows of one length; use DecodeWindow for ragged batches")
        tokens = torch.tensor([list(r) for r in rows], dtype=torch.long, device=self.device)  # (batch, seq)
        positions = torch.arange(tokens.shape[1], device=self.device)  # (seq,)
        logits = self.model(tokens, positions, self.cache, last_logits_only=True)  # (batch, 1, vocab)
        self.position = tokens.shape[1]
        return logits[:, -1].float()

    def decode(self, tokens: Int[Tensor, "batch"]) -> Float[Tensor, "batch vocab"]:
        """Feed one new token per row through the compiled step; its keys and values land in slot `position`."""
        positions = torch.tensor([self.position], device=self.device)  # (1,): a tensor, so no retrace per step
        # (The oneDNN switch holds while the step is first compiled too, so the kernels chosen then match.)
        try:
            with onednn_disabled(self.native_gemv):
                logits = self.step(tokens[:, None], positions=positions, kv_cache=self.cache)  # (batch, 1, vocab)
        except torch._dynamo.exc.BackendCompilerFailed as err:  # e.g. no C++ compiler for Inductor's CPU code
            inner = err.inner_exception
            lines = [line for line in str(inner).splitlines() if line.strip()]
            reason = f"{type(inner).__name__}: {lines[0].strip() if lines else ''}"
            raise RuntimeError(f"compiling the decoding step failed ({reason}); decode without --compile "
                               "(compile=False), or install what the message names") from err
        self.position += 1
        return logits[:, -1].float()
