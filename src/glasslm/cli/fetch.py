"""`glasslm fetch [NAMES]`: put known datasets into the data directory."""

from __future__ import annotations

from dataclasses import dataclass, field

from glasslm.cli.command import Command


@dataclass
class FetchConfig:
    """what to fetch"""

    # dataset names (tinyshakespeare; gpt2: GPT-2's tokenizer files); none: every known one (with
    # --from: every one that folder holds)
    names: list[str] = field(default_factory=list, metadata={"positional": True})
    source: str | None = field(default=None, metadata={"option": "--from"})  # copy from this local folder instead
                                                                             # of downloading (sha256 still checked);
                                                                             # none: download
    data_dir: str | None = None  # where datasets are kept; none: $GLASSLM_DATA_DIR, else ~/.cache/glasslm


def fetch(config: FetchConfig) -> int:
    from glasslm.data import fetch_dataset, held_by, known_names
    from glasslm.locations import DATA_DIR_RULE, data_dir

    print(f"data directory: {data_dir(config.data_dir)} ({DATA_DIR_RULE})")
    names = config.names or known_names()
    if config.source is not None and not config.names:
        names = [name for name in names if held_by(name, config.source)]
        if not names:
            raise FileNotFoundError(f"--from {config.source} holds none of the known datasets "
                                    f"({', '.join(known_names())})")
    for name in names:
        path = fetch_dataset(name, config.data_dir, source_dir=config.source)
        print(f"{name}: {path} (sha256 verified)")
    return 0


COMMAND = Command("fetch", fetch, "put known datasets into the data directory (download, or copy with --from)",
                  examples=(
                      "glasslm fetch tinyshakespeare",
                      "glasslm fetch gpt2                      # GPT-2's tokenizer (for --tokenizer gpt2)",
                      "glasslm fetch --from ../shared/data     # offline: copy every known dataset that folder holds",
                  ))
