"""The request and response shapes of `glasslm serve`: OpenAI's completions API and the explorer's.

Requests are pydantic models that refuse unknown fields, so a typo ("max_token") is an error
rather than a silently ignored setting (as OpenAI does), and values of the wrong JSON type rather
than coercing them (`"max_tokens": true`). OpenAI fields that would change results and that glasslm
does not implement (frequency and presence penalties, suffix, best_of > n) are accepted only at
their neutral values, so clients that send the defaults explicitly still work. `Completion` at the
end turns a request's job events into OpenAI's response shapes. Needs the `serve` extra (fastapi, uvicorn).

Example:
    >>> request = CompletionRequest(prompt="ROMEO:", max_tokens=8, top_k=5, seed=3, logit_bias={"7": -5})
    >>> sampling = request.choice_sampling(1)  # the second choice: seeded 3 + 1
    >>> sampling.max_tokens, sampling.top_k, sampling.seed, sampling.logit_bias
    (8, 5, 4, ((7, -5.0),))
    >>> CompletionRequest(max_token=8)
    Traceback (most recent call last):
    ...
    pydantic_core._pydantic_core.ValidationError: 1 validation error for CompletionRequest
    ...
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from glasslm.generation.engine import Job, Sampling


class BadRequest(ValueError):
    """A request the server understood but cannot serve (HTTP 400 with this message)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class UnknownModel(BadRequest):
    """A request for a model this server does not serve (HTTP 404)."""


class _Strict(BaseModel):
    # strict: a value of the wrong JSON type is refused, never coerced ("max_tokens": true, "stream": "yes")
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


def finite_number(v: float) -> float:
    """A field validator: inf and nan are refused."""
    if not math.isfinite(v):
        raise ValueError("must be a finite number")
    return v


def stop_strings(v: str | list[str] | None) -> list[str]:
    """A field validator: `stop` as a list of at most 8 non-empty strings."""
    stops = [v] if isinstance(v, str) else list(v or [])
    if len(stops) > 8 or any(not s for s in stops):
        raise ValueError("give at most 8 stop strings, none empty")
    return stops


SEED_LIMIT = 2**63 - 1  # a seed is a signed 64-bit number (choice i of n draws with seed + i, still < 2**64)
BIAS_LIMIT = 100.0  # |logit_bias| at most this, as OpenAI's


