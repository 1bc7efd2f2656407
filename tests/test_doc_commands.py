"""The README's and docs' commands work when followed: every one is run here against small stand-ins
(tests/doc_commands.py says how each is covered), and they refer to runs they make."""

import importlib.util
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from doc_commands import (
    COVERAGE, MAKERS, NETWORK, UNDOCUMENTED, During, Elsewhere, Run, Sandbox, Skip, command_key, doc_commands,
    is_slow, run_in_shell,
)
from glasslm.presets import get_preset

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "scripts" / "demo.sh"]


def _commands(name: str) -> list[list[str]]:
    """Every `glasslm NAME ...` line of the pages (torchrun's `-m glasslm.cli NAME ...` too), as arguments
    from `glasslm`, comments dropped."""
    found = []
    for page in PAGES:
        for line in page.read_text(encoding="utf-8").splitlines():
            start = line.find(f"glasslm {name} ")
            if start < 0 and line.startswith("torchrun "):  # torchrun ... -m glasslm.cli NAME ...
                start = line.find(f"glasslm.cli {name} ")
            if start < 0 or line.lstrip().startswith(("#", "|")) or "`" in line[:start]:
                continue
            try:
                words = shlex.split(line[start:], comments=True)
            except ValueError:
                continue
            found.append(words)
    return found


def _option(words: list[str], name: str, default: str | None = None) -> str | None:
    return words[words.index(name) + 1] if name in words else default


def _runs_made() -> dict[str, str]:
    """Run directory -> preset, for each `glasslm train --out DIR` the pages show."""
    runs = {}
    for words in _commands("train"):
        preset = _option(words, "--preset", "shakespeare-char-cpu")
        out = _option(words, "--out", f"runs/{preset}")
        if "--resume" not in words and "--init-from" not in words:
            runs[out] = preset
    return runs


def test_every_eval_stride_fits_the_context_of_a_run_the_docs_make():
    # docs/generation.md once scored runs/shakespeare-char (made by no command shown) with --stride 128,
    # which the README's context-64 run refuses.
    runs, checked = _runs_made(), 0
    for words in _commands("eval"):
        checkpoint, stride = _option(words, "--checkpoint"), _option(words, "--stride")
        if stride is None or checkpoint is None or not checkpoint.startswith("runs/"):
            continue
        assert checkpoint in runs, f"{' '.join(words)}: no command in the docs makes {checkpoint}"
        context = get_preset(runs[checkpoint]).context_length
        assert 1 <= int(stride) <= context, f"{' '.join(words)}: {checkpoint} has context {context}"
        checked += 1
    assert checked >= 2  # the README's and docs/generation.md's


# ----- every command of the README and docs, run (issue 36, item 8) -----

def _first_places() -> dict[str, str]:
    places: dict[str, str] = {}
    for command in doc_commands():
        places.setdefault(command.key, command.where)
    return places


PLACES = _first_places()
RUNS = {**{key: spec for key, spec in COVERAGE.items() if isinstance(spec, Run)}, **UNDOCUMENTED}


def _case(key: str) -> pytest.param:
    spec = RUNS[key]
    marks = [pytest.mark.slow] if is_slow(key, spec) else []
    if "--threads 2" in key or key.startswith("torchrun "):  # two busy threads or processes: the cores to themselves
        marks.append(pytest.mark.alone)
    return pytest.param(key, id=PLACES.get(key, key.split()[1]), marks=marks)


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory, data_dir) -> Sandbox:
    return Sandbox(tmp_path_factory.mktemp("docs"), data_dir)


def test_every_documented_command_has_an_entry_and_every_entry_a_command():
    # A command added to a page must say how the suite runs it; an entry whose line left the pages goes too.
    documented = set(PLACES)
    assert documented - set(COVERAGE) == set(), "documented commands the suite does not run: add them to COVERAGE"
    assert set(COVERAGE) - documented == set(), "COVERAGE entries no page shows any more"
    assert len(documented) >= 90
    served = {spec.command for spec in COVERAGE.values() if isinstance(spec, During)}
    assert all(isinstance(COVERAGE[key], Run) and COVERAGE[key].serve for key in served)
    assert all(isinstance(COVERAGE[key], Run) for key in MAKERS.values())


