"""Checkpoints as plain files: safetensors weights, JSON config, the tokenizer's own files.

Nothing here unpickles: a checkpoint from anywhere can be opened safely. Writing goes to a
temporary directory that is renamed into place, so a killed process never leaves half a checkpoint.

A training checkpoint adds two more files: `optimizer.safetensors` (AdamW's moment tensors) and
`trainer_state.json` + `trainer_state.safetensors` (step, best validation loss, RNG states, the
batch sampler's generator state, the training config). A run directory holds several checkpoints
and two pointer files, each holding the name of one checkpoint directory:

    runs/x/ckpt-000500/   runs/x/ckpt-001000/   runs/x/latest   runs/x/best   runs/x/metrics.jsonl

Example:
    >>> import tempfile
    >>> from glasslm.presets import get_preset
    >>> from glasslm.core.model import TransformerLM
    >>> from glasslm.tokenizers import CharTokenizer
    >>> model = TransformerLM(get_preset("shakespeare-char-cpu", vocab_size=3))
    >>> path = save_checkpoint(tempfile.mkdtemp() + "/ckpt", model, CharTokenizer.from_text("abc"))
    >>> load_checkpoint(path)[0].num_parameters() == model.num_parameters()
    True
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from glasslm.core.config import ModelConfig
from glasslm.core.model import TransformerLM
from glasslm.io.build import model_from_state_dict
from glasslm.io.sharded import MODEL_PREFIX, OPTIMIZER_PREFIX, is_sharded_checkpoint, read_sharded_tensors, strip_prefix
from glasslm.tokenizers import (
    eos_token_ids, has_tokenizer, load_tokenizer, read_generation_config, save_hf_tokenizer,
)
from glasslm.tokenizers.chat import CHAT_TEMPLATE_FILE
from glasslm.transforms import applied_transforms

WEIGHTS_FILE = "model.safetensors"
# glasslm's model config, under a name of its own: HF loaders (AutoTokenizer too) read any config.json as theirs.
CONFIG_FILE = "glasslm_config.json"
LEGACY_CONFIG_FILE = "config.json"  # where glasslm wrote it before; still read
META_FILE = "meta.json"
OPTIMIZER_FILE = "optimizer.safetensors"
OPTIMIZER_JSON = "optimizer.json"
TRAINER_STATE_JSON = "trainer_state.json"  # a training checkpoint's step, RNGs and metrics window
TRAINER_STATE_TENSORS = "trainer_state.safetensors"
POINTER_NAMES = ("latest", "best")
CHECKPOINT_PREFIX = "ckpt-"  # numbered checkpoints in a run directory: ckpt-000500
_NUMBERED = re.compile(rf"{CHECKPOINT_PREFIX}\d+")
# Files and directories being written are `.<name>.tmp-...`; a replaced checkpoint is briefly `.<name>.old-<pid>`.
STAGING_MARK, REPLACED_MARK = ".tmp-", ".old-"
TRANSFORMS_KEY = "transforms"  # meta.json: the transforms applied, [{"name": "int8", ...options}, ...]
LEGACY_QUANTIZATION_KEY = "quantization"  # meta.json of glasslm 0.1.0's quantized checkpoints
# meta.json of an adapter checkpoint (a LoRA run): {"path": base checkpoint, "sha256": weights_sha256 of
# its weights}; model.safetensors then holds only the adapters (glasslm.hf.load_model applies them).
ADAPTER_BASE_KEY = "adapter_of"
# The kinds of tokenizer whose glasslm files a checkpoint pairs with HF's (tokenizer.json + tokenizer_config.json).
_HF_FORM_BESIDE = ("char", "bpe")
# In a numbered checkpoint that LoRA runs were trained on: {"runs": [their run directories]}. Pruning
# keeps the checkpoint while one of them still names it as its base.
ADAPTER_RUNS_FILE = "adapter_runs.json"


class CheckpointWriteError(RuntimeError):
    """A checkpoint or pointer could not be written (full disk, no permission); nothing half-written
    was left behind and what was there before is untouched."""


def _write_failure(what: Path, err: Exception) -> CheckpointWriteError:
    if isinstance(err, OSError) and err.strerror:
        reason = err.strerror
    else:  # safetensors wraps the OS error: 'Error while serializing: IoError(Os { ..., message: "..." })'
        text = str(err)
        found = re.search(r'message: "([^"]+)"', text)
        reason = found.group(1) if found else re.sub(r"^(Error while serializing: )?(I/O error: )?|\s*\(os error \d+\)$", "", text)
    return CheckpointWriteError(f"could not write {what}: {reason}")


def save_checkpoint(
    directory: str | os.PathLike, model: TransformerLM, tokenizer: Any | None = None,
    meta: dict[str, Any] | None = None, *,
    extra_tensors: dict[str, dict[str, torch.Tensor]] | None = None,
    extra_json: dict[str, Any] | None = None,
    state_dict: dict[str, torch.Tensor] | None = None,
    chat_template: str | None = None,
    staging: Path | None = None,
) -> Path:
    """Write model weights, config, tokenizer and a small JSON of metadata to `directory`, atomically.

    `extra_tensors` maps file names (e.g. "optimizer.safetensors") to tensors and `extra_json`
    maps file names to JSON-able objects; both land in the same atomic rename. `chat_template`
    is kept beside the tokenizer as chat_template.jinja (where transformers 5 keeps it). `state_dict`
    replaces `model.state_dict()` (a sharded model gathers its full weights first). The transforms
    applied to `model` (int8 ...) are recorded in the metadata under "transforms", for loading.

    `staging` (from `staging_directory(directory)`) is a staging directory that already holds the
    weights as a distributed checkpoint's shards (glasslm.io.sharded): the rest is written beside
    them and the whole directory moves into place at once; no model.safetensors is written.
    """
    meta = _meta_with_transforms(model, meta)
    target = Path(directory)
    target.parent.mkdir(parents=True, exist_ok=True)
    sharded, staging = staging is not None, staging or staging_directory(target)
    try:
        if not sharded:
            weights = state_dict if state_dict is not None else model.state_dict()
            weights = {name: t.detach().contiguous().cpu() for name, t in weights.items()}
            save_tensors(weights, staging / WEIGHTS_FILE, metadata={"format": "pt", "library": "glasslm"})
        (staging / CONFIG_FILE).write_text(model.config.to_json())
        if tokenizer is not None:
            tokenizer.save(staging)
            if getattr(tokenizer, "kind", None) in _HF_FORM_BESIDE:  # so AutoTokenizer reads the checkpoint too
                save_hf_tokenizer(tokenizer, staging, model.config.context_length)
        if chat_template is not None:
            (staging / CHAT_TEMPLATE_FILE).write_text(chat_template, encoding="utf-8")
        (staging / META_FILE).write_text(json.dumps(meta, indent=2))
        for name, tensors in (extra_tensors or {}).items():
            save_tensors({k: t.detach().contiguous().cpu() for k, t in tensors.items()}, staging / name)
        for name, obj in (extra_json or {}).items():
            (staging / name).write_text(json.dumps(obj, indent=1))
        _fsync_directory(staging)
        _swap_into_place(staging, target)
    except (OSError, SafetensorError) as err:
        shutil.rmtree(staging, ignore_errors=True)
        raise _write_failure(target, err) from err
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target


def save_tensors(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str] | None = None) -> None:
    """A safetensors file whose bytes depend only on `tensors` and `metadata`: the same tensors give the
    same file, so hashes of checkpoints and caches hold. (safetensors writes the header's
    `__metadata__` from a Rust HashMap, whose key order varies from one save to the next; the
    tensors' entries are already sorted.) The header is rewritten in place with the keys sorted:
    the same characters reordered, so its length and every tensor's offset stay as they were.

    >>> import tempfile, torch
    >>> path = Path(tempfile.mkdtemp()) / "t.safetensors"
    >>> save_tensors({"w": torch.ones(2)}, path, {"b": "2", "a": "1"})
    >>> header = path.read_bytes()
    >>> list(json.loads(header[8:8 + int.from_bytes(header[:8], "little")])["__metadata__"])
    ['a', 'b']
    """
    save_file(tensors, path, metadata=metadata)
    if not metadata or len(metadata) < 2:
        return
    with open(path, "r+b") as file:
        length = int.from_bytes(file.read(8), "little")
        header = json.loads(file.read(length))
        header = {"__metadata__": dict(sorted(header.pop("__metadata__").items())), **header}
        text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
        if len(text) > length:  # (serde_json and json.dumps escape alike; never seen)
            raise CheckpointWriteError(f"could not rewrite the header of {path} in place")
        file.seek(8)
        file.write(text.ljust(length, b" "))  # safetensors pads its header with spaces too


def staging_directory(target: Path) -> Path:
    """A new, empty directory beside `target` to write its files into before they move into place
    (a killed writer leaves it behind, marked as staging, and nothing at `target`)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{target.name}{STAGING_MARK}", dir=target.parent))


def _meta_with_transforms(model: TransformerLM, meta: dict[str, Any] | None) -> dict[str, Any]:
    """`meta` plus the model's transform record (absent where none was applied, as before transforms)."""
    meta = dict(meta or {})
    if TRANSFORMS_KEY in meta:
        raise ValueError(f"meta[{TRANSFORMS_KEY!r}] is written from the model's applied transforms; do not pass it")
    records = applied_transforms(model)
    if records:
        meta[TRANSFORMS_KEY] = records
    return meta


def recorded_transforms(meta: Any) -> list[dict[str, Any]]:
    """The transforms a checkpoint's metadata says were applied, in order.

    glasslm 0.1.0's `quantize` wrote its method alone, `"quantization": "int8"`; that reads as
    `[{"name": "int8"}]`.

    >>> recorded_transforms({"transforms": [{"name": "int4"}]}), recorded_transforms({"quantization": "int8"})
    ([{'name': 'int4'}], [{'name': 'int8'}])
    """
    if not isinstance(meta, dict):
        return []
    if TRANSFORMS_KEY in meta:
        records = meta[TRANSFORMS_KEY]
        if not isinstance(records, list):
            raise ValueError(f"{META_FILE}: {TRANSFORMS_KEY!r} should be a list of transforms, got {records!r}")
        return records
    if LEGACY_QUANTIZATION_KEY in meta:
        return [{"name": meta[LEGACY_QUANTIZATION_KEY]}]
    return []


def _fsync_directory(path: Path) -> None:
    """Flush the files of `path` to disk so a power cut after the rename cannot leave empty files."""
    for child in path.iterdir():
        if child.is_dir():  # a distributed checkpoint's shards
            _fsync_directory(child)
            continue
        with open(child, "rb") as f:
            os.fsync(f.fileno())


def _swap_into_place(staging: Path, target: Path) -> None:
    """Replace `target` by `staging`; at every instant one complete copy exists on disk."""
    old = None
    if target.exists():
        old = target.with_name(f".{target.name}{REPLACED_MARK}{os.getpid()}")
        os.replace(target, old)
    try:
        os.replace(staging, target)
    except BaseException:
        if old is not None:  # put the previous copy back rather than leave nothing at `target`
            os.replace(old, target)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def load_checkpoint(
    directory: str | os.PathLike, device: torch.device | str = "cpu"
) -> tuple[TransformerLM, Any | None, dict[str, Any]]:
    """(model, tokenizer or None, meta) from a directory written by `save_checkpoint`.

    `model.eos_token_ids` is where generation stops by default: the ids of a generation_config.json
    kept from a Hugging Face import, else the tokenizer's eos (`glasslm.tokenizers.eos_token_ids`).
    """
    path = resolve_checkpoint(directory)
    config = load_config(path / CONFIG_FILE)
    weights_path = path / WEIGHTS_FILE
    if not weights_path.is_file() and not is_sharded_checkpoint(path):
        raise FileNotFoundError(f"{weights_path} is missing: not a glasslm checkpoint?")
    meta_path = path / META_FILE
    meta = read_json(meta_path) if meta_path.is_file() else {}
    if isinstance(meta, dict) and ADAPTER_BASE_KEY in meta:
        raise ValueError(f"{path} holds only adapters for the base {meta[ADAPTER_BASE_KEY].get('path')!r}; "
                         "load it with glasslm.hf.load_model, which loads the base and applies them")
    # Built on the meta device, given the recorded transforms' structure (int8 layers ...), and
    # assigned the loaded tensors: no random init, no second copy.
    model = model_from_state_dict(config, read_weights(path, device), device, source=str(weights_path),
                                  transforms=recorded_transforms(meta))
    tokenizer = None
    if has_tokenizer(path):
        tokenizer = load_tokenizer(path)
    model.eos_token_ids = eos_token_ids(tokenizer, read_generation_config(path))
    return model, tokenizer, meta


def weights_sha256(state_dict: dict[str, torch.Tensor]) -> str:
    """A content hash of a model's weights (names, dtypes, shapes and bytes, in name order): what an
    adapter checkpoint records of its base, to refuse a base that has changed since.

    >>> import torch
    >>> weights_sha256({"w": torch.zeros(2)}) == weights_sha256({"w": torch.zeros(2)}) != weights_sha256({"w": torch.ones(2)})
    True
    """
    import hashlib

    digest = hashlib.sha256()
    for name in sorted(state_dict):
        tensor = state_dict[name].detach().contiguous().cpu()
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return digest.hexdigest()


def read_safetensors(path: Path, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """Tensors of a safetensors file, or an error naming the file and what is wrong with it."""
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: incomplete checkpoint?")
    try:
        return load_file(path, device=str(device))
    except (SafetensorError, OSError, ValueError, RuntimeError) as err:
        # Diagnosed only after safetensors refused it: a valid file starts with its header's length,
        # whose first byte may be 0x80 as well (this check ran first once and refused such a file).
        with open(path, "rb") as f:
            head = f.read(2)
        if (head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05")) or head == b"PK":
            raise ValueError(f"{path} is a pickle/torch.save file, not safetensors; glasslm never unpickles "
                             "checkpoint files (unpickling can run arbitrary code)") from None
        raise ValueError(f"{path} is not a readable safetensors file ({err}); truncated or corrupt?") from None


def read_weights(directory: Path, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """A checkpoint's model weights, whole: from model.safetensors, or assembled from the shards of
    a distributed run's checkpoint (glasslm.io.sharded)."""
    if is_sharded_checkpoint(directory) and not (directory / WEIGHTS_FILE).is_file():
        return strip_prefix(read_sharded_tensors(directory, MODEL_PREFIX, device), MODEL_PREFIX)
    return read_safetensors(directory / WEIGHTS_FILE, device)


def read_json(path: Path) -> Any:
    """Parsed JSON of `path`, or an error naming the file."""
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: incomplete checkpoint?")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path} is not valid JSON ({err}); truncated or corrupt?") from None


# ----- optimizer state as safetensors + JSON (no pickle) -----

def optimizer_state_to_files(state: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Split `optimizer.state_dict()` into tensors (for safetensors) and everything else (for JSON).

    >>> import torch
    >>> p = torch.nn.Parameter(torch.ones(2))
    >>> opt = torch.optim.AdamW([p]); p.grad = torch.ones(2); opt.step()
    >>> tensors, scalars = optimizer_state_to_files(opt.state_dict())
    >>> sorted(tensors)
    ['state.0.exp_avg', 'state.0.exp_avg_sq', 'state.0.step']
    >>> back = optimizer_state_from_files(tensors, scalars)
    >>> torch.equal(back["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])
    True
    """
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for param_id, param_state in state["state"].items():
        for key, value in param_state.items():
            if isinstance(value, torch.Tensor):
                tensors[f"state.{param_id}.{key}"] = value
            else:
                scalars.setdefault(str(param_id), {})[key] = value
    return tensors, {"param_groups": state["param_groups"], "scalar_state": scalars}


def optimizer_state_from_files(tensors: dict[str, torch.Tensor], scalars: dict[str, Any]) -> dict[str, Any]:
    """Inverse of `optimizer_state_to_files`: a dict for `optimizer.load_state_dict`."""
    state: dict[int, dict[str, Any]] = {}
    for name, tensor in tensors.items():
        if not name.startswith("state."):
            raise ValueError(f"unexpected optimizer tensor {name!r}")
        # Parameters are numbered (plain state dicts) or named with dots (sharded state dicts);
        # the state key itself ("exp_avg") never has a dot.
        param_id, key = name[len("state."):].rsplit(".", 1)
        state.setdefault(_param_key(param_id), {})[key] = tensor
    for param_id, values in scalars.get("scalar_state", {}).items():
        state.setdefault(_param_key(param_id), {}).update(values)
    groups = []
    for group in scalars["param_groups"]:
        group = dict(group)
        if isinstance(group.get("betas"), list):  # JSON has no tuples; AdamW expects one
            group["betas"] = tuple(group["betas"])
        groups.append(group)
    return {"state": state, "param_groups": groups}


def _param_key(text: str) -> int | str:
    return int(text) if text.isdigit() else text


def load_optimizer_state(directory: str | os.PathLike) -> dict[str, Any]:
    """The optimizer state dict stored in a training checkpoint (whole tensors; a distributed run's
    names its parameters as the model's state dict does, a single process's numbers them)."""
    path = Path(directory)
    scalars = read_json(path / OPTIMIZER_JSON)
    if not isinstance(scalars, dict) or "param_groups" not in scalars:
        raise ValueError(f"{path / OPTIMIZER_JSON} does not hold optimizer param_groups")
    if is_sharded_checkpoint(path) and not (path / OPTIMIZER_FILE).is_file():
        tensors = strip_prefix(read_sharded_tensors(path, OPTIMIZER_PREFIX), OPTIMIZER_PREFIX)
    else:
        tensors = read_safetensors(path / OPTIMIZER_FILE)
    return optimizer_state_from_files(tensors, scalars)


# ----- run directories: numbered checkpoints, `latest` and `best` pointers, pruning -----

def checkpoint_name(step: int) -> str:
    return f"{CHECKPOINT_PREFIX}{step:06d}"


def write_pointer(run_dir: str | os.PathLike, pointer: str, checkpoint_dir_name: str) -> None:
    """Atomically make `run_dir/pointer` (latest or best) name a checkpoint directory."""
    run_dir = Path(run_dir)
    tmp = run_dir / f".{pointer}{STAGING_MARK}{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            f.write(checkpoint_dir_name + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, run_dir / pointer)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        raise _write_failure(run_dir / pointer, err) from err


def read_pointer(run_dir: str | os.PathLike, pointer: str) -> Path | None:
    path = Path(run_dir) / pointer
    if not path.is_file():
        return None
    name = path.read_text().strip()
    if not name or "/" in name or name.startswith("."):
        raise ValueError(f"{path} should hold a checkpoint directory name, got {name!r}")
    return Path(run_dir) / name


def resolve_checkpoint(path: str | os.PathLike, prefer: tuple[str, ...] = ("best", "latest")) -> Path:
    """A checkpoint directory from a checkpoint directory, a pointer file, or a run directory.

    A run directory resolves through its pointer files in the order of `prefer`: sampling
    wants the best weights, resuming wants the latest. One with no pointer (a run killed after its
    first checkpoint was renamed into place, before `latest` named it) resolves to its newest
    numbered checkpoint.
    """
    path = Path(path)
    if path.is_file() and path.name in POINTER_NAMES:
        target = read_pointer(path.parent, path.name)
        assert target is not None
        return target
    if path.is_file():
        raise FileNotFoundError(f"{path} is a file; a checkpoint is a directory (a run directory, or one of its "
                                f"{CHECKPOINT_PREFIX}* directories, or its latest/best pointer file)")
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint directory {path} does not exist")
    if any((path / name).exists() for name in (CONFIG_FILE, LEGACY_CONFIG_FILE, WEIGHTS_FILE)):
        return path
    for pointer in prefer:
        target = read_pointer(path, pointer)
        if target is not None:
            if not target.is_dir():
                raise FileNotFoundError(f"{path / pointer} names {target.name}, which does not exist")
            return target
    newest = newest_checkpoint(path)
    if newest is not None:  # killed after a checkpoint's rename, before its pointers: still a run
        return newest
    raise FileNotFoundError(f"{path} is neither a checkpoint nor a run directory (no {' or '.join(prefer)} pointer, "
                            f"no {CHECKPOINT_PREFIX}NNNNNN checkpoint)")


def numbered_checkpoints(run_dir: str | os.PathLike) -> list[Path]:
    """The run directory's numbered checkpoints that hold a model, oldest first. Each is complete:
    a checkpoint is staged under a hidden name and only renamed to its number once fully written.

    >>> run = Path(tempfile.mkdtemp())
    >>> for name in ("ckpt-000002", "ckpt-000010", ".ckpt-000012.tmp-1", "notes"):
    ...     (run / name).mkdir()
    ...     _ = (run / name / CONFIG_FILE).write_text("{}"), (run / name / WEIGHTS_FILE).write_text("")
    >>> [p.name for p in numbered_checkpoints(run)], newest_checkpoint(run).name
    (['ckpt-000002', 'ckpt-000010'], 'ckpt-000010')
    """
    found = [p for p in Path(run_dir).glob(f"{CHECKPOINT_PREFIX}*") if _NUMBERED.fullmatch(p.name) and p.is_dir()]
    return sorted((p for p in found if (p / CONFIG_FILE).is_file() and (p / WEIGHTS_FILE).is_file()),
                  key=lambda p: int(p.name[len(CHECKPOINT_PREFIX):]))


def newest_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    """The highest-numbered complete checkpoint of a run directory, if it has one."""
    numbered = numbered_checkpoints(run_dir)
    return numbered[-1] if numbered else None


def prune_checkpoints(run_dir: str | os.PathLike, keep_last: int) -> list[Path]:
    """Delete all but the newest `keep_last` numbered checkpoints, never one a pointer names nor one
    that a LoRA run still uses as its base (`record_adapter_run`)."""
    run_dir = Path(run_dir)
    protected = {read_pointer(run_dir, p) for p in POINTER_NAMES} - {None}
    numbered = sorted(p for p in run_dir.glob(f"{CHECKPOINT_PREFIX}*") if p.is_dir())
    doomed = [p for p in numbered[:-keep_last] if p not in protected and not adapter_runs_using(p)] \
        if keep_last > 0 else []
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)
    return doomed


def record_adapter_run(checkpoint: str | os.PathLike, run_dir: str | os.PathLike) -> bool:
    """Note in a numbered checkpoint that the LoRA run `run_dir` is trained on it, so that its own
    run's `--keep-last` never prunes it while that run uses it. Only numbered checkpoints of a run
    directory are noted (nothing else is pruned). False where the note could not be written."""
    checkpoint = Path(checkpoint)
    if not (checkpoint.name.startswith(CHECKPOINT_PREFIX) and (checkpoint.parent / "latest").is_file()):
        return True
    runs = _noted_runs(checkpoint)
    if str(Path(run_dir).resolve()) in runs:
        return True
    tmp = checkpoint / f".{ADAPTER_RUNS_FILE}{STAGING_MARK}{os.getpid()}"
    try:
        tmp.write_text(json.dumps({"runs": [*runs, str(Path(run_dir).resolve())]}, indent=1))
        os.replace(tmp, checkpoint / ADAPTER_RUNS_FILE)
    except OSError:
        tmp.unlink(missing_ok=True)
        return False
    return True


def adapter_runs_using(checkpoint: Path) -> list[Path]:
    """The LoRA runs noted in `checkpoint` that still exist and whose newest checkpoint still names
    it as the base (a deleted or overwritten run no longer keeps it)."""
    using = []
    for run in map(Path, _noted_runs(checkpoint)):
        try:
            meta = read_json(resolve_checkpoint(run, prefer=("latest",)) / META_FILE)
        except (FileNotFoundError, ValueError):
            continue
        base = meta.get(ADAPTER_BASE_KEY) if isinstance(meta, dict) else None
        if isinstance(base, dict) and base.get("path") == str(checkpoint.resolve()):
            using.append(run)
    return using


def _noted_runs(checkpoint: Path) -> list[str]:
    try:
        runs = json.loads((checkpoint / ADAPTER_RUNS_FILE).read_text(encoding="utf-8")).get("runs", [])
    except (OSError, ValueError, AttributeError):
        return []
    return [r for r in runs if isinstance(r, str)] if isinstance(runs, list) else []


def remove_stale_staging(run_dir: str | os.PathLike) -> None:
    """Remove half-written checkpoints a killed process left behind (never renamed into place)."""
    checkpoints = (f".{CHECKPOINT_PREFIX}*{STAGING_MARK}*", f".{CHECKPOINT_PREFIX}*{REPLACED_MARK}*")
    for pattern in (*checkpoints, *(f".{pointer}{STAGING_MARK}*" for pointer in POINTER_NAMES)):
        for path in Path(run_dir).glob(pattern):
            shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)


def load_config(path: Path) -> ModelConfig:
    """The model config in the file `path` (a checkpoint's `glasslm_config.json`; beside a checkpoint
    written before that name, its `config.json`)."""
    if path.name == CONFIG_FILE and not path.is_file() and (path.parent / LEGACY_CONFIG_FILE).is_file():
        path = path.parent / LEGACY_CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: not a glasslm checkpoint?")
    data = read_json(path)
    if not isinstance(data, dict):
        raise ValueError(f"{path} does not hold a glasslm model config")
    try:
        return ModelConfig.from_dict(data)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{path} is not a glasslm model config: {err}") from None
