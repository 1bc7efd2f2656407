"""`glasslm download` runs huggingface_hub's real download code (snapshot_download, its HTTP client, its
cache writes) against a local hub on 127.0.0.1 (tests/hub_server.py, found through HF_ENDPOINT), in a
temporary HF_HOME: no network, nothing of ours mocked. The CLI runs in a subprocess because
huggingface_hub reads HF_ENDPOINT, HF_HOME and HF_HUB_OFFLINE once, when it is imported."""

from __future__ import annotations

import hashlib
import io
import os
import re
import shlex
import string
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from glasslm.cli import main
from glasslm.core.model import TransformerLM
from glasslm.generation import generate_text
from glasslm.hf import export_hf, load_model
from glasslm.hf.cache import resolve_model_path
from glasslm.hf.gguf.exporter import export_gguf
from glasslm.presets import get_preset
from glasslm.tokenizers import CharTokenizer
from glasslm.tokenizers.chat import CHAT_TEMPLATE_FILE
from hub_server import HubRepo, LocalHub, closed_endpoint

ROOT = Path(__file__).resolve().parents[2]
TEXT = string.ascii_letters + string.digits + " .,:;!?'-\n"  # a character vocabulary the docs' prompts fit
TEMPLATE = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}a: {% endif %}"
GGUF_REPO = "bartowski/SmolLM2-135M-Instruct-GGUF"  # stand-ins under the names the docs use
SMOLLM = "HuggingFaceTB/SmolLM2-135M-Instruct"


def tiny_model(seed: int, **shape) -> tuple[TransformerLM, CharTokenizer]:
    tokenizer = CharTokenizer.from_text(TEXT)
    torch.manual_seed(seed)
    model = TransformerLM(get_preset("llama-tiny", vocab_size=tokenizer.vocab_size, **shape)).eval()
    with torch.no_grad():
        for weight in model.parameters():
            weight.normal_(0.0, 0.05)
    return model, tokenizer


def exported_files(model, tokenizer, directory: Path, template: str | None = None) -> dict[str, bytes]:
    export_hf(model, directory, tokenizer)
    if template is not None:
        (directory / CHAT_TEMPLATE_FILE).write_text(template, encoding="utf-8")
    return {p.relative_to(directory).as_posix(): p.read_bytes() for p in directory.rglob("*") if p.is_file()}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    # org/tiny's weights outgrow huggingface_hub's 10 MiB write chunk, so a cut after the first chunk resumes
    # with a Range request (a cut inside the first one restarts from byte 0).
    big = dict(d_model=256, d_mlp=688, n_layers=5)
    return {"main": tiny_model(0, **big), "v1": tiny_model(1, **big), "small": tiny_model(2, n_layers=1)}


@pytest.fixture(scope="module")
def hub(models, tmp_path_factory):
    root = tmp_path_factory.mktemp("hub-files")
    with LocalHub() as local:
        tiny = HubRepo()
        tiny.add_commit(exported_files(*models["main"], root / "main"), "main")
        tiny.add_commit(exported_files(*models["v1"], root / "v1"), "v1")
        smollm = HubRepo()
        smollm.add_commit(exported_files(*models["small"], root / "small", TEMPLATE), "main")
        gguf = HubRepo()  # glasslm's own GGUF exports, under the names the real repository's files have
        small, characters = models["small"]
        gguf.add_commit({f"SmolLM2-135M-Instruct-{name}.gguf":
                         export_gguf(small, root / f"{name}.gguf", characters, qtype, TEMPLATE).read_bytes()
                         for name, qtype in [("Q4_K_M", "q4_0"), ("Q8_0", "q8_0")]} | {"README.md": b"# GGUF\n"},
                        "main")
        gated = HubRepo(gated_token="hf_granted")
        gated.add_commit({"config.json": b"{}", "README.md": b"# gated\n"}, "main")
        local.repos.update({"org/tiny": tiny, SMOLLM: smollm, GGUF_REPO: gguf, "org/gated": gated})
        yield local


