"""The kernels' build cache (issue 47): every checkout of the same sources loads one build, and a build (or
a wait for one) is reported on its own line before generation starts, not inside the first answer's time.
Before, each checkout's absolute paths in the build file made the next process from another clone
rebuild everything (18-56 s for the first answer of `glasslm chat` on the demo model)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from glasslm.core.model import TransformerLM
from glasslm.io.checkpoint import save_checkpoint
from glasslm.kernels import build
from glasslm.presets import get_preset
from glasslm.tokenizers import CharTokenizer

ROOT = Path(__file__).resolve().parents[2]


def _generate(source: Path, checkpoint: Path, cache: Path) -> subprocess.CompletedProcess:
    """`glasslm generate` from the glasslm package under `source` (a checkout's src/), kernels cached in `cache`."""
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(cache), "PYTHONPATH": str(source)}
    env.pop(build.ENV, None)
    return subprocess.run([sys.executable, "-c", "import glasslm, sys; assert glasslm.__file__.startswith(sys.argv[1]); "
                           "from glasslm.cli import run; sys.argv = sys.argv[1:]; sys.argv[0] = 'glasslm'; run()",
                           str(source), "generate", "--checkpoint", str(checkpoint), "--prompt", "ab",
                           "--max-new-tokens", "4", "--temperature", "0", "--threads", "1"],
                          capture_output=True, text=True, timeout=1200, env=env, cwd=source)


@pytest.mark.slow  # compiles the kernels once into an empty cache: a minute or two on 2 cores
def test_a_second_checkout_loads_the_first_ones_build_and_a_build_is_reported_before_decoding(tmp_path):
    tok = CharTokenizer.from_text("ab\n")
    torch.manual_seed(0)
    checkpoint = save_checkpoint(tmp_path / "tiny", TransformerLM(get_preset("shakespeare-char-cpu",
                                                                             vocab_size=tok.vocab_size, n_layers=1)),
                                 tok)
    first, second = tmp_path / "clone-a" / "src", tmp_path / "clone-b" / "src"
    for clone in (first, second):  # two checkouts of the same sources, at different paths
        shutil.copytree(ROOT / "src" / "glasslm", clone / "glasslm", ignore=shutil.ignore_patterns("__pycache__"))
    cache = tmp_path / "cache"
    built = _generate(first, checkpoint, cache)
    assert built.returncode == 0, built.stderr[-2000:]
    lines = built.stderr.splitlines()
    compiled = next(i for i, line in enumerate(lines) if line.startswith("glasslm: compiled the C++ kernels in "))
    assert compiled < next(i for i, line in enumerate(lines) if " tokens in " in line)  # before decoding began
    [folder] = cache.iterdir()
    library = folder / build.LIBRARY
    stamp = library.stat().st_mtime_ns
    reused = _generate(second, checkpoint, cache)
    assert reused.returncode == 0, reused.stderr[-2000:]
    assert "C++ kernels" not in reused.stderr and reused.stdout == built.stdout
    assert library.stat().st_mtime_ns == stamp and [p.name for p in cache.iterdir()] == [folder.name]


def test_a_build_killed_mid_compile_leaves_no_lock_that_later_processes_wait_on(tmp_path):
    """torch's lock file, left by a build that was killed, made every later process wait forever;
    the flock glasslm holds around a build dies with its process, so the leftover file is cleared."""
    if build.load() is None:
        pytest.skip("the C++ kernels cannot be built here")
    cache = tmp_path / "cache"
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(cache)}
    env.pop(build.ENV, None)
    folder = Path(subprocess.run([sys.executable, "-c", "from glasslm.kernels import build; print(build.cache_dir())"],
                                 capture_output=True, text=True, env=env, check=True).stdout.strip())
    # this checkout's finished build, as it was before its record was written, and a killed build's lock
    shutil.copytree(build.cache_dir(), folder, ignore=shutil.ignore_patterns(build.BUILT, "lock", "build.flock"))
    (folder / "lock").touch()
    loaded = subprocess.run([sys.executable, "-c", "from glasslm.kernels import build; assert build.load() is not None"],
                            capture_output=True, text=True, env=env, timeout=600)
    assert loaded.returncode == 0, loaded.stderr[-2000:]
    assert not (folder / "lock").exists() and (folder / build.BUILT).is_file()


def test_a_build_in_this_process_leaves_the_cache_folder_it_names_unchanged(tmp_path, monkeypatch):
    """torch's cpp_extension.load appends its own libraries to the extra_ldflags list it is handed; when
    that list was build.LDFLAGS itself, a process that had compiled named another cache folder afterwards
    (found on a fresh machine, where a pytest worker compiled and a later test read cache_dir())."""
    from torch.utils import cpp_extension

    def load_as_torch_does(name, sources, extra_cflags=None, extra_ldflags=None, **kwargs):
        extra_ldflags.append("-ltorch_cpu")  # what torch's _prepare_ldflags does to the list it is given
        extra_cflags.append("-DTORCH_EXTENSION_NAME=" + name)

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(cpp_extension, "load", load_as_torch_does)
    before = build.cache_dir()
    build._build(before)
    assert (before / build.BUILT).is_file()  # the fake build ran and was recorded where cache_dir() said
    assert build.cache_dir() == before
