"""The Hugging Face families glasslm converts, one file each, and the registry that finds them.

Adding a family is one new file (an `HFFamily` named `FAMILY`, see `family.py`) plus one
`register(...)` line below. Nothing else names a family: `config_from_hf` finds it by `model_type`,
and `family_of` recognises a glasslm config as the first registered family that has no objection
to it (`fit_problems`) and whose config.json says all of it (`config_to_hf` then `config_from_hf`
gives the same model back), so there is no table of families to keep in step. The round trip also
keeps a family from claiming configs with a ModelConfig field it has never heard of.

Example:
    >>> from glasslm.presets import get_preset
    >>> sorted(FAMILIES)
    ['gemma2', 'gemma3_text', 'gpt2', 'gpt_neox', 'llama', 'mistral', 'mixtral', 'olmoe', 'phi3', 'qwen2', 'qwen2_moe', 'qwen3', 'qwen3_moe']
    >>> family_of(get_preset("gpt2-small")), family_of(get_preset("llama-tiny"))
    ('gpt2', 'llama')
"""

from __future__ import annotations

import math

from glasslm.core.config import ModelConfig
from glasslm.hf.errors import UnsupportedModelError
from glasslm.hf.families import (
    gemma2, gemma3, gpt2, gpt_neox, llama, mistral, mixtral, olmoe, phi3, qwen2, qwen2_moe, qwen3, qwen3_moe,
)
from glasslm.hf.families.common import computed_fields
from glasslm.hf.families.family import HFFamily

FAMILIES: dict[str, HFFamily] = {}


def register(family: HFFamily) -> HFFamily:
    """Make `family` known to import, export and `family_of` (a later one with the same name replaces it)."""
    FAMILIES[family.name] = family
    return family


register(gpt2.FAMILY)
register(llama.FAMILY)
register(mistral.FAMILY)
register(qwen2.FAMILY)
register(qwen3.FAMILY)
register(gpt_neox.FAMILY)
register(gemma3.FAMILY)
register(gemma2.FAMILY)
register(phi3.FAMILY)
register(mixtral.FAMILY)
register(qwen3_moe.FAMILY)
register(qwen2_moe.FAMILY)
register(olmoe.FAMILY)


def family_reading(model_type: str | None) -> HFFamily | None:
    """The registered family an HF config with this `model_type` belongs to, or None."""
    return next((family for family in FAMILIES.values() if family.reads(model_type)), None)


def family_reading_gguf(arch: str, experts: bool = False) -> HFFamily | None:
    """The registered family whose GGUF form has this `general.architecture`, or None; `experts`: the
    file states an expert count (llama.cpp's "llama" with experts is Mixtral), so only a mixture-of-experts
    family reads it (a file with experts is never read as a dense model)."""
    return next((family for family in FAMILIES.values()
                 if family.gguf and family.gguf.arch == arch and family.gguf.experts == experts), None)


def round_trip_problems(family: HFFamily, config: ModelConfig) -> list[str]:
    """What of `config` the family's config.json loses ([] if reading it back gives the same model)."""
    try:
        back = family.config_from_hf(family.config_to_hf(config, True), None)
    except (ValueError, KeyError, TypeError) as err:  # UnsupportedModelError is a ValueError
        return [f"its config.json does not read back ({err})"]
    ours, theirs = computed_fields(config), computed_fields(back)

    def same(a, b) -> bool:
        return math.isclose(a, b, rel_tol=1e-12) if isinstance(a, float) and isinstance(b, float) else a == b

    return [f"config.json cannot say {name}={value!r}" for name, value in ours.items()
            if name not in theirs or not same(value, theirs[name])]


def family_for(config: ModelConfig) -> HFFamily:
    """The first registered family that fits `config`, or UnsupportedModelError saying why none does."""
    objections = {}
    for family in FAMILIES.values():
        problems = family.fit_problems(config) or round_trip_problems(family, config)
        if not problems:
            return family
        objections[family.name] = problems
    raise UnsupportedModelError(
        "this model has no Hugging Face form glasslm writes: "
        + "; ".join(f"not {name}: {', '.join(problems)}" for name, problems in objections.items()))


def family_of(config: ModelConfig) -> str:
    """The name (HF model_type) of the family `config` is, or UnsupportedModelError saying why none.

    GPT-2 has learned positions; rotary models are Llama (no biases, or biases on q/k/v and o
    alike), Qwen2 (biases on q/k/v only) or Mistral (a sliding window, no biases).
    """
    return family_for(config).name
