"""One loader for any checkpoint, glasslm's own, Hugging Face's (a directory or a hub name in the
local HF cache) or a GGUF file (llama.cpp's): the model, its tokenizer, its config alone, or what is
known of its history.

Example:
    >>> import tempfile
    >>> from glasslm.core.model import TransformerLM
    >>> from glasslm.io.checkpoint import save_checkpoint
    >>> from glasslm.presets import get_preset
    >>> directory = tempfile.mkdtemp()
    >>> _ = save_checkpoint(directory, TransformerLM(get_preset("llama-tiny")))
    >>> model, tokenizer = load_model(directory)
    >>> model.config == checkpoint_config(directory)[0], tokenizer is None
    (True, True)
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from glasslm.core.config import ModelConfig
from glasslm.core.model import TransformerLM
from glasslm.hf.cache import resolve_model_path
from glasslm.hf.convert import config_from_hf, import_hf
from glasslm.hf.files import is_hf_directory, read_hf_config
from glasslm.hf.gguf import GGUF_SUFFIX, GGUFFile, is_gguf_file
from glasslm.hf.peft.files import is_peft_directory
from glasslm.io.checkpoint import ADAPTER_BASE_KEY, CONFIG_FILE, META_FILE, TRAINER_STATE_JSON, read_json
from glasslm.tokenizers import has_tokenizer
from glasslm.transforms import applied_transforms, apply_transform
from glasslm.transforms.lora import load_lora_state_dict

# Fields that may differ between pretrained weights and the model to fine-tune from them.
TRAINING_ONLY_FIELDS = ("dropout", "impl", "init", "init_std")


def hf_tokenizer(directory: str | os.PathLike) -> Any | None:
    """The tokenizer of an HF model directory (tokenizer.json, tokenizer.model, or GPT-2's
    vocab.json + merges.txt), or None if it has none."""
    from glasslm.tokenizers import read_hf_tokenizer

    return read_hf_tokenizer(resolve_model_path(directory))


def gguf_path(path: str | os.PathLike) -> Path | None:
    """The GGUF file `path` stands for: a GGUF file itself, or a directory (a downloaded hub snapshot)
    holding exactly one `.gguf` file and no config.json; None for anything else. A file named `.gguf`
    is one even when it does not hold GGUF's bytes: opening it then says why it is not."""
    path = Path(path)
    if path.is_file():
        return path if is_gguf_file(path) or path.suffix.lower() == GGUF_SUFFIX else None
    if not path.is_dir() or (path / "config.json").exists():
        return None
    found = sorted(path.glob(f"*{GGUF_SUFFIX}"))
    if len(found) > 1:
        raise ValueError(f"{path} holds {len(found)} GGUF files ({', '.join(f.name for f in found[:4])}); "
                         "name the one to load")
    return found[0] if found else None