def test_skipped_commands_say_why():
    for key, spec in COVERAGE.items():
        if isinstance(spec, Skip):
            assert spec.reason.startswith((NETWORK, "the command that runs this suite")), key


@pytest.mark.parametrize("key", [pytest.param(key, id=PLACES[key]) for key, spec in COVERAGE.items()
                                 if isinstance(spec, Elsewhere)])
def test_commands_run_by_other_tests_are_on_their_lists(key):
    """Each `Elsewhere` command is one the named test runs: on the list of documented lines that test
    reads (or, for a test without one, in its own source as the argument list it passes)."""
    spec = COVERAGE[key]
    path, name = spec.test.split("::")
    source = (ROOT / path).read_text(encoding="utf-8")
    assert f"def {name}(" in source, spec.test
    if not spec.lister:
        words = shlex.split(key)[1:]
        assert "main([" + ", ".join(f'"{w}"' for w in words) in source, (key, spec.test)
        return
    loaded = importlib.util.spec_from_file_location(f"_doc_lister_{Path(path).stem}", ROOT / path)
    module = importlib.util.module_from_spec(loaded)
    sys.path.insert(0, str((ROOT / path).parent))  # its own imports of neighbouring test modules, as pytest does
    try:
        loaded.loader.exec_module(module)
    finally:
        sys.path.remove(str((ROOT / path).parent))
    assert key in {command_key(line) for line in getattr(module, spec.lister)()}, (key, spec.test)


def test_every_benchmark_has_a_smoke_run_and_imports():
    import runpy

    for path in sorted((ROOT / "benchmarks").glob("bench_*.py")):
        runs = [key for key, spec in RUNS.items() if key.startswith(f"python benchmarks/{path.name}")]
        assert runs and all("--smoke" in RUNS[key].add for key in runs), path.name
        runpy.run_path(str(path), run_name="imported")  # its imports and definitions, not main()


@pytest.mark.parametrize("key", [_case(key) for key, spec in RUNS.items() if not spec.serve])
def test_the_documented_command_works_as_written(key, sandbox, tmp_path):
    spec = RUNS[key]
    made_by = {value: path for path, value in MAKERS.items()}
    if key in made_by:  # a run other commands read: made once, in the sandbox
        sandbox.ensure(made_by[key])
        result, folder = sandbox.made[key], sandbox.root
    else:
        sandbox.prepare(tmp_path, spec.needs)
        result, folder = sandbox.run(key, spec, tmp_path), tmp_path
    result.check(key)
    for text in spec.expect:
        assert text in result.output, (key, text, result.output[-3000:])
    for path in spec.creates:
        assert (folder / path).exists(), (key, path, result.output[-3000:])


@pytest.mark.parametrize("key", [_case(key) for key, spec in RUNS.items() if spec.serve])
def test_the_documented_server_answers(key, sandbox, tmp_path):
    """The server starts on the checkpoint the docs name; health, a completion, a chat answer where the
    model has a template, and every documented `curl` line sent to it answer 200 with JSON."""
    spec = RUNS[key]
    sandbox.prepare(tmp_path, spec.needs)
    *before, serve = key.split(" && ")
    for part in before:  # python scripts/induction_study.py --out runs/induction && glasslm serve ...
        run_in_shell(f"{part} {shlex.join(spec.add)}", tmp_path, sandbox.env).check(part)
    process = subprocess.Popen(["bash", "-c", f"exec {serve} --port 0 --log-level warning"], cwd=tmp_path,
                               env={**os.environ, **sandbox.env}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True)
    try:
        line = process.stdout.readline()
        match = re.search(r"http://127\.0\.0\.1:(\d+)", line)
        assert match, line + process.stdout.read() if process.poll() is not None else line
        _ask_the_server(f"127.0.0.1:{match.group(1)}", serve)
        for curl in [k for k, s in COVERAGE.items() if isinstance(s, During) and s.command == serve]:
            answer = run_in_shell(curl.replace("127.0.0.1:8000", f"127.0.0.1:{match.group(1)}") + " -f", tmp_path, {})
            answer.check(curl)
            if "/metrics" in curl:  # Prometheus' text format, not JSON
                assert "glasslm_http_requests_total" in answer.output, (curl, answer.output)
            else:
                assert "error" not in json.loads(answer.output), (curl, answer.output)
    finally:
        process.send_signal(signal.SIGTERM)
        process.communicate(timeout=60)