class SamplingFields(_Strict):
    """The fields completions and chat share: which model, how a token is picked, when a choice stops.

    OpenAI's controls, vLLM's extensions (`top_k`, `min_p`, `ignore_eos`, `repetition_penalty`,
    `min_tokens`, `stop_token_ids`, `skip_special_tokens`, `include_stop_str_in_output`), and the
    penalties glasslm does not implement, accepted only at their neutral value 0. What depends on
    the served model (ids in the vocabulary, the server's token limit) is `Served.check`'s.
    """

    model: str | None = None
    temperature: float = Field(1.0, ge=0.0)  # 0 (or under 1.2e-38): greedy
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)  # 0: off
    min_p: float = Field(0.0, ge=0.0, le=1.0)  # 0: off
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, le=SEED_LIMIT)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=64)  # choices per prompt, choice i seeded seed + i
    user: str | None = None  # accepted and ignored, as it changes nothing
    logit_bias: dict[str, float] | None = None  # token id (as text) -> added to its logit, -100..100
    frequency_penalty: float = 0.0  # only 0: not implemented
    presence_penalty: float = 0.0  # only 0: not implemented
    ignore_eos: bool = False  # go on past the model's end-of-sequence tokens
    repetition_penalty: float = Field(1.0, gt=0.0, le=100.0)  # > 1 discourages tokens of the prompt and output
    min_tokens: int = Field(0, ge=0)  # eos and stop_token_ids cannot end a choice before this many tokens
    stop_token_ids: list[int] | None = None  # more tokens that end a choice (as eos does)
    skip_special_tokens: bool = False  # leave the special tokens' text out of the output
    include_stop_str_in_output: bool = False  # keep the stop string that ended a choice

    _finite = field_validator("temperature")(finite_number)
    _stops = field_validator("stop")(stop_strings)

    @field_validator("frequency_penalty", "presence_penalty")
    @classmethod
    def _neutral(cls, v: float) -> float:
        if v != 0.0:  # nan too
            raise ValueError("not supported by glasslm serve (leave it out, or at 0)")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for key, value in (v or {}).items():
            if not (key.isascii() and key.isdigit() and len(key) <= 18):
                shown = key if len(key) <= 20 else key[:20] + "..."
                raise ValueError(f"keys are token ids written as decimal text, got {shown!r}")
            if not -BIAS_LIMIT <= value <= BIAS_LIMIT:  # nan too
                raise ValueError(f"values are in [-{BIAS_LIMIT:g}, {BIAS_LIMIT:g}], got {value} for {key}")
        return v

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_ids(cls, v: list[int] | None) -> list[int] | None:
        if v is not None and any(t < 0 for t in v):
            raise ValueError("token ids are >= 0")
        return v

    @field_validator("min_tokens")
    @classmethod
    def _min_tokens(cls, v: int, info: ValidationInfo) -> int:
        if v and info.data.get("stop"):
            raise ValueError("min_tokens with stop strings is not supported (give one of them)")
        return v

    def alternatives(self) -> tuple[str, int | None]:
        """(field, how many likeliest tokens each token lists), or None where log-probabilities are not asked."""
        return "logprobs", None

    def asked_tokens(self) -> tuple[str, int | None]:
        """(field, the most tokens a choice may have), None where the request leaves it to the server."""
        return "max_tokens", None

    def stop_tokens(self, eos: frozenset[int]) -> frozenset[int]:
        """The ids that end a choice: the model's eos (unless `ignore_eos`) and `stop_token_ids`."""
        return (frozenset() if self.ignore_eos else eos) | frozenset(self.stop_token_ids or ())

    def sampling(self, max_tokens: int, choice: int = 0, logprobs: int | None = None,
                 prompt_logprobs: int | None = None, grammar: Any = None) -> Sampling:
        """The engine's controls for choice number `choice` (seeded `seed + choice`), decoding under
        `grammar` (a `generation.constrained.Grammar`) if one is given."""
        if self.min_tokens > max_tokens:
            raise BadRequest(f"min_tokens: {self.min_tokens} is more than the {max_tokens} tokens a choice may have",
                             "min_tokens")
        return Sampling(
            max_tokens=max_tokens, temperature=self.temperature, top_k=self.top_k or None,
            top_p=self.top_p if self.top_p < 1.0 else None, min_p=self.min_p or None,
            seed=None if self.seed is None else self.seed + choice, stop=tuple(self.stop or ()),
            logprobs=logprobs, prompt_logprobs=prompt_logprobs, repetition_penalty=self.repetition_penalty,
            logit_bias=tuple(sorted((int(k), v) for k, v in (self.logit_bias or {}).items())),
            min_tokens=self.min_tokens, include_stop=self.include_stop_str_in_output, grammar=grammar,
        )