def load_model(
    path: str | os.PathLike, device: torch.device | str = "cpu", dtype: torch.dtype | None = None,
    base: str | os.PathLike | None = None,
) -> tuple[TransformerLM, Any | None]:
    """(model in eval mode, tokenizer or None) from a glasslm checkpoint, run directory, HF model
    directory, a hub name in the local HF cache, a GGUF file, or a PEFT adapter directory (loaded
    onto the base its adapter_config.json names, as `peft.AutoPeftModelForCausalLM` loads it:
    `glasslm.hf.peft.load_peft_model`). `model.eos_token_ids` holds where
    generation stops by default (generation_config.json's ids, else config.json's, else the
    tokenizer's eos). A GGUF file's 4-bit blocks stay as they are (`glasslm.hf.gguf.importer`), and
    `model.gguf_summary` says which tensors were kept and which dequantized.

    Either way the weights are memory-mapped and assigned into a meta-device model, so loading a
    large model needs about one copy of its weights in memory.

    An adapter checkpoint (a LoRA / QLoRA fine-tune, glasslm finetune) is loaded as its base with
    the recorded transforms (int4 ..., lora) applied and the adapters copied in. `base` names that
    base where it is now (moved or copied; its weights must still hash as recorded) instead of
    where the adapter checkpoint recorded it; only an adapter checkpoint takes one.
    """
    from glasslm.io.checkpoint import load_checkpoint, resolve_checkpoint

    path = resolve_model_path(path)
    gguf = gguf_path(path)
    whole = f"--base names the base model of a LoRA checkpoint; {path} holds a whole model, not adapters"
    if gguf is not None:
        if base is not None:
            raise ValueError(whole)
        from glasslm.hf.gguf.importer import import_gguf

        loaded = import_gguf(gguf, device, dtype)
        loaded.model.gguf_summary = loaded.summary()
        return loaded.model, loaded.tokenizer
    if is_hf_directory(path):
        if base is not None:
            raise ValueError(whole)
        return import_hf(path, device, dtype), hf_tokenizer(path)  # import_hf sets the eos ids
    if is_peft_directory(path):
        from glasslm.hf.peft import load_peft_model

        return load_peft_model(path, base, device=device, dtype=dtype)
    directory = resolve_checkpoint(path)  # a run directory means its best (else latest)
    meta = read_json(directory / META_FILE) if (directory / META_FILE).is_file() else {}
    if isinstance(meta, dict) and ADAPTER_BASE_KEY in meta:
        model, tokenizer = load_adapter_checkpoint(directory, meta, device, base)
    elif base is not None:
        raise ValueError(whole)
    else:
        model, tokenizer, _ = load_checkpoint(directory, device)
    return (model if dtype is None else model.to(dtype)), tokenizer


def adapter_base(meta: dict[str, Any], source: str) -> tuple[str, str]:
    """(path, sha256) of the base an adapter checkpoint's `meta` names, or an error naming the field.
    The path is the exact base checkpoint (a run directory in checkpoints written before issue 32)."""
    base = meta.get(ADAPTER_BASE_KEY)
    if not (isinstance(base, dict) and isinstance(base.get("path"), str) and isinstance(base.get("sha256"), str)):
        raise ValueError(f"{source}: meta.json's {ADAPTER_BASE_KEY!r} should be {{'path': ..., 'sha256': ...}}, "
                         f"got {base!r}")
    return base["path"], base["sha256"]


def load_base_checked(path: str, sha256: str, device: torch.device | str = "cpu", source: str = "adapter",
                      given: bool = False) -> tuple[TransformerLM, Any | None, str]:
    """(model, tokenizer, where it was found) of the base at `path`, refused with what to do if its
    weights do not hash to `sha256`.

    A recorded run directory (adapter checkpoints written before issue 32 named the base's run, not
    its checkpoint) whose best checkpoint has moved on is searched for the numbered checkpoint that
    still hashes as recorded. `given`: the path came from the user (--base), so nothing else is tried."""
    from glasslm.io.checkpoint import weights_sha256

    advice = ("pass --base PATH naming a copy of the base checkpoint the adapters were trained on "
              "(its weights must hash as recorded)")
    if not given and not Path(path).exists() and Path(path).is_absolute():
        raise FileNotFoundError(f"{source}: its base {path} does not exist (moved or deleted?); {advice}")
    base, tokenizer = load_model(path, device)
    # A GGUF file's 4-bit blocks are the file's own weights, not a transform made after loading.
    if applied_transforms(base) and gguf_path(resolve_model_path(path)) is None:
        raise ValueError(f"{source}: the base {path} is itself transformed ({applied_transforms(base)}); "
                         "an adapter's base must be plain weights")
    if weights_sha256(base.state_dict()) == sha256:
        return base, tokenizer, path
    found = None if given else _checkpoint_hashing_to(Path(path), sha256, device)
    if found is not None:
        return found
    what = "--base" if given else "the base"
    raise ValueError(f"{source}: {what} {path} has changed since the adapters were trained on it, or is another "
                     "model (its weights hash differently); the adapters only fit the weights they were trained "
                     f"on: {advice}")


