"""A PEFT adapter directory with its base, as `peft.AutoPeftModelForCausalLM.from_pretrained(directory)`
loads it: the base its adapter_config.json names (a local path, or a hub name in the local HF cache
at the recorded revision), or one given instead, with the adapter applied.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from glasslm.hf.cache import is_hub_name, resolve_model_path
from glasslm.hf.peft.files import PeftAdapterError, is_peft_directory, read_adapter_config
from glasslm.hf.peft.importer import import_peft_adapter


def peft_base(directory: str | os.PathLike, base: str | os.PathLike | None = None) -> Path:
    """The base model of the PEFT adapter in `directory`: `base` if given, else adapter_config.json's
    `base_model_name_or_path`; an error says how to name it when it is not here."""
    config = read_adapter_config(directory)
    name = str(base) if base is not None else config.get("base_model_name_or_path")
    how = f"name a copy with: glasslm convert --from-peft {directory} --base PATH --out DIR"
    if not name:
        raise PeftAdapterError(f"{directory}: adapter_config.json names no base_model_name_or_path; {how}")
    revision = config.get("revision") if base is None and is_hub_name(name) and not Path(name).exists() else None
    try:
        path = resolve_model_path(name, revision)
    except (FileNotFoundError, ValueError) as err:
        raise FileNotFoundError(f"{directory} is a PEFT adapter for the base {name}, which is not here ({err}); "
                                f"or {how}") from None
    if not path.exists():
        raise FileNotFoundError(f"{directory} is a PEFT adapter for the base {name}, which does not exist; {how}")
    if is_peft_directory(path):
        raise PeftAdapterError(f"{directory}: its base {name} is itself a PEFT adapter; name the base model")
    return path


def load_peft_model(directory: str | os.PathLike, base: str | os.PathLike | None = None,
                    device: torch.device | str = "cpu", dtype: torch.dtype | None = None) -> tuple[Any, Any | None]:
    """(model in eval mode with the adapter applied, tokenizer) for a PEFT adapter directory; the
    tokenizer saved beside the adapter (as TRL saves it) if there is one, else the base's."""
    from glasslm.hf.load import hf_tokenizer, load_model

    model, tokenizer = load_model(peft_base(directory, base), device)
    import_peft_adapter(model, directory)
    tokenizer = hf_tokenizer(directory) or tokenizer
    return (model if dtype is None else model.to(dtype)).eval(), tokenizer
