"""Constrained decoding (generation.constrained, llguidance): the mask against a brute-force reference over
an enumerable language, every sampled answer valid under its schema (checked by pydantic and json), and the
unconstrained rows of the same batch decoding exactly as they do alone."""

from __future__ import annotations

import asyncio
import json
import random
from typing import Literal

import pytest
import torch

pytest.importorskip("llguidance")

from pydantic import BaseModel, ConfigDict, Field  # noqa: E402

from glasslm.core.model import TransformerLM  # noqa: E402
from glasslm.generation import Engine, GenerationConfig, Job, Sampling, generate  # noqa: E402
from glasslm.generation.constrained import GrammarError, Grammars  # noqa: E402
from glasslm.presets import get_preset  # noqa: E402
from glasslm.tokenizers import CharTokenizer  # noqa: E402

CHARS = '{}[]":, -.0123456789abcdefghijklmnopqrstuvwxyz'
WORDS = ["ab", "abba", "ba", "b", "abc"]


@pytest.fixture(scope="module")
def tok() -> CharTokenizer:
    return CharTokenizer.from_text(CHARS)


@pytest.fixture(scope="module")
def grammars(tok) -> Grammars:
    return Grammars(tok, tok.vocab_size + 3, [tok.special_tokens["<|endoftext|>"]])  # 3 padding rows


@pytest.fixture(scope="module")
def model(tok) -> TransformerLM:
    torch.manual_seed(0)
    model = TransformerLM(get_preset("llama-tiny", vocab_size=tok.vocab_size + 3, context_length=128)).eval()
    with torch.no_grad():  # a perturbed, not an initial, model: some tokens far likelier than others
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    return model


def test_the_mask_is_exactly_the_tokens_that_keep_a_word_of_the_language_reachable(tok, grammars):
    # The JSON schema's language is the five quoted words: enumerable, so the mask has a brute-force reference.
    language = [json.dumps(w) for w in WORDS]
    eos = tok.special_tokens["<|endoftext|>"]
    rng = random.Random(0)
    for _ in range(20):
        target = rng.choice(language)
        matcher = grammars.json_schema({"enum": WORDS}).matcher()
        for cut in range(len(target) + 1):
            prefix = target[:cut]
            allowed = set(matcher.allowed().nonzero()[:, 0].tolist())
            expected = {i for i in range(tok.vocab_size) if i != eos and any(
                w.startswith(prefix + tok.decode([i])) for w in language)}
            if prefix in language:
                expected.add(eos)
            assert allowed == expected, prefix
            assert not allowed & {tok.vocab_size, tok.vocab_size + 1, tok.vocab_size + 2}  # padding rows never
            if cut < len(target):
                matcher.accept(tok.encode(target[cut])[0])
        assert matcher.done == (not any(w != target and w.startswith(target) for w in language))


class Item(BaseModel):  # every value bounded, so a random model's answer ends within max_tokens
    model_config = ConfigDict(extra="forbid")  # additionalProperties: false, as OpenAI's strict schemas
    name: str = Field(max_length=8)
    count: int = Field(ge=-99, le=999)
    tags: list[Literal["red", "green", "blue"]] = Field(max_length=2)
    size: Literal["s", "m"] | None
    ok: bool


async def _complete(engine: Engine, tok, jobs: list[Job]) -> list[list[int]]:
    engine.submit_all(jobs)
    out = []
    for job in jobs:
        tokens = []
        while "finish_reason" not in (event := await job.events.get()):
            assert "error" not in event, event
            tokens.append(event["token"])
        out.append((tokens, event["finish_reason"]))
    return out


def test_every_sampled_answer_is_valid_under_its_schema_and_free_rows_are_unchanged(model, tok, grammars):
    grammar = grammars.json_schema(Item.model_json_schema())
    prompt = tok.encode("item: ")
    eos = frozenset({tok.special_tokens["<|endoftext|>"]})
    engine = Engine(model, tok, max_batch=8, max_queue=64)
    engine.start()
    try:
        async def run():
            loop = asyncio.get_running_loop()
            constrained = [Job(prompt, Sampling(max_tokens=110, temperature=1.0, seed=s, grammar=grammar), tok, loop,
                               stop_tokens=eos) for s in range(24)]
            free = [Job(prompt, Sampling(max_tokens=12, temperature=1.0, seed=s), tok, loop, stop_tokens=eos)
                    for s in range(4)]
            return await _complete(engine, tok, constrained + free)
        results = asyncio.run(run())
    finally:
        engine.stop()
    for tokens, finish in results[:24]:
        assert finish == "stop", tok.decode(tokens)
        Item.model_validate_json(tok.decode(tokens))  # raises if the text is not a valid Item
    assert len({tok.decode(t) for t, _ in results[:24]}) > 12  # sampled, not one answer
    for s, (tokens, _) in enumerate(results[24:]):  # the free rows of the same batches: as decoded alone
        alone = generate(model, [prompt], GenerationConfig(max_new_tokens=12, temperature=1.0, seed=s), tokenizer=tok)
        assert tokens == alone[0].tokens


def test_malformed_schemas_and_unsupported_features_are_named(grammars):
    for schema, words in (({"type": "no-such-type"}, "no-such-type"), ({"type": "string", "format": "weird"}, "weird"),
                          ({"$ref": "#/$defs/missing"}, "missing"),
                          ({"type": "string", "pattern": "(?<=a)b"}, "look")):
        with pytest.raises(GrammarError, match=words):
            grammars.json_schema(schema)
    with pytest.raises(GrammarError):
        grammars.lark("start: undefined_rule")