def _checkpoint_hashing_to(run_dir: Path, sha256: str,
                           device: torch.device | str) -> tuple[TransformerLM, Any | None, str] | None:
    """(model, tokenizer, path) of the numbered checkpoint of `run_dir` whose weights hash to
    `sha256`, or None (also where `run_dir` is not a run directory)."""
    from glasslm.io.checkpoint import CHECKPOINT_PREFIX, weights_sha256

    if not run_dir.is_dir() or (run_dir / CONFIG_FILE).is_file():
        return None
    for candidate in sorted(run_dir.glob(f"{CHECKPOINT_PREFIX}*"), reverse=True):
        model, tokenizer = load_model(candidate, device)
        if not applied_transforms(model) and weights_sha256(model.state_dict()) == sha256:
            return model, tokenizer, str(candidate)
    return None


def load_adapter_checkpoint(directory: Path, meta: dict[str, Any], device: torch.device | str = "cpu",
                            base: str | os.PathLike | None = None) -> tuple[TransformerLM, Any | None]:
    """(model, tokenizer) of an adapter checkpoint: the checked base (`base`, else the recorded one),
    the recorded transforms re-applied in order (e.g. int4 then lora), the saved adapters copied in."""
    from glasslm.io.checkpoint import WEIGHTS_FILE, read_safetensors, recorded_transforms
    from glasslm.tokenizers import load_tokenizer

    recorded, sha256 = adapter_base(meta, str(directory))
    model, tokenizer, _ = load_base_checked(str(base) if base is not None else recorded, sha256, device,
                                            str(directory), given=base is not None)
    carried = applied_transforms(model)  # what the base comes with (a GGUF file's blocks) is not re-applied
    for record in recorded_transforms(meta):
        if record not in carried:
            apply_transform(model, record["name"], **{k: v for k, v in record.items() if k != "name"})
    load_lora_state_dict(model, read_safetensors(directory / WEIGHTS_FILE, device), str(directory))
    if has_tokenizer(directory):
        tokenizer = load_tokenizer(directory)
    return model.eval(), tokenizer


def load_chat_template(path: str | os.PathLike, tokenizer: Any | None,
                       template_file: str | os.PathLike | None = None) -> str | None:
    """The chat template of the checkpoint at `path` whose tokenizer is `tokenizer`, or None: the one
    lookup `chat`, `serve`, `finetune`, `convert --to-hf` and `merge` make.

    In order: `template_file` (a --chat-template FILE); the checkpoint's chat_template.jinja; the
    template a fine-tuning run recorded (checkpoints written before they kept chat_template.jinja);
    what the tokenizer carries (`tokenizer.config["chat_template"]`: an HF-style tokenizer's
    tokenizer_config.json, or one built from a single-file model); the directory's tokenizer_config.json.
    A PEFT adapter directory: the template saved beside the adapter, else its base's.
    """
    from glasslm.tokenizers.chat import CHAT_TEMPLATE_FILE, find_chat_template, read_template_file, template_text

    if template_file:
        return read_template_file(template_file)
    resolved = Path(resolve_model_path(path))
    if is_peft_directory(resolved):  # the template saved beside the adapter (as TRL saves one), else its base's
        from glasslm.hf.peft import peft_base

        return find_chat_template(resolved) or load_chat_template(peft_base(resolved), tokenizer)
    directory = _checkpoint_directory(path)
    if directory is not None and (directory / CHAT_TEMPLATE_FILE).is_file():
        return (directory / CHAT_TEMPLATE_FILE).read_text(encoding="utf-8")
    found = _recorded_template(directory) if directory is not None else None
    found = found or template_text((getattr(tokenizer, "config", None) or {}).get("chat_template"))
    return found or (find_chat_template(directory) if directory is not None else None)


def _checkpoint_directory(path: str | os.PathLike) -> Path | None:
    """The directory whose files belong to the model at `path` (a run directory's best checkpoint),
    or None where `path` is a GGUF file or a folder holding one (its tokenizer carries its template)."""
    from glasslm.io.checkpoint import resolve_checkpoint

    resolved = Path(resolve_model_path(path))
    if not resolved.is_dir() or gguf_path(resolved) is not None:
        return None
    return resolved if is_hf_directory(resolved) else resolve_checkpoint(resolved)


