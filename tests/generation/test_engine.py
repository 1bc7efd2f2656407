"""DecodeWindow's rows joining and leaving, and the batching Engine without HTTP, against decoding each prompt alone."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest
import torch

from glasslm.core.model import TransformerLM
from glasslm.generation import DecodeWindow, Engine, Job, Overloaded, Sampling, generate_tokens
from glasslm.presets import get_preset
from glasslm.tokenizers import CharTokenizer

SRC = Path(__file__).resolve().parents[2] / "src" / "glasslm"


@pytest.fixture(scope="module")
def model() -> TransformerLM:
    torch.manual_seed(0)
    return TransformerLM(get_preset("llama-tiny", vocab_size=37, context_length=24)).eval()


def alone(model: TransformerLM, prompt: list[int]) -> torch.Tensor:
    """Next-token logits of `prompt` decoded by itself, without a cache: the reference."""
    with torch.inference_mode():
        return model(torch.tensor([prompt]))[0, -1].float()


def test_rows_that_join_and_leave_decode_as_they_would_alone(model):
    prompts = [[1, 2, 3, 4, 5], [6], [7, 8, 9]]
    with torch.inference_mode():
        window = DecodeWindow(model, 2, 24)
        logits = window.prefill(prompts[:2])
        feed = [11, 12]
        logits = window.decode(torch.tensor(feed))
        prompts[0].append(11), prompts[1].append(12)
        newcomer = DecodeWindow(model, 1, 24)
        logits = torch.cat([logits, newcomer.prefill([prompts[2]])])
        window.extend(newcomer)  # a 3-token row joins rows holding 6 and 2 tokens
        assert window.rows == 3 and window.pads.tolist() == [0, 4, 3]
        for i, prompt in enumerate(prompts):
            torch.testing.assert_close(logits[i], alone(model, prompt), atol=1e-4, rtol=1e-4)
        window.keep_rows([2, 1])  # the longest row leaves: the padding both others had goes too
        assert window.pads.tolist() == [0, 1] and window.cache.length == 3
        logits = window.decode(torch.tensor([13, 14]))
    torch.testing.assert_close(logits[0], alone(model, prompts[2] + [13]), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits[1], alone(model, prompts[1] + [14]), atol=1e-4, rtol=1e-4)


def test_windows_of_different_sizes_join_and_grow(model):
    with torch.inference_mode():
        small, large = DecodeWindow(model, 1, 8), DecodeWindow(model, 1, 24)
        small.prefill([[1, 2, 3]]), large.prefill([[4, 5]])
        small.extend(large)  # the joined window has the larger one's slots
        assert small.cache.max_length == 24 and small.pads.tolist() == [0, 1]
        small.grow(32)
        assert small.cache.max_length == 32 and small.cache.keys[0].shape[2] == 32
        logits = small.decode(torch.tensor([6, 7]))
    torch.testing.assert_close(logits[0], alone(model, [1, 2, 3, 6]), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits[1], alone(model, [4, 5, 7]), atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="at least one row"):
        DecodeWindow(model, 1, 24).keep_rows([])
    with pytest.raises(ValueError, match="cannot shrink"):
        small.grow(2)


async def _run(engine: Engine, tok: CharTokenizer, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    loop = asyncio.get_running_loop()

    async def one(prompt: list[int], delay: float) -> list[int]:
        await asyncio.sleep(delay)  # later jobs join a batch already decoding
        job = Job(prompt, Sampling(max_tokens=max_tokens, temperature=0.0), tok, loop)
        engine.submit(job)
        tokens = []
        while "finish_reason" not in (event := await job.events.get()):
            tokens.append(event["token"])
        return tokens

    return await asyncio.gather(*(one(p, 0.02 * i) for i, p in enumerate(prompts)))


def test_engine_rows_equal_greedy_decoding_alone_past_the_context(model):
    tok = CharTokenizer.from_text("".join(chr(ord("A") + i) for i in range(37)))
    prompts = [[1, 2, 3], list(range(4, 20)), [5], [6, 7, 8, 9, 10, 11]]
    engine = Engine(model, tok, max_batch=3, max_queue=4)  # one job waits for a free row
    engine.start()
    try:
        got = asyncio.run(_run(engine, tok, prompts, max_tokens=30))  # past context_length 24: windows slide
    finally:
        engine.stop()
    for prompt, tokens in zip(prompts, got):
        assert tokens == list(generate_tokens(model, prompt, max_new_tokens=30, temperature=0.0))
    assert engine.stats["largest_batch"] >= 2 and engine.stats["completed"] == len(prompts)


def test_engine_refuses_work_beyond_its_queue(model):
    tok = CharTokenizer.from_text("ab")
    engine = Engine(model, tok, max_batch=1, max_queue=1)  # not started: nothing leaves the queue

    async def submit_three() -> None:
        loop = asyncio.get_running_loop()
        for _ in range(2):  # one for the free row, one for the queue
            engine.submit(Job([1], Sampling(max_tokens=1), tok, loop))
        with pytest.raises(Overloaded, match="retry later"):
            engine.submit(Job([1], Sampling(max_tokens=1), tok, loop))

    asyncio.run(submit_three())
    assert engine.stats["rejected"] == 1


def test_only_decoding_touches_the_window_and_cache_internals():
    """The engine and the server work through DecodeWindow's public methods, not its insides."""
    internals = re.compile(r"\b_Window\b|\bkey_is_real\b|\.cache\.(keys|values)\b|\._set_pads\b")
    offenders = [str(path.relative_to(SRC)) for path in SRC.rglob("*.py")
                 if path.name != "decoding.py" and internals.search(path.read_text())]
    assert offenders == []
