"""Known datasets: fetched from their public URL once, checked against a sha256, and kept in the
data directory (`glasslm.locations.data_dir`: `--data-dir`, else $GLASSLM_DATA_DIR, else
~/.cache/glasslm). Offline, the error says exactly where to put the file; `glasslm fetch NAME
--from DIR` copies a verified copy in from a local folder.

Example:
    >>> sorted(DATASETS), sorted(FILE_SETS)
    (['tinyshakespeare'], ['gpt2'])
    >>> resolve_text("no/such/file.txt")
    Traceback (most recent call last):
    ...
    FileNotFoundError: 'no/such/file.txt' is neither a known dataset (tinyshakespeare) nor a file
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from glasslm.data.prepared import check_prepared, is_prepared
from glasslm.locations import DATA_DIR_RULE, data_dir
from glasslm.tokenizers.gpt2 import GPT2_SHA256


@dataclass(frozen=True)
class DatasetInfo:
    filename: str  # where it is kept, relative to the data directory
    url: str
    sha256: str
    also_accepted: tuple[str, ...] = ()  # other sha256s of the same content (e.g. without a header line)


DATASETS: dict[str, DatasetInfo] = {
    "tinyshakespeare": DatasetInfo(
        filename="tinyshakespeare.txt",
        url="https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt",
        sha256="86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed",
    ),
}

_GPT2_RELEASE = "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/"
# Known files that are not texts to train on: several files each, fetched the same way. gpt2 is
# GPT-2's released tokenizer (encoder.json, vocab.bpe), kept where `gpt2_tokenizer()` looks.
FILE_SETS: dict[str, tuple[DatasetInfo, ...]] = {
    "gpt2": (
        DatasetInfo("gpt2/gpt2_vocab.json", _GPT2_RELEASE + "encoder.json", GPT2_SHA256["encoder.json"]),
        DatasetInfo("gpt2/gpt2_merges.txt", _GPT2_RELEASE + "vocab.bpe", GPT2_SHA256["vocab.bpe"],
                    also_accepted=(GPT2_SHA256["vocab.bpe (no header)"],)),
    ),
}


def known_names() -> list[str]:
    """Every name `glasslm fetch` knows: the text datasets, then the file sets."""
    return [*DATASETS, *FILE_SETS]


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def fetch_dataset(name: str, directory: str | os.PathLike | None = None,
                  source_dir: str | os.PathLike | None = None) -> Path:
    """Path to a known dataset's file (for a file set such as gpt2: its folder), downloading and
    verifying it first if it is not there.

    With `source_dir`, a missing file is copied from that local folder (and verified) instead of
    downloaded: how the scripts seed the data directory from a shared copy on offline machines.
    """
    if name in FILE_SETS:
        paths = [_fetch_file(name, info, directory, source_dir, FILE_SETS[name]) for info in FILE_SETS[name]]
        return paths[0].parent
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; known: {', '.join(known_names())}")
    return _fetch_file(name, DATASETS[name], directory, source_dir)


def held_by(name: str, source_dir: str | os.PathLike) -> bool:
    """Whether a local folder holds every file of dataset `name` (for `glasslm fetch --from`)."""
    infos = FILE_SETS.get(name) or (DATASETS[name],)
    return all(_source_file(info, Path(source_dir)) is not None for info in infos)


def _source_file(info: DatasetInfo, source_dir: Path) -> Path | None:
    """The file in `source_dir` that holds `info`: under its data-directory name, its bare name, or
    the name it has at its URL (encoder.json)."""
    for candidate in (info.filename, Path(info.filename).name, info.url.rsplit("/", 1)[-1]):
        if (source_dir / candidate).is_file():
            return source_dir / candidate
    return None


def _fetch_file(name: str, info: DatasetInfo, directory: str | os.PathLike | None,
                source_dir: str | os.PathLike | None, needed: tuple[DatasetInfo, ...] = ()) -> Path:
    """`info`'s file in the data directory, downloaded or copied in first; `needed`: every file of
    its set, which an offline error names (each is needed, not only the one that failed)."""
    target = data_dir(directory) / info.filename
    accepted = (info.sha256, *info.also_accepted)
    if target.is_file():
        found = sha256_of(target)
        if found not in accepted:
            raise ValueError(f"{target} has sha256 {found}, expected {info.sha256}: delete it to re-download")
        return target
    if source_dir is not None:
        source = _source_file(info, Path(source_dir))
        origin = str(source if source is not None else Path(source_dir) / info.filename)
    else:
        origin = info.url
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = tempfile.NamedTemporaryFile(dir=target.parent, prefix=f".{Path(info.filename).name}.", suffix=".tmp",
                                      delete=False)
    try:
        with tmp:
            if source_dir is not None:
                with open(origin, "rb") as f:
                    shutil.copyfileobj(f, tmp)
            else:
                with urllib.request.urlopen(info.url, timeout=30) as response:
                    shutil.copyfileobj(response, tmp)
        found = sha256_of(Path(tmp.name))
        if found not in accepted:
            raise ValueError(f"{origin} has sha256 {found}, expected {info.sha256}")
        os.replace(tmp.name, target)
    except (urllib.error.URLError, OSError) as err:
        Path(tmp.name).unlink(missing_ok=True)
        if source_dir is not None:
            raise
        raise RuntimeError(f"could not download dataset {name!r} from {info.url} ({err}); if this machine is offline, "
                           f"{_offline_advice(name, needed or (info,), data_dir(directory))}") from None
    except BaseException:
        Path(tmp.name).unlink(missing_ok=True)
        raise
    return target


def _offline_advice(name: str, infos: tuple[DatasetInfo, ...], directory: Path) -> str:
    """One line: the exact path every file of the dataset must have, the rule, and the copy command.

    >>> print(_offline_advice("gpt2", FILE_SETS["gpt2"], Path("/data")))
    put both of its files in place, encoder.json as /data/gpt2/gpt2_vocab.json and vocab.bpe as /data/gpt2/gpt2_merges.txt (data directory: --data-dir, else $GLASSLM_DATA_DIR, else ~/.cache/glasslm), or copy them in with: glasslm fetch gpt2 --from DIR (DIR holding encoder.json and vocab.bpe, under either name)
    """
    if len(infos) == 1:
        return (f"put {Path(infos[0].filename).name} at {directory / infos[0].filename} (data directory: "
                f"{DATA_DIR_RULE}), or copy it in with: glasslm fetch {name} --from DIR")
    released = [i.url.rsplit("/", 1)[-1] for i in infos]
    places = " and ".join(f"{r} as {directory / i.filename}" for r, i in zip(released, infos))
    return (f"put {'both' if len(infos) == 2 else 'all'} of its files in place, {places} (data directory: "
            f"{DATA_DIR_RULE}), or copy them in with: glasslm fetch {name} --from DIR (DIR holding "
            f"{' and '.join(released)}, under either name)")


def resolve_text(source: str | os.PathLike, directory: str | os.PathLike | None = None) -> Path:
    """A dataset name from DATASETS or a path to a text file."""
    if isinstance(source, str) and source in DATASETS:
        return fetch_dataset(source, directory)
    path = Path(source)
    if path.is_dir():
        check_prepared(path)  # names an interrupted `prepare` as such
        if is_prepared(path):
            raise ValueError(f"{path} is a prepared dataset (token files), not a text file")
        raise ValueError(f"{path} is a directory, not a text file or a dataset made by `glasslm prepare`")
    if not path.is_file():
        raise FileNotFoundError(f"{str(source)!r} is neither a known dataset ({', '.join(DATASETS)}) nor a file")
    return path