def _recorded_template(directory: Path) -> str | None:
    """The template a `glasslm finetune` checkpoint's meta.json records (its "finetune" entry)."""
    meta = read_json(directory / META_FILE) if (directory / META_FILE).is_file() else {}
    record = meta.get("finetune") if isinstance(meta, dict) else None
    template = record.get("template") if isinstance(record, dict) else None
    return template if isinstance(template, str) else None


def checkpoint_summary(path: str | os.PathLike) -> dict[str, Any]:
    """What is known about how a checkpoint was made (for model cards and `glasslm info`):
    data, steps, best validation loss, and where it was converted or fine-tuned from."""
    from glasslm.io.checkpoint import resolve_checkpoint

    path = resolve_model_path(path)
    if is_hf_directory(path) or gguf_path(path) is not None or is_peft_directory(path):
        return {}  # an HF directory, GGUF file or PEFT adapter records nothing of how it was made
    directory = resolve_checkpoint(path)
    summary: dict[str, Any] = {}
    for name in (META_FILE, TRAINER_STATE_JSON):
        if (directory / name).is_file():
            summary.update(read_json(directory / name))
    out = {key: summary.get(key) for key in ("data", "converted_from", "step")}
    out["init_from"] = (summary.get("train_config") or {}).get("init_from")
    best = summary.get("best_val_loss")
    out["val_loss"] = best if isinstance(best, (int, float)) and best != float("inf") else None
    return out


def init_weights_from(model: TransformerLM, path: str | os.PathLike) -> None:
    """Copy the weights of a checkpoint / HF directory / cached hub name into `model` (fine-tuning).

    The architectures must match except for training-only settings (dropout, attention impl)
    and, for rotary models, the context length.
    """
    from glasslm.io.build import load_weights

    gguf = gguf_path(resolve_model_path(path))
    if gguf is not None:  # fine-tuning every weight needs them all in float
        from glasslm.hf.gguf.importer import import_gguf

        source = import_gguf(gguf, keep_blocks=False).model
    else:
        source, _ = load_model(path)
    if _comparable(source.config) != _comparable(model.config):
        raise ValueError(f"{path} holds a different architecture than the model to train: {source.config} vs {model.config}")
    load_weights(model, source.state_dict(), str(path))


def _comparable(config: ModelConfig) -> dict[str, Any]:
    """The fields that must agree between pretrained weights and the model to fine-tune."""
    out = config.to_dict()
    for name in TRAINING_ONLY_FIELDS:
        out.pop(name)
    if config.positional != "learned":
        out.pop("context_length")  # rotary / sinusoidal tables are recomputed for any length
    return out


def checkpoint_config(path: str | os.PathLike) -> tuple[ModelConfig, Any | None, dict[str, Any]]:
    """(config, tokenizer or None, summary) of any checkpoint without reading its weights."""
    from glasslm.io.checkpoint import load_config, resolve_checkpoint
    from glasslm.tokenizers import load_tokenizer

    path = resolve_model_path(path)
    gguf = gguf_path(path)
    if gguf is not None:
        from glasslm.hf.gguf.importer import gguf_config, gguf_tokenizer

        file = GGUFFile.open(gguf)
        return gguf_config(file)[0], gguf_tokenizer(file), {}
    if is_hf_directory(path):
        return config_from_hf(read_hf_config(path))[0], hf_tokenizer(path), checkpoint_summary(path)
    if is_peft_directory(path):  # its base's config, and the tokenizer saved beside the adapter if any
        from glasslm.hf.peft import peft_base

        config, tokenizer, _ = checkpoint_config(peft_base(path))
        return config, hf_tokenizer(path) or tokenizer, {}
    directory = resolve_checkpoint(path)
    tokenizer = None
    if has_tokenizer(directory):
        tokenizer = load_tokenizer(directory)
    return load_config(directory / CONFIG_FILE), tokenizer, checkpoint_summary(directory)
