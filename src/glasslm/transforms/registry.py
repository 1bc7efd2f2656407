"""The registry of model transforms: named, in-place changes to a model's structure that a checkpoint
records and loading re-applies.

A transform replaces or adds modules (int8 swaps every Linear for an `Int8Linear`; LoRA would add
adapters), so the weights it leaves behind fit only a model that has had the same transform. Every
application is recorded on the model (`applied_transforms`) as `{"name": ..., **options}`, in
order; `save_checkpoint` writes that record and `load_checkpoint` gives the empty model the same
structure (`rebuild_transforms`) before the saved tensors are assigned into it.

Example:
    >>> from dataclasses import dataclass
    >>> from torch import nn
    >>> @dataclass(frozen=True)
    ... class Scale:
    ...     factor: float = 2.0
    >>> def scale_outputs(model, options):
    ...     model.head = nn.Sequential(model.head, nn.Identity())  # a structural change
    ...     model.factor = options.factor
    >>> scale = register_transform(Transform("scale-doc", scale_outputs, options=Scale, summary="an example"))
    >>> model = nn.Module(); model.head = nn.Linear(2, 2)
    >>> apply_transform(model, "scale-doc", factor=3.0)
    >>> applied_transforms(model)
    [{'name': 'scale-doc', 'factor': 3.0}]
    >>> del TRANSFORMS["scale-doc"]  # tests and examples clean up after themselves
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from torch import nn

# The model attribute holding what has been applied to it, in order (a plain list of dicts, so it
# survives `copy.deepcopy` and `model.to`, and is what checkpoints store).
_RECORD_ATTRIBUTE = "applied_transforms"


@dataclass(frozen=True)
class Transform:
    """A named in-place model change.

    `apply(model, options)` changes `model` in place; `options` is an instance of the `options`
    dataclass, or None for a transform that takes none. `rebuild(model, options)` gives an empty
    (meta-device) model the structure `apply` makes, before saved weights are loaded into it; by
    default it is `apply` itself, which must then work on meta tensors. `kind` groups transforms
    for the CLI ("quantization" ones are the choices of `--quantize`).
    """

    name: str
    apply: Callable[[nn.Module, Any], None]
    options: type | None = None
    rebuild: Callable[[nn.Module, Any], None] | None = None
    kind: str = ""
    summary: str = ""

    def make_options(self, values: dict[str, Any]) -> Any:
        """The options dataclass built from `values` (None where the transform takes none)."""
        if self.options is None:
            if values:
                raise ValueError(f"transform {self.name!r} takes no options, got {sorted(values)}")
            return None
        known = {f.name for f in dataclasses.fields(self.options)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"transform {self.name!r} has no option {', '.join(unknown)}; "
                             f"its options are {', '.join(sorted(known)) or 'none'}")
        return self.options(**values)


TRANSFORMS: dict[str, Transform] = {}


def register_transform(transform: Transform) -> Transform:
    """Add `transform` to `TRANSFORMS` under its name (a name can be registered once).

    >>> register_transform(get_transform("int8"))
    Traceback (most recent call last):
    ...
    ValueError: a transform named 'int8' is already registered
    """
    if transform.name in TRANSFORMS:
        raise ValueError(f"a transform named {transform.name!r} is already registered")
    TRANSFORMS[transform.name] = transform
    return transform


def transform_names(kind: str | None = None) -> tuple[str, ...]:
    """Names of the registered transforms, of one `kind` where given.

    >>> transform_names("quantization")
    ('int8', 'int4', 'q4_0', 'q4_1', 'q5_0', 'q5_1', 'q8_0', 'f16', 'bf16', 'f32')
    """
    return tuple(name for name, t in TRANSFORMS.items() if kind is None or t.kind == kind)


def get_transform(name: str) -> Transform:
    """The registered transform called `name`, or an error listing the names there are."""
    if name not in TRANSFORMS:
        raise ValueError(f"unknown transform {name!r}; choose from {', '.join(TRANSFORMS)}")
    return TRANSFORMS[name]


def applied_transforms(model: nn.Module) -> list[dict[str, Any]]:
    """What has been applied to `model`, in order: `[{"name": ..., **options}, ...]` (a copy).

    >>> from glasslm.presets import get_preset
    >>> from glasslm.core.model import TransformerLM
    >>> model = TransformerLM(get_preset("llama-tiny"))
    >>> applied_transforms(model)
    []
    >>> apply_transform(model, "int8")
    >>> applied_transforms(model)
    [{'name': 'int8'}]
    """
    return [dict(record) for record in getattr(model, _RECORD_ATTRIBUTE, [])]


def apply_transform(model: nn.Module, name: str, options: Any = None, **option_values: Any) -> None:
    """Apply the transform `name` to `model` in place and record it (options as a dataclass or keywords).

    A transform already applied to the model is refused: its modules are already swapped, and a
    second record would make the checkpoint describe a structure the model does not have.

    >>> from glasslm.presets import get_preset
    >>> from glasslm.core.model import TransformerLM
    >>> model = TransformerLM(get_preset("llama-tiny"))
    >>> apply_transform(model, "int4")
    >>> type(model.blocks[0].mlp.down).__name__
    'Int4Linear'
    >>> apply_transform(model, "int4")
    Traceback (most recent call last):
    ...
    ValueError: transform 'int4' was already applied to this model
    """
    transform = get_transform(name)
    if options is None:
        options = transform.make_options(option_values)
    elif option_values or transform.options is None or not isinstance(options, transform.options):
        wanted = "no options" if transform.options is None else f"one {transform.options.__name__} or keywords"
        raise ValueError(f"transform {name!r} takes {wanted}, got {options!r} and {option_values}")
    if any(record["name"] == name for record in applied_transforms(model)):
        raise ValueError(f"transform {name!r} was already applied to this model")
    transform.apply(model, options)
    _record(model, transform, options)


def rebuild_transforms(model: nn.Module, records: Iterable[dict[str, Any]], source: str = "checkpoint") -> None:
    """Give an empty model the structure of the recorded transforms, in order, and record them.

    `records` is what `applied_transforms` returned for the model the weights came from.
    """
    for record in records:
        if not isinstance(record, dict) or not isinstance(record.get("name"), str):
            raise ValueError(f"{source}: a transform record should be {{'name': ..., options}}, got {record!r}")
        values = {k: v for k, v in record.items() if k != "name"}
        try:
            transform = get_transform(record["name"])
            options = transform.make_options(values)
        except ValueError as err:
            raise ValueError(f"{source}: {err}") from None
        (transform.rebuild or transform.apply)(model, options)
        _record(model, transform, options)


def _record(model: nn.Module, transform: Transform, options: Any) -> None:
    values = dataclasses.asdict(options) if options is not None else {}
    setattr(model, _RECORD_ATTRIBUTE, [*applied_transforms(model), {"name": transform.name, **values}])
