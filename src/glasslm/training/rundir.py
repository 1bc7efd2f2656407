"""Who may write a run directory: refusing to train over an existing run, and one writer at a time.

A run directory (checkpoints, `latest`/`best` pointers, metrics.jsonl) is the record of a run, so
training into one that already holds files is refused unless the caller resumes it or asks for
`overwrite` (which removes glasslm's own files there and nothing else). While a run trains, it
holds an exclusive lock (`flock` on `.lock` in the directory) so a second `glasslm train` on the
same directory is refused instead of interleaving metrics and racing on checkpoint renames. The
lock belongs to the open file, so the kernel releases it when the process ends, however it ends.

A run stopped before its first checkpoint leaves a directory with nothing to resume (metrics.jsonl,
the lock, maybe a half-written checkpoint's staging directory). Training into it starts afresh:
the staging directories go and its metrics are kept aside as metrics.jsonl.unfinished.

Example:
    >>> import tempfile
    >>> from pathlib import Path
    >>> run = Path(tempfile.mkdtemp()) / "run"
    >>> with RunLock(run):
    ...     check_run_dir(run, resuming=False)   # only the lock file so far: counts as empty
    ...     (run / "metrics.jsonl").write_text("")
    0
    >>> check_run_dir(run, resuming=False)   # metrics but no checkpoint: nothing to resume, may start afresh
    >>> (run / "ckpt-000010").mkdir()
    >>> check_run_dir(run, resuming=False)
    Traceback (most recent call last):
    ...
    glasslm.training.rundir.RunDirError: run directory ... is not empty (ckpt-000010, metrics.jsonl); continue that run with --resume ..., or replace it with --overwrite
"""

from __future__ import annotations

import errno
import fcntl
import math
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from glasslm.core.config import ModelConfig
from glasslm.io.checkpoint import (
    CHECKPOINT_PREFIX, CONFIG_FILE, META_FILE, POINTER_NAMES, STAGING_MARK, TRAINER_STATE_JSON, WEIGHTS_FILE, load_config,
    numbered_checkpoints, read_json, read_pointer, resolve_checkpoint, write_pointer,
)
from glasslm.training.config import TrainConfig
from glasslm.training.loggers import METRICS_FILE

LOCK_FILE = ".lock"
UNFINISHED_SUFFIX = ".unfinished"  # metrics.jsonl of a run stopped before its first checkpoint, kept aside
# What a training run writes into its directory; --overwrite removes these and nothing else.
RUN_FILES = (*POINTER_NAMES, METRICS_FILE, "loss.png", "tensorboard", "wandb")
# A checkpoint or pointer being written (see glasslm.io.checkpoint's staging names).
STAGING_PATTERNS = (f".{CHECKPOINT_PREFIX}*", *(f".{pointer}{STAGING_MARK}*" for pointer in POINTER_NAMES))
RUN_PATTERNS = (f"{CHECKPOINT_PREFIX}*", *STAGING_PATTERNS, METRICS_FILE + UNFINISHED_SUFFIX + "*")


class RunDirError(ValueError):
    """The run directory cannot be used as asked (not empty, locked, not a directory)."""


def _contents(run_dir: Path) -> list[str]:
    return sorted(p.name for p in run_dir.iterdir() if p.name != LOCK_FILE)


