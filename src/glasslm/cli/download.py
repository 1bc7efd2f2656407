"""`glasslm download REPO_ID`: a model from the Hugging Face Hub into the HF cache, after which every
`--checkpoint` takes its name."""

from __future__ import annotations

import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

from glasslm.cli.command import Command


@dataclass
class DownloadConfig:
    """what to download"""

    repo_id: str = field(metadata={"positional": True})  # the hub repository, org/name
    revision: str | None = field(default=None, metadata={"metavar": "REV"})  # a branch, tag or commit; none: main
    # only files matching this glob (e.g. "*Q4_K_M.gguf"); none: every file
    include: list[str] = field(default_factory=list, metadata={"metavar": "GLOB"})
    exclude: list[str] = field(default_factory=list, metadata={"metavar": "GLOB"})  # no file matching this glob


def download(config: DownloadConfig) -> int:
    from glasslm.hf.hub import download_snapshot

    snapshot = download_snapshot(config.repo_id, config.revision, config.include, config.exclude)
    if snapshot.unchecked_because:
        print(f"{snapshot.unchecked_because}: using the snapshot already in the cache, "
              "not checked for a newer revision", file=sys.stderr)
    files = snapshot.files()
    size = sum(f.stat().st_size for f in files)
    print(f"{config.repo_id} at commit {snapshot.commit}: {len(files)} files, {size / 1e6:,.1f} MB in {snapshot.path}")
    for line in next_steps(config.repo_id, config.revision, snapshot.path):
        print(line)
    return 0


def next_steps(repo_id: str, revision: str | None, snapshot: Path) -> list[str]:
    """What to type next: the hub name as --checkpoint, or the file to pick among several GGUF files."""
    from glasslm.tokenizers.chat import find_chat_template

    ggufs = sorted(snapshot.rglob("*.gguf"))
    checkpoint = repo_id + (f" --revision {shlex.quote(revision)}" if revision else "")
    if (snapshot / "config.json").is_file():
        lines = [_use(checkpoint, chat=find_chat_template(snapshot) is not None)]
        if ggufs:
            lines += [f"it also holds {len(ggufs)} GGUF file(s); pass one as --checkpoint to use it instead:",
                      *(f"  {path}" for path in ggufs)]
        return lines
    if len(ggufs) == 1 and ggufs[0].parent == snapshot:  # the loaders take a directory holding one .gguf
        return [_use(checkpoint, chat=True)]  # a GGUF file carries its chat template
    if ggufs:
        return [f"it holds {len(ggufs)} GGUF files; pass the one to use as --checkpoint:",
                *(f"  {path}" for path in ggufs), _use(shlex.quote(str(ggufs[0])), chat=True)]
    return ["it holds neither a config.json nor a .gguf file, so it is not a model glasslm loads"]


def _use(checkpoint: str, chat: bool) -> str:
    if chat:
        return f"next: glasslm chat --checkpoint {checkpoint}"
    return f'next: glasslm generate --checkpoint {checkpoint} --prompt "Hello"'


COMMAND = Command("download", download,
                  "fetch a model from the Hugging Face Hub into the HF cache (then --checkpoint ORG/NAME)",
                  description="fetch a model from the Hugging Face Hub through huggingface_hub into the Hugging Face\n"
                              "cache ($HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub); afterwards\n"
                              "every --checkpoint takes its name. HF_TOKEN authorizes gated and private models,\n"
                              "HF_ENDPOINT picks a mirror, HF_HUB_OFFLINE=1 never connects.",
                  examples=(
                      "glasslm download HuggingFaceTB/SmolLM2-135M-Instruct",
                      'glasslm download bartowski/SmolLM2-135M-Instruct-GGUF --include "*Q4_K_M.gguf"',
                      "glasslm download openai-community/gpt2 --exclude '*.h5' --exclude '*.msgpack' --revision main",
                  ))