def glasslm(*args: str, home: Path, endpoint: str, stdin: str | None = None, **env: str) -> subprocess.Popen:
    """`glasslm ARGS` in a subprocess with only the given HF_* settings (HF_HOME isolates the cache and tokens)."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING_FACE"))}
    clean.update(HF_HOME=str(home), HF_ENDPOINT=endpoint, **env)
    return subprocess.Popen([sys.executable, "-m", "glasslm.cli", *args], env=clean, text=True,
                            stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def finished(process: subprocess.Popen, stdin: str | None = None) -> subprocess.CompletedProcess:
    out, err = process.communicate(stdin, timeout=300)
    return subprocess.CompletedProcess(process.args, process.returncode, out, err)


def run(*args: str, **kw) -> subprocess.CompletedProcess:
    return finished(glasslm(*args, **kw), kw.get("stdin"))


def snapshot_files(snapshot: Path) -> dict[str, bytes]:
    return {p.relative_to(snapshot).as_posix(): p.read_bytes() for p in snapshot.rglob("*") if p.is_file()}


def next_command(stdout: str) -> list[str]:
    return shlex.split(next(line for line in stdout.splitlines() if line.startswith("next: "))[len("next: "):])


def test_download_fills_the_hf_cache_and_every_command_takes_the_hub_name(hub, models, tmp_path, monkeypatch,
                                                                          capsys):
    home, repo = tmp_path / "hf-home", hub.repos["org/tiny"]
    commit, seen = repo.refs["main"], len(hub.log)
    done = run("download", "org/tiny", home=home, endpoint=hub.endpoint)
    assert done.returncode == 0, done.stderr
    snapshot = home / "hub" / "models--org--tiny" / "snapshots" / commit
    assert str(snapshot) in done.stdout and snapshot_files(snapshot) == repo.commits[commit]
    assert len([r for r in hub.log[seen:] if r.path.startswith("/blobs/")]) == 1  # the weights, once, from the CDN
    # The command it advises works as printed, and so does loading by name from Python.
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(home))
    assert next_command(done.stdout)[:4] == ["glasslm", "generate", "--checkpoint", "org/tiny"]
    assert main([*next_command(done.stdout)[1:], "--max-new-tokens", "4"]) == 0
    assert capsys.readouterr().out.startswith("Hello")
    tokens = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    with torch.no_grad():
        assert torch.equal(load_model("org/tiny")[0](tokens), models["main"][0](tokens))

    # Again: the hub is asked which commit main is, and no file is fetched twice. With the hub unreachable,
    # or offline by setting, the cached snapshot answers, and says it is unchecked. (Three processes at once.)
    seen = len(hub.log)
    again = {"": glasslm("download", "org/tiny", home=home, endpoint=hub.endpoint),
             "cannot reach": glasslm("download", "org/tiny", home=home, endpoint=closed_endpoint()),
             "offline (HF_HUB_OFFLINE is set)": glasslm("download", "org/tiny", home=home, endpoint=hub.endpoint,
                                                        HF_HUB_OFFLINE="1")}
    for why, process in again.items():
        result = finished(process)
        assert result.returncode == 0 and str(snapshot) in result.stdout, result.stderr
        assert ("not checked for a newer revision" in result.stderr) == bool(why) and why in result.stderr
    assert hub.log[seen:] and all(r.path.startswith("/api/") for r in hub.log[seen:])


def test_a_connection_cut_mid_file_resumes_where_it_stopped(hub, tmp_path):
    weights = hub.repos["org/tiny"].commits[hub.repos["org/tiny"].refs["main"]]["model.safetensors"]
    sha256 = hashlib.sha256(weights).hexdigest()
    cut = len(weights) * 4 // 5
    assert cut > 10 * 2**20, "org/tiny's weights must outgrow huggingface_hub's first 10 MiB write"
    hub.drop_once[sha256] = cut
    seen = len(hub.log)
    done = run("download", "org/tiny", "--include", "model.safetensors", home=tmp_path, endpoint=hub.endpoint)
    assert done.returncode == 0, done.stderr
    fetches = [r for r in hub.log[seen:] if r.path == f"/blobs/{sha256}"]
    assert [r.range is None for r in fetches] == [True, False]  # the whole file, then the rest of it
    resumed_at = int(re.fullmatch(r"bytes=(\d+)-", fetches[1].range).group(1))
    assert 0 < resumed_at <= cut
    blob = tmp_path / "hub" / "models--org--tiny" / "blobs" / sha256
    assert blob.read_bytes() == weights


def test_include_picks_files_and_a_gguf_snapshot_resolves_by_name(hub, tmp_path, monkeypatch, capsys):
    home, files = tmp_path / "hf-home", hub.repos[GGUF_REPO].commits[hub.repos[GGUF_REPO].refs["main"]]
    snapshot = home / "hub" / "models--bartowski--SmolLM2-135M-Instruct-GGUF" / "snapshots" / \
        hub.repos[GGUF_REPO].refs["main"]
    one = run("download", GGUF_REPO, "--include", "*Q4_K_M.gguf", home=home, endpoint=hub.endpoint)
    assert one.returncode == 0, one.stderr
    assert snapshot_files(snapshot) == {k: v for k, v in files.items() if k.endswith("Q4_K_M.gguf")}
    assert next_command(one.stdout) == ["glasslm", "chat", "--checkpoint", GGUF_REPO]
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(home))
    assert resolve_model_path(GGUF_REPO) == snapshot  # a directory holding the one .gguf file
    # The advice works: chatting by the hub name answers as chatting with the file that was served.
    served = tmp_path / "served.gguf"
    served.write_bytes(files["SmolLM2-135M-Instruct-Q4_K_M.gguf"])
    replies = []
    for checkpoint in (next_command(one.stdout)[3], str(served)):
        monkeypatch.setattr("sys.stdin", io.StringIO("hello\nhow are you\n"))
        assert main(["chat", "--checkpoint", checkpoint, "--max-new-tokens", "6", "--seed", "1"]) == 0
        replies.append(capsys.readouterr().out)
    assert replies[0] == replies[1] and replies[0].count("\n") >= 2
    # Every quantization: the files are listed, and the advice names one of them.
    both = run("download", GGUF_REPO, "--exclude", "*.md", home=home, endpoint=hub.endpoint)
    ggufs = sorted(str(snapshot / name) for name in files if name.endswith(".gguf"))
    assert both.returncode == 0 and all(f"  {path}\n" in both.stdout for path in ggufs), both.stderr
    assert next_command(both.stdout) == ["glasslm", "chat", "--checkpoint", ggufs[0]]


def test_a_revision_is_downloaded_and_chosen_by_name(hub, models, tmp_path, monkeypatch, capsys):
    home, repo = tmp_path / "hf-home", hub.repos["org/tiny"]
    snapshots = home / "hub" / "models--org--tiny" / "snapshots"
    tagged = run("download", "org/tiny", "--revision", "v1", home=home, endpoint=hub.endpoint)
    assert tagged.returncode == 0, tagged.stderr
    assert next_command(tagged.stdout)[2:6] == ["--checkpoint", "org/tiny", "--revision", "v1"]
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(home))
    v1 = snapshots / repo.refs["v1"]
    assert resolve_model_path("org/tiny") == v1  # main was never fetched: the newest snapshot there is
    with pytest.raises(FileNotFoundError, match="glasslm download org/tiny --revision v2"):
        resolve_model_path("org/tiny", "v2")
    assert run("download", "org/tiny", home=home, endpoint=hub.endpoint).returncode == 0
    assert resolve_model_path("org/tiny") == snapshots / repo.refs["main"]
    assert resolve_model_path("org/tiny", "v1") == resolve_model_path("org/tiny", repo.refs["v1"]) == v1
    texts = {}
    for revision in ("main", "v1"):
        assert main(["generate", "--checkpoint", "org/tiny", "--revision", revision, "--prompt", "Hello",
                     "--max-new-tokens", "12", "--temperature", "0"]) == 0
        texts[revision] = capsys.readouterr().out
    for revision, text in texts.items():
        model, tokenizer = models[revision]
        assert text == "Hello" + generate_text(model, tokenizer, "Hello", max_new_tokens=12, temperature=0.0) + "\n"
    assert texts["main"] != texts["v1"]
    assert main(["generate", "--checkpoint", str(v1), "--revision", "v1", "--prompt", "Hello"]) == 1
    assert "is a local path" in capsys.readouterr().err


@pytest.mark.slow  # nine CLI processes
def test_each_refusal_is_one_line_that_says_what_to_do(hub, tmp_path):
    cases = {  # name: (arguments, settings, what the line must say; CACHE: the case's HF cache)
        "offline": (["org/tiny"], {"HF_HUB_OFFLINE": "1"}, ["offline", "HF_HUB_OFFLINE", "CACHE"]),
        "unreachable": (["org/tiny"], {"endpoint": closed_endpoint()}, ["cannot reach", "HF_HUB_OFFLINE", "CACHE"]),
        "no such repo": (["org/nothing"], {}, ["org/nothing is not a model on", "answered 401", "HF_TOKEN"]),
        "no such repo, token": (["org/nothing"], {"HF_TOKEN": "hf_x"}, ["org/nothing is not a model on", "answered 404"]),
        "no such revision": (["org/tiny", "--revision", "v9"], {}, ["org/tiny has no revision 'v9'", "answered 404"]),
        "gated": (["org/gated"], {}, ["org/gated is a gated model", "answered 401", "set HF_TOKEN", "hf auth login"]),
        "gated, token": (["org/gated"], {"HF_TOKEN": "hf_other"}, ["token in use", "no access", "answered 403"]),
        "no file matches": ([GGUF_REPO, "--include", "*.safetensors"], {},
                            [f"no file of {GGUF_REPO} matches --include '*.safetensors' (it holds .gitattributes, "]),
    }
    started = {name: glasslm("download", *args, home=tmp_path / str(i), **{"endpoint": hub.endpoint, **settings})
               for i, (name, (args, settings, _)) in enumerate(cases.items())}
    granted = glasslm("download", "org/gated", home=tmp_path / "granted", endpoint=hub.endpoint, HF_TOKEN="hf_granted")
    for i, (name, process) in enumerate(started.items()):
        result = finished(process)
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        assert result.returncode == 1 and "Traceback" not in result.stderr, (name, result.stderr)
        assert lines[-1].startswith("glasslm download: error: "), (name, result.stderr)
        # One line; where the globs matched nothing, huggingface_hub's own warning and empty progress bar precede it.
        assert len(lines) == 1 or name == "no file matches", (name, result.stderr)
        wanted = [str(tmp_path / str(i) / "hub") if part == "CACHE" else part for part in cases[name][2]]
        assert all(part in lines[-1] for part in wanted), (name, lines[-1])
    assert finished(granted).returncode == 0


def _doc_lines(pattern: str) -> list[str]:
    """The command lines of README.md and docs/*.md matching `pattern`, comments dropped, in page order."""
    found = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for line in page.read_text(encoding="utf-8").splitlines():
            if re.match(pattern, line.strip()):
                found.append(line.strip())
    return found


def documented_hub_commands() -> list[str]:
    """Every `glasslm download` line of the README and docs, then each line using what they fetched
    (tests/doc_commands.py counts these as run here)."""
    served = "|".join(re.escape(name) for name in (SMOLLM, GGUF_REPO))
    return _doc_lines(r"(HF_\w+=\S+ )*glasslm download ") + _doc_lines(
        rf"glasslm (generate|chat|info) --checkpoint ({served})\s")


@pytest.mark.slow  # a CLI process per line
def test_the_docs_download_commands_work_as_written(hub, tmp_path):
    """Every `glasslm download` line of the README and docs, then each line using what they fetched."""
    lines = documented_hub_commands()
    assert sum(" download " in line for line in lines) >= 5 and sum(" download " not in line for line in lines) >= 2
    for line in lines:
        words = shlex.split(line, comments=True)
        settings = dict(word.split("=", 1) for word in words[:words.index("glasslm")])
        settings.pop("HF_ENDPOINT", None)  # a mirror: the local hub stands in for it
        args = words[words.index("glasslm") + 1:]
        result = run(*args, home=tmp_path, stdin="hello\n" if args[0] == "chat" else None,
                     **{"endpoint": hub.endpoint, **settings})
        assert result.returncode == 0, (line, result.stderr)