def check_run_dir(run_dir: str | os.PathLike, resuming: bool, overwrite: bool = False) -> None:
    """Refuse a `run_dir` that is a file, or that already holds files when neither resuming nor
    overwriting. Reads only: nothing on disk changes, whatever the verdict."""
    run_dir = Path(run_dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise RunDirError(f"run directory {run_dir} is a file, not a directory")
    for parent in run_dir.parents:
        if parent.exists():
            if not parent.is_dir():
                raise RunDirError(f"run directory {run_dir} cannot be created: {parent} is a file")
            break
    if not run_dir.is_dir():
        return
    _refuse_if_locked(run_dir)
    if resuming or overwrite:
        return
    contents = _contents(run_dir)
    if contents and not holds_no_checkpoint(run_dir):
        shown = ", ".join(contents[:3]) + (", ..." if len(contents) > 3 else "")
        if _checkpoints_in(run_dir):
            raise RunDirError(f"run directory {run_dir} is not empty ({shown}); continue that run with "
                              f"--resume {run_dir}, or replace it with --overwrite")
        raise RunDirError(f"run directory {run_dir} is not empty ({shown}) and holds no checkpoint to resume; "
                          "use another --out, or --overwrite to remove glasslm's files there")


def _checkpoints_in(run_dir: Path) -> list[str]:
    return sorted(p.name for p in run_dir.iterdir() if p.name in POINTER_NAMES or p.name.startswith(CHECKPOINT_PREFIX))


def holds_no_checkpoint(run_dir: str | os.PathLike) -> bool:
    """Whether `run_dir` holds only what a run stopped before its first checkpoint leaves (metrics,
    plots, logger folders, staging directories, the lock): nothing to resume, so a new run may
    start there afresh (see `set_aside_unfinished`).

    >>> import tempfile
    >>> run = Path(tempfile.mkdtemp())
    >>> (run / "metrics.jsonl").write_text("")
    0
    >>> holds_no_checkpoint(run), (run / ".ckpt-000010").mkdir(), holds_no_checkpoint(run)
    (True, None, True)
    >>> (run / "ckpt-000010").mkdir()
    >>> holds_no_checkpoint(run)
    False
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return False
    leftovers = set(RUN_FILES) - {"latest", "best"}
    names = _contents(run_dir)
    return bool(names) and all(name in leftovers or _is_staging_or_aside(run_dir / name) for name in names)


def _is_staging_or_aside(path: Path) -> bool:
    return any(path.match(pattern) for pattern in (*STAGING_PATTERNS, METRICS_FILE + UNFINISHED_SUFFIX + "*"))


def set_aside_unfinished(run_dir: str | os.PathLike) -> str | None:
    """Make a directory that `holds_no_checkpoint` ready for a new run: remove the staging
    directories and rename metrics.jsonl to metrics.jsonl.unfinished (-2, -3 ... if taken).
    Returns the new name of the metrics file, if there was one."""
    run_dir = Path(run_dir)
    for pattern in STAGING_PATTERNS:
        for path in run_dir.glob(pattern):
            shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
    metrics = run_dir / METRICS_FILE
    if not metrics.exists():
        return None
    aside, n = run_dir / (METRICS_FILE + UNFINISHED_SUFFIX), 1
    while aside.exists():
        n += 1
        aside = run_dir / f"{METRICS_FILE}{UNFINISHED_SUFFIX}-{n}"
    metrics.rename(aside)
    return aside.name


def _refuse_if_locked(run_dir: Path) -> None:
    """Probe the lock without creating or changing anything (the lock file opened read-only)."""
    path = run_dir / LOCK_FILE
    if not path.is_file() or run_dir.resolve() in RunLock._held:
        return
    with open(path) as file:
        try:
            fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = file.read().strip() or "unknown"
            raise RunDirError(f"{run_dir} is in use by another training process (pid {holder}); "
                              "wait for it to finish or use another --out") from None
        fcntl.flock(file, fcntl.LOCK_UN)


@contextmanager
def claim_run_dir(run_dir: str | os.PathLike, resume_from: str | os.PathLike | None = None,
                  overwrite: bool = False) -> Iterator[Path]:
    """Check `run_dir` may be written, lock it for the duration, and clear it if `overwrite`.

    Resuming exempts the directory from the not-empty rule only when it is the resumed
    checkpoint's own run directory; resuming *into* another run's directory still needs
    `overwrite`. A claim this process already holds is simply re-entered.
    """
    run_dir = Path(run_dir)
    if run_dir.is_dir() and run_dir.resolve() in RunLock._held:
        with RunLock(run_dir):
            yield run_dir
        return
    resuming_here = False
    if resume_from is not None:
        checkpoint = Path(resume_from).resolve()
        resuming_here = run_dir.resolve() in (checkpoint, checkpoint.parent)
    if overwrite and resuming_here:
        raise RunDirError(f"--overwrite would delete {run_dir}, the run being resumed; drop --overwrite "
                          "(or resume into another --out)")
    check_run_dir(run_dir, resuming=resuming_here, overwrite=overwrite)
    with RunLock(run_dir):
        if overwrite:
            clear_run(run_dir)
        elif not resuming_here and holds_no_checkpoint(run_dir):
            set_aside_unfinished(run_dir)
        elif resuming_here:
            restore_pointers(run_dir, Path(resume_from))
        yield run_dir


def restore_pointers(run_dir: str | os.PathLike, checkpoint: str | os.PathLike) -> list[str]:
    """Write the pointers a run killed between a checkpoint's rename and its pointers never wrote,
    when resuming from `checkpoint` in `run_dir`: `latest` names the checkpoint resumed from, and a
    missing `best` the earliest checkpoint holding the best validation loss the run recorded.
    Pointers that exist are left alone. Returns the pointers written.

    >>> import json, tempfile
    >>> run = Path(tempfile.mkdtemp())
    >>> for step, val_loss in ((3, 2.5), (6, 2.25), (9, 2.25)):   # ckpt-000009: no evaluation since step 6
    ...     files = {CONFIG_FILE: "{}", WEIGHTS_FILE: "", META_FILE: json.dumps({"val_loss": val_loss}),
    ...              TRAINER_STATE_JSON: json.dumps({"best_val_loss": 2.25})}
    ...     (run / f"ckpt-{step:06d}").mkdir()
    ...     _ = [(run / f"ckpt-{step:06d}" / name).write_text(text) for name, text in files.items()]
    >>> restore_pointers(run, run / "ckpt-000009"), read_pointer(run, "latest").name, read_pointer(run, "best").name
    (['latest', 'best'], 'ckpt-000009', 'ckpt-000006')
    >>> restore_pointers(run, run / "ckpt-000009")
    []
    """
    run_dir, checkpoint = Path(run_dir), Path(checkpoint)
    if checkpoint.parent.resolve() != run_dir.resolve():
        return []
    written = []
    if read_pointer(run_dir, "latest") is None:
        write_pointer(run_dir, "latest", checkpoint.name)
        written.append("latest")
    best = _best_checkpoint(run_dir, checkpoint) if read_pointer(run_dir, "best") is None else None
    if best is not None:
        write_pointer(run_dir, "best", best.name)
        written.append("best")
    return written


def _best_checkpoint(run_dir: Path, checkpoint: Path) -> Path | None:
    """The earliest checkpoint up to `checkpoint` whose validation loss is the run's best so far."""
    state = read_json(checkpoint / TRAINER_STATE_JSON) if (checkpoint / TRAINER_STATE_JSON).is_file() else None
    best = state.get("best_val_loss") if isinstance(state, dict) else None
    if not isinstance(best, (int, float)) or not math.isfinite(best):
        return None  # no evaluation yet: a run without one has no `best`
    for candidate in numbered_checkpoints(run_dir):
        meta = read_json(candidate / META_FILE) if (candidate / META_FILE).is_file() else None
        if isinstance(meta, dict) and meta.get("val_loss") == best:
            return candidate
        if candidate.name == checkpoint.name:
            break
    return None


def clear_run(run_dir: str | os.PathLike) -> list[str]:
    """Remove what a previous run wrote into `run_dir` (checkpoints, pointers, metrics, plots,
    logger folders); other files stay. Returns the names removed."""
    run_dir = Path(run_dir)
    doomed = [run_dir / name for name in RUN_FILES if (run_dir / name).exists()]
    for pattern in RUN_PATTERNS:
        doomed += sorted(run_dir.glob(pattern))
    for path in doomed:
        shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
    return [p.name for p in doomed]


class RunLock:
    """An exclusive, non-blocking lock on a run directory (created if missing) for one writer.

    Re-entrant within a process: the CLI takes it before creating loggers and `train` takes it
    again; the inner one is a no-op.
    """

    _held: dict[Path, int] = {}  # resolved run directory -> how many holders in this process

    def __init__(self, run_dir: str | os.PathLike):
        self.run_dir = Path(run_dir)
        self._file = None
        self._key: Path | None = None

    def __enter__(self) -> "RunLock":
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise RunDirError(f"cannot create run directory {self.run_dir}: {err.strerror}") from None
        self._key = self.run_dir.resolve()
        if self._key in RunLock._held:
            RunLock._held[self._key] += 1
            return self
        path = self.run_dir / LOCK_FILE
        try:
            file = open(path, "a+")
        except OSError as err:
            raise RunDirError(f"cannot write to run directory {self.run_dir}: {err.strerror}") from None
        try:
            fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            file.seek(0)
            holder = file.read().strip() or "unknown"
            file.close()
            if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise RunDirError(f"{self.run_dir} is in use by another training process (pid {holder}); "
                                  "wait for it to finish or use another --out") from None
            raise
        file.seek(0)
        file.truncate()
        file.write(f"{os.getpid()}\n")
        file.flush()
        self._file = file
        RunLock._held[self._key] = 1
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._key is not None
        RunLock._held[self._key] -= 1
        if RunLock._held[self._key] == 0:
            del RunLock._held[self._key]
            if self._file is not None:
                self._file.close()  # closing the file releases the flock


@dataclass
class ResumedRun:
    """What a checkpoint records about the run it continues (see `read_resumed_run`)."""

    checkpoint: Path  # the checkpoint directory training continues from
    meta: dict[str, Any]  # its meta.json: preset, data, val_fraction, ...
    model_config: ModelConfig
    train_config: TrainConfig  # the run's settings when the checkpoint was saved
    saved_train_config: dict[str, Any]  # the same as saved (glasslm.training.loop.schedule_end reads it)
    step: int = 0  # the step the checkpoint was saved after


def read_resumed_run(path: str | os.PathLike) -> ResumedRun:
    """The checkpoint at `path` (a run directory resumes its latest) and the run it records.

    A run directory that `holds_no_checkpoint` is refused with the way out: start it afresh.
    """
    if holds_no_checkpoint(path):
        raise RunDirError(f"{path} holds no checkpoint (its run stopped before the first save), so there is nothing "
                          f"to resume; start it afresh: glasslm train --out {path} without --resume (its "
                          f"{METRICS_FILE} is kept aside)")
    checkpoint = resolve_checkpoint(path, prefer=("latest",))
    state = read_json(checkpoint / TRAINER_STATE_JSON)
    missing = [k for k in ("step", "best_val_loss", "elapsed_s", "train_config")
               if not isinstance(state, dict) or k not in state]
    if missing:
        raise ValueError(f"{checkpoint / TRAINER_STATE_JSON} lacks {', '.join(missing)}: not a complete "
                         "training checkpoint, so it cannot be resumed")
    saved = TrainConfig.from_dict(state["train_config"], f"{checkpoint / TRAINER_STATE_JSON}")
    return ResumedRun(checkpoint, read_json(checkpoint / META_FILE), load_config(checkpoint / CONFIG_FILE),
                      saved, state["train_config"], int(state["step"]))
