"""Checkpoints for any `nn.Module` and optimizer: one safetensors file, JSON inside, never pickle.

`glasslm.io.checkpoint` writes training-run directories for a `TransformerLM` (config, tokenizer,
pointers); this module is the small general form: the weights, the optimizer state and the
iteration number in a single file, to a path or to any binary file object.

Layout: tensors named `model.<parameter name>` and `optimizer.state.<index>.<key>`, and the
safetensors header's metadata `glasslm_state` holding JSON: the iteration, the optimizer's
param_groups and its non-tensor state. A file holding anything else is refused by name.

Example (save to memory, load into fresh copies):
    >>> import io, torch
    >>> model = torch.nn.Linear(3, 2)
    >>> opt = torch.optim.AdamW(model.parameters())
    >>> model(torch.randn(4, 3)).sum().backward(); opt.step()
    >>> buffer = io.BytesIO()
    >>> save_checkpoint(model, opt, 7, buffer)
    >>> fresh = torch.nn.Linear(3, 2)
    >>> _ = buffer.seek(0)
    >>> load_checkpoint(buffer, fresh, torch.optim.AdamW(fresh.parameters()))
    7
    >>> torch.equal(fresh.weight, model.weight)
    True
"""

from __future__ import annotations

import json
import os
from typing import IO, Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors_bytes
from safetensors.torch import save as save_safetensors_bytes
from torch import Tensor, nn

from glasslm.io.checkpoint import optimizer_state_from_files, optimizer_state_to_files

__all__ = ["load_checkpoint", "save_checkpoint"]

METADATA_KEY = "glasslm_state"
FORMAT = 1


def save_checkpoint(model: nn.Module, optimizer: torch.optim.Optimizer | None, iteration: int,
                    out: str | os.PathLike | IO[bytes]) -> None:
    """Write `model`'s weights, `optimizer`'s state (None: none) and `iteration` to `out`.

    `out` is a path or a binary file object open for writing (written from its current position).
    Tied weights (one tensor under two names) are stored under each name; loading ties nothing
    new, since `load_state_dict` copies into the model's own tensors.
    """
    tensors: dict[str, Tensor] = {}
    seen: set[int] = set()
    for name, tensor in model.state_dict().items():
        storage = tensor.untyped_storage().data_ptr()
        # safetensors refuses two names sharing memory, so a tied tensor's second name gets a copy.
        tensor = tensor.detach().cpu()
        tensors[f"model.{name}"] = tensor.clone() if storage in seen else tensor.contiguous()
        seen.add(storage)
    meta: dict[str, Any] = {"format": FORMAT, "iteration": int(iteration), "optimizer": None}
    if optimizer is not None:
        optim_tensors, optim_json = optimizer_state_to_files(optimizer.state_dict())
        tensors.update({f"optimizer.{k}": v.detach().cpu().contiguous() for k, v in optim_tensors.items()})
        meta["optimizer"] = optim_json
    data = save_safetensors_bytes(tensors, metadata={METADATA_KEY: json.dumps(meta)})
    if isinstance(out, (str, os.PathLike)):
        with open(out, "wb") as f:
            f.write(data)
    else:
        out.write(data)


def load_checkpoint(src: str | os.PathLike | IO[bytes], model: nn.Module,
                    optimizer: torch.optim.Optimizer | None = None) -> int:
    """Restore `model` (and `optimizer`, if given) from what `save_checkpoint` wrote; return the iteration.

    `src` is a path or a binary file object (read from its current position). Tensors go to the
    devices of the model's own tensors (load_state_dict copies into them). A file that is not such a checkpoint, or whose tensors do not
    fit `model`, raises ValueError naming it.
    """
    where = str(src) if isinstance(src, (str, os.PathLike)) else getattr(src, "name", "the file object")
    if isinstance(src, (str, os.PathLike)):
        with open(src, "rb") as f:
            data = f.read()
    else:
        data = src.read()
    try:
        tensors = load_safetensors_bytes(data)
        meta_text = _metadata(data)
    except (SafetensorError, ValueError, RuntimeError, UnicodeDecodeError) as err:
        raise ValueError(f"{where} is not a glasslm checkpoint (safetensors with {METADATA_KEY!r}): {err}") from None
    if meta_text is None:
        raise ValueError(f"{where} is a safetensors file but not a glasslm checkpoint (no {METADATA_KEY!r} metadata)")
    meta = json.loads(meta_text)
    weights = {k[len("model."):]: v for k, v in tensors.items() if k.startswith("model.")}
    try:
        model.load_state_dict(weights, strict=True)
    except RuntimeError as err:
        raise ValueError(f"{where} does not fit this model: {' '.join(str(err).split())}") from None
    if optimizer is not None:
        if meta.get("optimizer") is None:
            raise ValueError(f"{where} holds no optimizer state")
        optim_tensors = {k[len("optimizer."):]: v for k, v in tensors.items() if k.startswith("optimizer.")}
        # load_state_dict itself moves each state tensor to its parameter's device.
        state = optimizer_state_from_files(optim_tensors, meta["optimizer"])
        try:
            optimizer.load_state_dict(state)
        except (ValueError, KeyError) as err:
            raise ValueError(f"{where}'s optimizer state does not fit this optimizer: {err}") from None
    return int(meta["iteration"])


def _metadata(data: bytes) -> str | None:
    """The `glasslm_state` string from a safetensors header (8-byte little-endian length, then JSON)."""
    header_len = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + header_len])
    return (header.get("__metadata__") or {}).get(METADATA_KEY)
