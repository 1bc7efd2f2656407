"""Where a sequence ends and starts, decided as transformers decides it.

`generate` in transformers stops at the model's `eos_token_id` from `generation_config.json`
(an id or a list: Llama 3 lists `<|eot_id|>` and `<|end_of_text|>`), falling back to config.json's.
glasslm does the same, and where a checkpoint records no ids, uses its tokenizer's eos
(`special_token_ids`: tokenizer_config.json's `eos_token`, else a char or BPE vocabulary's
`<|endoftext|>`). An empty prompt starts from the tokenizer's bos where it has one.

Example:
    >>> from glasslm.tokenizers.char import CharTokenizer
    >>> eos_token_ids(CharTokenizer.from_text("ab"))  # a, b, then <|endoftext|>
    (2,)
    >>> eos_token_ids(CharTokenizer(["a", "b"]))  # a char tokenizer saved before it had one
    ()
    >>> eos_token_ids(CharTokenizer.from_text("ab"), {"eos_token_id": [1, 0]})
    (1, 0)
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from glasslm.tokenizers.hf import special_token_ids

GENERATION_CONFIG_FILE = "generation_config.json"


def read_generation_config(directory: str | os.PathLike) -> dict[str, Any]:
    """A directory's `generation_config.json` as a dict ({} when it has none or it is not a JSON object)."""
    path = Path(directory) / GENERATION_CONFIG_FILE
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON: {err}") from None
    return data if isinstance(data, dict) else {}


def eos_token_ids(tokenizer: Any, *configs: Mapping[str, Any] | None) -> tuple[int, ...]:
    """The end-of-sequence ids: the first of `configs` (generation_config.json, then config.json)
    that names `eos_token_id` (an int or a list), else the tokenizer's eos, else none."""
    for config in configs:
        value = (config or {}).get("eos_token_id")
        if value is not None:
            values = value if isinstance(value, (list, tuple)) else [value]
            if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
                raise ValueError(f"eos_token_id must be a token id or a list of them, got {value!r}")
            return tuple(dict.fromkeys(int(v) for v in values))
    eos = special_token_ids(tokenizer)["eos"] if tokenizer is not None else None
    return () if eos is None else (int(eos),)


def bos_token_id(tokenizer: Any) -> int | None:
    """The id a text starts from (the tokenizer's bos), or None where it has none."""
    return special_token_ids(tokenizer)["bos"] if tokenizer is not None else None