def _ask_the_server(host: str, serve: str) -> None:
    def post(path: str, body: dict) -> dict:
        request = urllib.request.Request(f"http://{host}{path}", json.dumps(body).encode(),
                                         {"content-type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as response:
            return json.loads(response.read())

    with urllib.request.urlopen(f"http://{host}/health", timeout=60) as response:
        assert json.loads(response.read())["status"] == "ok"
    with urllib.request.urlopen(f"http://{host}/tokenizer_info", timeout=60) as response:
        has_template = json.loads(response.read())["chat_template"] is not None
    completion = post("/v1/completions", {"prompt": "hello", "max_tokens": 4, "temperature": 0})
    assert completion["choices"][0]["finish_reason"] in ("length", "stop"), (serve, completion)
    if has_template:
        chat = post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4})
        assert chat["choices"][0]["message"]["role"] == "assistant", (serve, chat)


def _run_paths() -> tuple[dict[str, str], list[tuple[str, str]]]:
    """(every runs/... directory a page's command writes -> the command, every runs/... directory a
    command reads -> the command); `glasslm train` without --out writes runs/PRESET."""
    made, used = {}, []
    for name in ("train", "finetune", "convert", "merge", "quantize", "generate", "eval", "serve", "chat", "plot",
                 "inspect", "info"):
        for words in _commands(name):
            words = [w.rstrip("`,") for w in words]
            line = " ".join(words)
            if name == "train" and "--resume" not in words:
                made[_option(words, "--out", f"runs/{_option(words, '--preset', 'shakespeare-char-cpu')}")] = line
            elif "--out" in words:
                made[_option(words, "--out")] = line
            reads = [words[i + 1] for i, w in enumerate(words[:-1])
                     if w in ("--checkpoint", "--resume", "--draft", "--base", "--init-from")]
            reads += [words[2]] if name == "plot" and len(words) > 2 else []
            used += [(path, line) for path in reads if path.startswith("runs/")]
    for page in PAGES:  # the scripts' runs (python scripts/induction_study.py --out runs/induction)
        for found in re.finditer(r"python scripts/\S+ [^`#\n]*--out (\S+)", page.read_text(encoding="utf-8")):
            made[found.group(1).rstrip("`,")] = found.group(0)
    return made, used


def test_every_run_the_pages_read_is_one_their_commands_make():
    # README's examples once read runs/char, runs/base and runs/big, which no command shown makes.
    made, used = _run_paths()
    assert len(used) >= 20
    for path, line in used:
        assert path in made, f"{line}: no command in README, docs/ or demo.sh makes {path}"


def test_the_pages_train_the_demo_model_where_the_demo_does():
    # After `bash scripts/demo.sh`, README's `--checkpoint runs/char` found nothing.
    demo = next(words for words in _commands("train") if "--preset" in words and words[-1] == "$@")
    demo_out = _option(demo, "--out")
    checked = 0  # torchrun's lines (glasslm.cli ...) train their own runs beside it
    for words in _commands("train"):
        out = _option(words, "--out", "")
        if "--resume" in words or words[0] == "glasslm.cli" or not out.startswith("runs/") or _option(words, "--data", "tinyshakespeare") \
                != "tinyshakespeare" or _option(words, "--preset", "shakespeare-char-cpu") != _option(demo, "--preset"):
            continue
        assert out == demo_out, " ".join(words)
        checked += 1
    assert demo_out == "runs/shakespeare-char-cpu" and checked >= 3
