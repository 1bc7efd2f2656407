"""`glasslm fetch [NAMES]`: put known datasets into the data directory."""

from __future__ import annotations

from dataclasses import dataclass, field

from glasslm.cli.command import Command


@dataclass
class FetchConfig:
    """what to fetch"""

    names: list[str] = field(default_factory=list, metadata={"positional": True})  # dataset names; none: all known
    source: str | None = field(default=None, metadata={"option": "--from"})  # copy from this local folder instead
                                                                             # of downloading (sha256 still checked);
                                                                             # none: download
    data_dir: str | None = None  # where datasets are kept; none: $GLASSLM_DATA_DIR, else ~/.cache/glasslm


def fetch(config: FetchConfig) -> int:
    from glasslm.data import DATASETS, fetch_dataset
    from glasslm.locations import DATA_DIR_RULE, data_dir

    print(f"data directory: {data_dir(config.data_dir)} ({DATA_DIR_RULE})")
    for name in config.names or list(DATASETS):
        path = fetch_dataset(name, config.data_dir, source_dir=config.source)
        print(f"{name}: {path} (sha256 verified)")
    return 0


COMMAND = Command("fetch", fetch, "put known datasets into the data directory (download, or copy with --from)")
