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


def test_every_page_with_an_lm_eval_line_names_the_extra_that_installs_it():
    """Issue 47: neither set-up script installs lm-eval; each page that runs `lm_eval` (or `eval --tasks`)
    says to install the eval extra, and that extra holds what the documented `local-completions` model needs."""
    eval_extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["eval"]
    assert any(re.match(r"lm-eval\[[^\]]*\bapi\b", requirement) for requirement in eval_extra), eval_extra
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    for page in pages:
        lines = page.read_text(encoding="utf-8").splitlines()
        for i, line in enumerate(lines):
            if line.startswith("lm_eval ") or ("glasslm eval" in line and "--tasks" in line and line.startswith("glasslm")):
                heading = max((j for j in range(i) if lines[j].startswith("#")), default=0)
                section = "\n".join(lines[heading:i + 1])  # from the section's heading to the command
                assert "pip install -e '.[eval]'" in section, f"{page.name}:{i + 1}: say how lm-eval is installed"
