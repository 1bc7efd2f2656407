"""Building a model and putting weights into it, without random init or a second copy.

A model for loaded weights is built on the `meta` device (every shape, no storage), the tensors are
assigned into it after their names and shapes are checked, and the buffers that checkpoints do not
hold (rotary cos/sin, the sinusoidal table: functions of the config alone) are computed on the target
device. Checkpoint files (checkpoint.py), Hugging Face directories (glasslm.hf) and the accounting of
huge configs (accounting.py) all build models this way.

Example:
    >>> from glasslm.presets import get_preset
    >>> empty_model(get_preset("gpt2-xl")).num_parameters()  # no memory spent
    1557611200
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from glasslm.core.config import ModelConfig
from glasslm.core.model import TransformerLM
from glasslm.core.positions import RotaryPositions, SinusoidalPositions
from glasslm.transforms import rebuild_transforms


def load_weights(model: TransformerLM, weights: dict[str, torch.Tensor], source: str = "weights") -> None:
    """Copy `weights` into an existing `model`, naming any missing, unexpected or mis-shaped tensor."""
    expected = model.state_dict()
    _check_names(expected, weights, source)
    for name, tensor in weights.items():
        _check_shape(name, tensor, expected[name], source)
    model.load_state_dict(weights)


def _check_names(expected: dict[str, Any], given: dict[str, Any], source: str) -> None:
    missing = sorted(set(expected) - set(given))
    unexpected = sorted(set(given) - set(expected))
    if missing or unexpected:
        raise ValueError(f"{source} does not match the model: missing tensors {missing}, unexpected tensors {unexpected}")


def _check_shape(name: str, tensor: torch.Tensor, expected: torch.Tensor, source: str) -> None:
    if tensor.shape != expected.shape:
        raise ValueError(
            f"{source}: tensor {name} has shape {tuple(tensor.shape)}, the model expects {tuple(expected.shape)}"
        )


_INITIALISERS = ("normal_", "uniform_", "trunc_normal_", "kaiming_uniform_", "xavier_uniform_", "zeros_", "ones_")


@contextlib.contextmanager
def _initialisers_skipped() -> Iterator[None]:
    """torch.nn.init's functions return their tensor untouched: a meta model's values are never read,
    and torch runs a meta tensor's initialiser through its Python reference ops (~1 ms each, ~900 for
    SmolLM2; the first one imports torch._dynamo: 70 MB and seconds)."""
    saved = {name: getattr(nn.init, name) for name in _INITIALISERS}
    for name in _INITIALISERS:
        setattr(nn.init, name, lambda tensor, *args, **kwargs: tensor)
    try:
        yield
    finally:
        for name, function in saved.items():
            setattr(nn.init, name, function)


def empty_model(config: ModelConfig) -> TransformerLM:
    """A TransformerLM on the `meta` device: every shape, no storage, no time spent initialising."""
    with torch.device("meta"), _initialisers_skipped():
        return TransformerLM(config)


def materialize_buffers(model: TransformerLM, device: torch.device | str) -> None:
    """Compute the non-persistent buffers (not in checkpoints) on `device` after a meta build.

    Rotary cos/sin and the sinusoidal table are functions of the config alone, so they are
    rebuilt rather than loaded. A shared rotary module (one per RoPE base) is rebuilt once.
    """
    c = model.config
    for module in model.modules():
        if isinstance(module, RotaryPositions):
            with torch.device(device):
                fresh = RotaryPositions.from_config(c, module.local)
            module.cos, module.sin = fresh.cos, fresh.sin
        elif isinstance(module, SinusoidalPositions):
            with torch.device(device):
                module.table = SinusoidalPositions(c.context_length, c.d_model).table
    leftover = [name for name, b in model.named_buffers() if b.is_meta]
    if leftover:
        raise RuntimeError(f"buffers still on the meta device after loading: {leftover}")


def model_from_state_dict(
    config: ModelConfig, tensors: dict[str, Callable[[], torch.Tensor]] | dict[str, torch.Tensor],
    device: torch.device | str = "cpu", dtype: torch.dtype | None = None, source: str = "weights",
    transforms: Iterable[dict[str, Any]] = (),
) -> TransformerLM:
    """Build a model by assigning tensors (or zero-argument functions making them) into a meta model.

    Names every missing or unexpected tensor, and every shape mismatch with both shapes.
    `transforms` (records as `applied_transforms` gives them, e.g. `[{"name": "int8"}]`) give the
    model the structure the tensors were saved from, and stay recorded on it.
    """
    model = empty_model(config)
    with _initialisers_skipped():  # (on the meta device, an initialiser would only cost time: ~1 s, once)
        rebuild_transforms(model, transforms, source)
    expected = model.state_dict()
    _check_names(expected, tensors, source)
    # A module at a time: its tensors are made, assigned and (a quantized layer's) packed before the
    # next module's are made, so loading never holds two copies of the whole model.
    owners: dict[str, list[str]] = {}
    for name in tensors:
        owners.setdefault(name.rpartition(".")[0], []).append(name)
    for owner, names in owners.items():
        local = {}
        for name in names:
            make = tensors[name]
            tensor = make() if callable(make) else make
            _check_shape(name, tensor, expected[name], source)
            keep_dtype = dtype is None or not tensor.is_floating_point()  # int8 weights stay int8
            local[name.rpartition(".")[2]] = tensor.to(device=device, dtype=tensor.dtype if keep_dtype else dtype)
        _assign(model.get_submodule(owner) if owner else model, local)
    materialize_buffers(model, device)
    _return_freed_memory()
    return model.eval()


@functools.cache
def _libc() -> Any | None:
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc (macOS, Windows, musl): nothing to do
        return None


def _return_freed_memory() -> None:
    """Gives the heap pages freed while loading back to the OS: glibc keeps freed memory for reuse,
    so the transient copies a load makes (file bytes before packing, reordered rows) would otherwise
    stay in the process's resident memory (~150 MB after SmolLM2's 98 MB file)."""
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


def _assign(module: torch.nn.Module, local: dict[str, torch.Tensor]) -> None:
    """Puts a module's own tensors (not its children's) in place, as `load_state_dict(assign=True)` does
    for each module it walks: through the module's own loading step, so a layer that re-lays its
    weights out when they arrive (the quantized ones) does so now."""
    errors: list[str] = []
    module._load_from_state_dict(local, "", {"assign_to_params_buffers": True}, True, [], [], errors)
    if errors:
        raise RuntimeError("; ".join(errors))