class CompletionRequest(SamplingFields):
    """OpenAI's POST /v1/completions body, with `SamplingFields`' extensions and `return_token_ids`.

    `prompt` is a string, a list of strings, a list of token ids or a list of id lists; every prompt
    gets `n` choices, all decoded in the same batch. `echo` puts the prompt before each choice's
    text (with `logprobs`, each prompt token's log-probability too); `max_tokens: 0` only scores.
    """

    prompt: str | list[str] | list[int] | list[list[int]] = ""
    max_tokens: int = Field(16, ge=0)  # OpenAI's default
    logprobs: int | None = Field(None, ge=0, le=20)
    return_token_ids: bool = False  # each choice also carries the generated token ids
    echo: bool = False
    # OpenAI fields accepted only at the value that means "not used" (others would change results):
    best_of: int | None = Field(None, ge=1)
    suffix: str | None = None

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v: str | None) -> str | None:
        if v:
            raise ValueError("not supported by glasslm serve (leave it out, or at null)")
        return v

    @field_validator("best_of")
    @classmethod
    def _best_of(cls, v: int | None, info: ValidationInfo) -> int | None:
        n = info.data.get("n", 1)
        if v is not None and v != n:
            raise ValueError(f"only best_of equal to n ({n}) is supported (best_of > n would rank choices)")
        return v

    def alternatives(self) -> tuple[str, int | None]:
        return "logprobs", self.logprobs

    def asked_tokens(self) -> tuple[str, int | None]:
        return "max_tokens", self.max_tokens

    def choice_sampling(self, choice: int = 0) -> Sampling:
        """The engine's controls for choice number `choice` of a prompt (seeded `seed + choice`)."""
        return self.sampling(self.max_tokens, choice, self.logprobs, self.logprobs if self.echo else None)

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts, each a string or a list of ids."""
        if isinstance(self.prompt, str) or not self.prompt or isinstance(self.prompt[0], int):
            return [self.prompt]  # type: ignore[list-item]
        return list(self.prompt)  # type: ignore[arg-type]


class TextRequest(_Strict):
    """An explorer request about one text: `text`, or `tokens` (ids) to skip encoding."""

    # The schema says what `ids` asks: exactly one of text (not empty) and tokens, so `{}` does not fit it
    model_config = ConfigDict(json_schema_extra={"oneOf": [{"required": ["text"]}, {"required": ["tokens"]}]})
    text: str | None = Field(None, json_schema_extra={"minLength": 1})
    tokens: list[int] | None = None

    def ids(self, encode: Callable[[Any, str], list[int]]) -> list[int]:
        """`encode(value, field)` of whichever of `text` and `tokens` was given (`field` names it in errors)."""
        if (self.text is None) == (self.tokens is None):
            raise BadRequest("text: give exactly one of text and tokens", "text")
        if self.text == "":
            raise BadRequest("text: the text is empty", "text")
        return encode(self.text, "text") if self.text is not None else encode(self.tokens, "tokens")


class NextTokenRequest(TextRequest):
    temperature: float = Field(1.0, ge=0.0, le=100.0)
    top_k: int = Field(0, ge=0)  # 0: off
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    k: int = Field(10, ge=1, le=100)  # how many tokens to list


class AttentionRequest(TextRequest):
    layer: int = Field(0, ge=0)
    head: int | None = Field(None, ge=0)  # None: every head of the layer


class AttributionRequest(TextRequest):
    token: int | str | None = None  # an id, or a text of one token; None: the model's top prediction
    k: int = Field(10, ge=1, le=100)  # how many top predictions to list beside it


class HeadScoresRequest(TextRequest):
    seed: int = Field(0, ge=0, le=2**31 - 1)  # of the repeated random tokens


class PatchingRequest(TextRequest):
    """`text`/`tokens` is the clean prompt; `corrupted_text`/`corrupted_tokens` one of the same token length."""

    corrupted_text: str | None = None
    corrupted_tokens: list[int] | None = None
    answer: int | str  # an id, or a text of one token
    wrong_answer: int | str
    hook: Literal["resid_pre", "attn_out", "mlp_out"] = "resid_pre"

    def corrupted_ids(self, encode: Callable[[Any, str], list[int]]) -> list[int]:
        """`TextRequest.ids` for the corrupted prompt."""
        if (self.corrupted_text is None) == (self.corrupted_tokens is None):
            raise BadRequest("corrupted_text: give exactly one of corrupted_text and corrupted_tokens", "corrupted_text")
        if self.corrupted_text == "":
            raise BadRequest("corrupted_text: the text is empty", "corrupted_text")
        if self.corrupted_text is not None:
            return encode(self.corrupted_text, "corrupted_text")
        return encode(self.corrupted_tokens, "corrupted_tokens")


def describe_validation_error(problem: dict[str, Any]) -> str:
    """One readable line for a pydantic/FastAPI validation problem."""
    kind, message = problem.get("type", ""), str(problem.get("msg", "invalid request"))
    if kind == "extra_forbidden":
        return "unknown field (see docs/serving.md for the fields glasslm serve accepts)"
    if kind == "json_invalid":
        return f"the request body is not valid JSON ({problem.get('ctx', {}).get('error', message)})"
    if tuple(problem.get("loc", ())) == ("body",) and kind != "value_error":  # the body is no object at all
        return "the request needs a JSON body" if kind == "missing" else "the request body must be a JSON object"
    return message.removeprefix("Value error, ")


# --- turning a request's events into OpenAI responses --------------------------------------------

def error_event(message: str) -> dict[str, Any]:
    """The payload a stream ends with when generating failed (before its `data: [DONE]`)."""
    return {"error": {"message": message, "type": "server_error", "param": None, "code": 500}}


@dataclass
class Completion:
    """One request's jobs (`n` per prompt, sharing one event queue; `job.index` is the choice index)."""

    jobs: list[Job]
    echoes: list[str]  # per job: the text `echo` puts before its completion ("" without echo)
    body: CompletionRequest
    name: str
    tokenizer: Any

    @property
    def id(self) -> str:
        return self.jobs[0].id

    def chunk(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {"id": self.id, "object": "text_completion", "created": int(self.jobs[0].created), "model": self.name,
                "choices": choices, **extra}

    def usage(self) -> dict[str, int]:
        """Each prompt counted once (not once per choice); completion tokens summed over choices."""
        prompts = sum(len(job.prompt) for job in self.jobs[::self.body.n])
        completion = sum(len(job.generated) for job in self.jobs)
        return {"prompt_tokens": prompts, "completion_tokens": completion, "total_tokens": prompts + completion}

    def logprobs(self, index: int, events: list[dict[str, Any]]) -> dict[str, Any]:
        """OpenAI's legacy `logprobs` of prompt-score and token events; offsets count from the choice's text start."""
        texts = [self.tokenizer.decode([e["token"]]) for e in events]
        offsets, prompt_end, echo = [], 0, len(self.echoes[index])
        for event, text in zip(events, texts):
            if "offset" in event:  # a generated token: its offset in the completion, after the echo
                offsets.append(echo + event["offset"])
            else:  # a prompt token: where its text starts in the echoed prompt
                offsets.append(prompt_end)
                prompt_end += len(text)
        return {"tokens": texts, "token_logprobs": [e.get("logprob") for e in events],
                "top_logprobs": [None if e.get("top") is None else self.alternatives(e["top"]) for e in events],
                "text_offset": offsets}

    def alternatives(self, top: list[tuple[int, float]]) -> dict[str, float]:
        """OpenAI's {text: logprob} of the likeliest tokens (best first); a text that several ids share
        (padding ids all read "") keeps the likeliest one's logprob."""
        shown: dict[str, float] = {}
        for token, logprob in top:
            shown.setdefault(self.tokenizer.decode([token]), logprob)
        return shown

    def delta(self, event: dict[str, Any]) -> dict[str, Any]:
        """The streamed choice for one event: a prompt's echo, a token, or the finish."""
        index, body = event["index"], self.body
        scored = event.get("prompt") or ([event] if "token" in event else [])
        text = self.echoes[index] if "prompt" in event else event["text"]
        choice: dict[str, Any] = {"index": index, "text": text, "finish_reason": event.get("finish_reason"),
                                  "logprobs": self.logprobs(index, scored) if body.logprobs is not None and scored else None}
        if body.return_token_ids and "token" in event:
            choice["token_ids"] = [event["token"]]
        return choice

    def result(self, events: list[dict[str, Any]]) -> dict[str, Any]:
        """The whole response from every event of every job, in arrival order."""
        choices = []
        for job in self.jobs:
            mine = [e for e in events if e["index"] == job.index]
            scored = [s for e in mine for s in e.get("prompt", ())] + [e for e in mine if "token" in e]
            choice: dict[str, Any] = {"index": job.index, "text": self.echoes[job.index] + "".join(e["text"] for e in mine),
                                      "finish_reason": job.finish_reason,
                                      "logprobs": self.logprobs(job.index, scored) if self.body.logprobs is not None else None}
            if self.body.return_token_ids:
                choice["token_ids"] = [e["token"] for e in mine if "token" in e]
            choices.append(choice)
        return self.chunk(choices, usage=self.usage())


async def stream_chunks(completion: Completion) -> AsyncIterator[dict]:
    """Server-sent event payloads: the echoes, one chunk per token, one per finish, maybe usage last."""
    events, unfinished = completion.jobs[0].events, len(completion.jobs)
    for job in completion.jobs:  # echoes with no scores to wait for go first
        if completion.echoes[job.index] and job.sampling.prompt_logprobs is None:
            yield completion.chunk([{"index": job.index, "text": completion.echoes[job.index], "logprobs": None,
                                     "finish_reason": None}])
    while unfinished:
        event = await events.get()
        if "error" in event:
            yield error_event(event["error"])
            return
        unfinished -= "finish_reason" in event
        yield completion.chunk([completion.delta(event)])
    body = completion.body
    if body.stream_options is not None and body.stream_options.include_usage:
        yield completion.chunk([], usage=completion.usage())
