"""What we tell users to install must install: PyPI's `glasslm` is an unrelated project, so no
message may say `pip install glasslm[...]`, and what `plot` and `inspect` need is a core dependency."""

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_matplotlib_is_a_core_dependency():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert any(re.match(r"matplotlib\b", dep) for dep in project["dependencies"])


def test_no_message_names_an_extra_of_the_pypi_name():
    offenders = [f"{path.relative_to(ROOT)}:{n}" for path in sorted((ROOT / "src").rglob("*.py"))
                 for n, line in enumerate(path.read_text().splitlines(), 1) if re.search(r"glasslm\[", line)]
    assert offenders == []


def test_what_the_readme_commands_write_is_ignored_by_git():
    """Following the README leaves `git status` clean: every --out it names is git-ignored."""
    import shutil
    import subprocess

    import pytest

    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs a git checkout")
    readme = (ROOT / "README.md").read_text()
    outs = sorted(set(re.findall(r"--out[ =]([^\s`]+)", readme)))
    assert len(outs) >= 5  # runs/char, runs/tok, runs/data, runs/imported, runs/attn.png, ...
    for out in outs:
        ignored = subprocess.run(["git", "check-ignore", "-q", "--no-index", out], cwd=ROOT).returncode == 0
        assert ignored, f"README writes {out}, which .gitignore does not cover"
