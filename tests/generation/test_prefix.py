"""Prefix caching and chunked prefill in the engine (generation.prefix): a conversation's next turn and prompts
sharing a system prompt reuse cached keys and values and decode exactly the tokens they decode without the
cache and alone (`generate`), greedy and seeded; long prompts prefilled a chunk at a time beside running rows
change nothing either; the cache stays within its budget, evicting the least recently used blocks first."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

from glasslm.core.model import TransformerLM
from glasslm.generation import Engine, GenerationConfig, Job, Sampling, generate
from glasslm.generation.engine import CHUNK
from glasslm.generation.prefix import PrefixCache
from glasslm.presets import get_preset
from glasslm.tokenizers import CharTokenizer

VOCAB = 40


@pytest.fixture(scope="module")
def model() -> TransformerLM:
    torch.manual_seed(1)
    model = TransformerLM(get_preset("llama-tiny", vocab_size=VOCAB, context_length=1024)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model


@pytest.fixture(scope="module")
def tok() -> CharTokenizer:
    return CharTokenizer([chr(ord("0") + i) for i in range(VOCAB)])


def alone(model, tok, prompt: list[int], n: int, **controls) -> list[int]:
    return generate(model, [prompt], GenerationConfig(max_new_tokens=n, **controls), tokenizer=tok)[0].tokens


def run(engine: Engine, tok, batches: list[list[tuple[list[int], Sampling]]]) -> list[list[int]]:
    """Each batch of (prompt, sampling) submitted together once the previous batch has finished."""
    async def go():
        loop, out = asyncio.get_running_loop(), []
        for batch in batches:
            jobs = [Job(prompt, sampling, tok, loop) for prompt, sampling in batch]
            engine.submit_all(jobs)
            for job in jobs:
                tokens = []
                while "finish_reason" not in (event := await job.events.get()):
                    tokens.append(event["token"])
                out.append(tokens)
        return out
    engine.start()
    try:
        return asyncio.run(go())
    finally:
        engine.stop()


def test_the_next_turn_reuses_the_conversation_and_decodes_what_it_would_without(model, tok):
    rng = random.Random(0)
    system = [rng.randrange(VOCAB) for _ in range(300)]
    first = system + [rng.randrange(VOCAB) for _ in range(40)]
    answer = alone(model, tok, first, 30, temperature=0.0)
    second = first + answer + [rng.randrange(VOCAB) for _ in range(25)]  # the whole conversation, then a new turn
    other = system + [rng.randrange(VOCAB) for _ in range(33)]  # another user, the same system prompt
    turns = [[(first, Sampling(max_tokens=30, temperature=0.0))],
             [(second, Sampling(max_tokens=20, temperature=0.0)), (other, Sampling(max_tokens=20, seed=5))]]
    cached = Engine(model, tok, max_batch=4, prefix_cache_bytes=64 << 20)
    plain = Engine(model, tok, max_batch=4)
    with_cache, without = run(cached, tok, turns), run(plain, tok, turns)
    assert with_cache == without
    assert with_cache == [answer, alone(model, tok, second, 20, temperature=0.0),
                          alone(model, tok, other, 20, temperature=1.0, seed=5)]
    block = cached.prefix_cache.block
    # the second turn found the first turn's prompt and answer, the other user the system prompt
    found = (len(first) + len(answer) - 1) // block * block + len(system) // block * block
    assert cached.prefix_cache.stats["hit_tokens"] == found
    assert cached.stats["prompt_tokens"] == plain.stats["prompt_tokens"] - found  # only the rest was prefilled


def test_long_prompts_prefill_a_chunk_at_a_time_beside_running_rows(model, tok):
    rng = random.Random(1)
    short = [rng.randrange(VOCAB) for _ in range(10)]
    long = [rng.randrange(VOCAB) for _ in range(3 * CHUNK + 17)]
    engine = Engine(model, tok, max_batch=4)
    first_tokens = {}
    engine.listeners.append(lambda job: first_tokens.update({len(job.prompt): job.first_token_time}))
    out = run(engine, tok, [[(short, Sampling(max_tokens=40, temperature=0.0)),
                             (long, Sampling(max_tokens=8, seed=3))]])
    assert out == [alone(model, tok, short, 40, temperature=0.0), alone(model, tok, long, 8, seed=3)]
    assert engine.stats["prompt_tokens"] == len(short) + len(long)
    # the short prompt's tokens began while the long one was still going in (admitted together, they
    # would have had their first tokens from the same step)
    assert first_tokens[len(short)] < first_tokens[len(long)]


def test_the_cache_stays_within_its_budget_and_evicts_the_least_recently_used():
    d = torch.zeros(2, 64, 4)  # one layer: (kv_heads, tokens, d_head)
    block_bytes = 2 * 2 * 8 * 4 * 4  # keys and values, 2 heads x 8 tokens x 4 dims of float32
    cache = PrefixCache(budget_bytes=5 * block_bytes, block=8)
    a, b = list(range(24)), [100 + i for i in range(24)]
    cache.insert(a, [d], [d + 1])
    cache.insert(b, [d + 2], [d + 3])  # 6 blocks: the oldest (a's first) goes
    assert cache.bytes == 5 * block_bytes and cache.stats["evicted_blocks"] == 1
    assert cache.cached(a + [0]) == 0  # its first block is gone, so nothing of a is found
    n, keys, values = cache.lookup(b + [0])
    assert n == 24 and torch.equal(keys[0], d[:, :24] + 2) and torch.equal(values[0], d[:, :24] + 3)
    cache.insert([7] * 16, [d], [d])  # b was just used: a's remaining blocks go first
    assert cache.cached(b + [0]) == 24 and cache.bytes <= 5 * block_bytes
    assert PrefixCache(0).lookup(a)[0] == 0
