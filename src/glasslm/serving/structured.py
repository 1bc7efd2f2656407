"""Structured outputs: OpenAI's `response_format` (and Ollama's `format`) as a grammar the engine decodes under.

`{"type": "json_object"}` allows any JSON object; `{"type": "json_schema", "json_schema": {"name",
"schema", "strict"}}` the JSON texts its schema accepts, strict or not (decoding under the schema's
grammar makes every finished answer valid either way; `strict` is accepted for OpenAI's clients). The
grammar comes from `glasslm.generation.constrained` (llguidance); a schema it cannot compile, or one
using a feature it lacks, is a 400 naming `response_format.json_schema.schema`.

Example:
    >>> from glasslm.tokenizers import CharTokenizer
    >>> from glasslm.generation.constrained import Grammars
    >>> tok = CharTokenizer.from_text('{}":, abcdefghijklmnopqrstuvwxyz0123456789')
    >>> grammars = Grammars(tok, tok.vocab_size, [tok.special_tokens["<|endoftext|>"]])
    >>> fmt = ResponseFormat.model_validate({"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "integer"}}})
    >>> response_grammar(fmt, grammars).matcher().allowed().sum().item() > 0
    True
    >>> response_grammar(ResponseFormat(type="text"), grammars) is None
    True
"""

from __future__ import annotations

import functools
import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from glasslm.generation.constrained import Grammar, GrammarError, Grammars
from glasslm.serving.schemas import BadRequest

SCHEMA_FIELD = "response_format.json_schema.schema"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class JsonSchemaFormat(_Strict):
    """OpenAI's `json_schema` object: the schema and its name (`description` and `strict` accepted)."""

    name: str = Field(min_length=1, max_length=64)
    schema_: dict[str, Any] | None = Field(None, alias="schema")  # None: any JSON value
    description: str | None = None
    strict: bool | None = None


class ResponseFormat(_Strict):
    """OpenAI's `response_format`: text (no constraint), any JSON object, or JSON under a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def model_post_init(self, context: Any) -> None:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError('give json_schema exactly when type is "json_schema"')


def response_grammar(fmt: ResponseFormat | None, grammars: Grammars) -> Grammar | None:
    """The grammar `fmt` asks for (None for plain text), compiled once per distinct schema."""
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return _compiled(grammars, json.dumps({"type": "object"}), "response_format")
    schema = fmt.json_schema.schema_ if fmt.json_schema.schema_ is not None else {}
    return _compiled(grammars, json.dumps(schema), SCHEMA_FIELD)


def schema_grammar(schema: dict[str, Any], grammars: Grammars, field: str) -> Grammar:
    """The grammar of a JSON schema given in field `field` (Ollama's `format`); a 400 naming it otherwise."""
    return _compiled(grammars, json.dumps(schema), field)


def _compiled(grammars: Grammars, schema_json: str, field: str) -> Grammar:
    try:
        return _compile(grammars, schema_json)
    except GrammarError as err:
        raise BadRequest(f"{field}: {err}", field) from None


@functools.lru_cache(maxsize=128)
def _compile(grammars: Grammars, schema_json: str) -> Grammar:
    return grammars.json_schema(json.loads(schema_json))
