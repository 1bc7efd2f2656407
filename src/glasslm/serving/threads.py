"""How many threads a server decodes on: measured on this machine at start-up, not assumed.

A served step runs on the engine's thread, not on the main thread that loaded the model, and shares
the CPU with the event loop that streams its tokens. The first cost 5x: the main thread's idle
OpenMP workers left GNU OpenMP managing more threads than cores, so it stopped spinning between
parallel regions and every step waited on sleeping workers (one SmolLM2 stream on 2 threads: 50
tokens/s served, 264 in `glasslm generate`); `Engine.start` now lets them go
(`runtime.release_openmp_threads`) and the served stream runs at 250. What is left depends on the
CPU, the model and what else runs, so `fastest_threads` times the real thing: the engine decoding
one stream while an event loop on another thread takes each token and encodes it as the server
would, for each candidate count in turn (interleaved rounds, the median of each), and keeps the
fastest.

Example:
    >>> from glasslm.presets import get_preset
    >>> from glasslm.core.model import TransformerLM
    >>> from glasslm.tokenizers import CharTokenizer
    >>> tok = CharTokenizer.from_text("abc\\n")
    >>> model = TransformerLM(get_preset("shakespeare-char-cpu", vocab_size=tok.vocab_size, n_layers=1)).eval()
    >>> best, rates = fastest_threads(model, tok, candidates=(1,), tokens=4, rounds=1)
    >>> best, sorted(rates)
    (1, [1])
"""

from __future__ import annotations

import asyncio
import json
import statistics
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch

from glasslm.generation.engine import Engine, Job, Sampling


def served_rate(model: Any, tokenizer: Any, threads: int, tokens: int = 48) -> float:
    """Tokens per second of one stream through the engine on `threads` threads, its events taken and
    encoded by an event loop on another thread (as a server's), from the first token to the last."""
    torch.set_num_threads(threads)
    engine = Engine(model, tokenizer, max_batch=1, max_queue=1)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    engine.start()
    try:
        async def stream() -> list[float]:
            job = Job(list(range(min(8, model.config.vocab_size))), Sampling(max_tokens=tokens, temperature=0.0),
                      tokenizer, asyncio.get_running_loop())
            engine.submit(job)
            times = []
            while "finish_reason" not in (event := await job.events.get()):
                json.dumps({"choices": [{"text": event["text"], "index": 0}]})  # what an SSE chunk costs
                times.append(time.perf_counter())
            return times
        times = asyncio.run_coroutine_threadsafe(stream(), loop).result(timeout=600)
    finally:
        engine.stop()
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
    return (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 else 0.0


def fastest_threads(model: Any, tokenizer: Any, candidates: Sequence[int], tokens: int = 48,
                    rounds: int = 3) -> tuple[int, dict[int, float]]:
    """(the fastest thread count, {count: median served tokens/s}), candidates measured in turn."""
    rates: dict[int, list[float]] = {n: [] for n in candidates}
    previous = torch.get_num_threads()
    try:
        with torch.inference_mode():
            served_rate(model, tokenizer, max(candidates), 4)  # warm up: the kernels, the allocator
            for _ in range(rounds):
                for n in candidates:
                    rates[n].append(served_rate(model, tokenizer, n, tokens))
    finally:
        torch.set_num_threads(previous)
    medians = {n: statistics.median(r) for n, r in rates.items()}
    return max(medians, key=medians.get), medians
