"""The shape of the code, checked: the import layers in pyproject.toml's [tool.importlinter] hold,
and no function in src/ is longer than 60 lines (a reader should see one whole on a screen)."""

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "glasslm"
MAX_FUNCTION_LINES = 60


def long_functions(root: Path = SRC, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """'path:line name (N lines)' for every function or method longer than `limit` lines."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > limit:
                    found.append(f"{path.relative_to(root)}:{node.lineno} {node.name} ({length} lines)")
    return found


def test_no_function_is_longer_than_60_lines():
    assert long_functions() == []


def test_the_checker_sees_a_long_function(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    (tmp_path / "m.py").write_text(f"def short():\n    pass\n\n\ndef long():\n{body}\n")
    assert [line.split(" ")[1] for line in long_functions(tmp_path)] == ["long"]


def _lint_imports() -> list[str]:
    exe = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or shutil.which("lint-imports")
    if exe is None:
        pytest.fail("import-linter is not installed (it is in the test extra: pip install -e '.[test]')")
    return [exe, "--config", str(ROOT / "pyproject.toml"), "--no-cache"]


def test_the_import_layers_hold():
    proc = subprocess.run(_lint_imports(), cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "BROKEN" not in proc.stdout and "KEPT" in proc.stdout


def test_the_layer_check_catches_an_upward_import(tmp_path):
    # A copy of the package where the core imports the CLI must be refused.
    copy = tmp_path / "src"
    shutil.copytree(SRC, copy / "glasslm", ignore=shutil.ignore_patterns("static", "__pycache__"))
    (copy / "glasslm" / "core" / "upward.py").write_text("import glasslm.cli\n")
    env = {"PYTHONPATH": str(copy), "PATH": str(Path(sys.executable).parent)}
    proc = subprocess.run(_lint_imports(), cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode != 0 and "glasslm.core.upward" in proc.stdout
