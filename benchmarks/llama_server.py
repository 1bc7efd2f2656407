"""llama.cpp's C++ server (`llama-server`), built from the llama.cpp source that llama-cpp-python's sdist
carries, and a load that both it and `glasslm serve` answer (benchmarks/bench_serve.py --llama-server).

The build is cached per CPU kind, in a folder of pip's cache named the way scripts/venv.sh names its
llama.cpp wheel (a hash of what `gcc -march=native` means here), because llama.cpp is compiled with
-march=native and would die of an illegal instruction on another CPU kind.

    from llama_server import llama_server_binary
    binary, note = llama_server_binary()        # (path, None) or (None, why it could not be built)
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def pinned_version() -> str:
    """The llama-cpp-python version pyproject.toml pins (its sdist carries the llama.cpp source)."""
    return re.search(r"llama-cpp-python==([0-9.]+)", (ROOT / "pyproject.toml").read_text()).group(1)


def cpu_kind() -> str:
    """scripts/venv.sh's name for this CPU kind: the hash of gcc's -march=native target options."""
    try:
        out = subprocess.run(["gcc", "-march=native", "-Q", "--help=target"], capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        out = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")),
                   "").encode() + b"\n"
    return hashlib.sha256(out).hexdigest()[:16]


def cache_folder() -> Path:
    try:
        pip_cache = subprocess.run([sys.executable, "-m", "pip", "cache", "dir"], capture_output=True, text=True,
                                   check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        pip_cache = str(Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "pip")
    return Path(pip_cache) / "glasslm-llama-server" / f"{pinned_version()}-{cpu_kind()}"


def llama_server_binary(build: bool = True, log=print) -> tuple[Path | None, str | None]:
    """(llama-server's path, None), building it on first use; or (None, why not)."""
    folder = cache_folder()
    binary = folder / "llama-server"
    if binary.is_file():
        return binary, None
    if not build:
        return None, (f"llama-server is not built yet ({binary} is missing); a run without --smoke builds it "
                      "(some minutes on 2 cores, once per CPU kind)")
    missing = [tool for tool in ("cmake", "c++") if shutil.which(tool) is None]
    if missing:
        return None, f"llama-server cannot be built here: no {' or '.join(missing)}"
    version = pinned_version()
    log(f"building llama-server from llama-cpp-python {version}'s llama.cpp for this CPU kind ({cpu_kind()}); "
        "a few minutes on 2 cores, once")
    with tempfile.TemporaryDirectory() as tmp:
        got = subprocess.run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
                              "--quiet", f"llama-cpp-python=={version}", "-d", tmp], capture_output=True, text=True)
        sdists = list(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
        if got.returncode or not sdists:
            return None, f"llama-cpp-python {version}'s sdist could not be downloaded: {got.stderr.strip()[-300:]}"
        with tarfile.open(sdists[0]) as sdist:
            sdist.extractall(tmp, filter="data")
        source = Path(tmp) / f"llama_cpp_python-{version}" / "vendor" / "llama.cpp"
        build_dir = Path(tmp) / "build"
        generator = ["-G", "Ninja"] if shutil.which("ninja") else []
        steps = [["cmake", "-S", str(source), "-B", str(build_dir), *generator, "-DCMAKE_BUILD_TYPE=Release",
                  "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
                  "-DLLAMA_BUILD_SERVER=ON", "-DGGML_NATIVE=ON"],
                 ["cmake", "--build", str(build_dir), "--target", "llama-server", "-j", str(os.cpu_count() or 2)]]
        for step in steps:
            done = subprocess.run(step, capture_output=True, text=True)
            if done.returncode:
                return None, f"building llama-server failed: {(done.stdout + done.stderr).strip()[-400:]}"
        keep(build_dir / "bin", folder)
    return binary, None


def keep(built: Path, folder: Path) -> None:
    """Copy a build's bin folder (llama-server and the shared libraries beside it) into the cache;
    `start_llama_server` points the loader there."""
    folder.mkdir(parents=True, exist_ok=True)
    for item in built.iterdir():
        if item.is_file() and (item.name == "llama-server" or ".so" in item.name):
            shutil.copy2(item, folder / item.name, follow_symlinks=True)


def start_llama_server(binary: Path, gguf: Path, threads: int, slots: int) -> tuple[subprocess.Popen, int]:
    """llama-server on a free port with `slots` parallel sequences (continuous batching, one shared KV
    cache of 32k tokens); waits until /health answers 200."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    log = tempfile.TemporaryFile()  # its log, read only if it fails (a pipe nobody reads would fill and stall it)
    proc = subprocess.Popen([str(binary), "-m", str(gguf), "-t", str(threads), "-tb", str(threads), "-np", str(slots),
                             "-c", "32768", "-kvu", "--host", "127.0.0.1", "--port", str(port), "--no-webui",
                             "--jinja"], stdout=log, stderr=log,
                            env={**os.environ, "LD_LIBRARY_PATH": str(binary.parent)})  # its libllama, libggml
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"llama-server exited: {log.read().decode(errors='replace')[-500:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as reply:
                if reply.status == 200:
                    return proc, port
        except OSError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError("llama-server did not answer /health within 120 s")


WORDS = ("river mountain lantern harbor violin meadow engine orchard glacier library compass falcon "
         "canyon bakery comet island theater forest clock desert").split()


def distinct_prompts(n: int, seed: int = 0) -> list[str]:
    """`n` different story prompts, each about 30 tokens."""
    rng = random.Random(seed)
    return [f"Story {i}: write about a {' and a '.join(rng.sample(WORDS, 3))}, in the style of a {rng.choice(WORDS)} "
            f"guide, beginning with the words 'It was'" for i in range(n)]


async def stream_once(port: int, path: str, body: dict, timeout: float = 600.0) -> tuple[float, int, str]:
    """One streamed request to 127.0.0.1:port: (seconds to the first text, text chunks, the text)."""
    start = time.perf_counter()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    payload = json.dumps({**body, "stream": True}).encode()
    writer.write(b"POST %s HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
                 b"Connection: close\r\n\r\n" % (path.encode(), len(payload)) + payload)
    first, chunks, text = None, 0, []
    try:
        async for line in _lines(reader, timeout):
            if not line.startswith(b"data: {"):
                continue
            choices = json.loads(line[6:]).get("choices") or [{}]
            piece = choices[0].get("text") or (choices[0].get("delta") or {}).get("content") or ""
            if piece:
                first = first or time.perf_counter() - start
                chunks += 1
                text.append(piece)
    finally:
        writer.close()
    if first is None:
        raise RuntimeError(f"no text came from {path}")
    return first, chunks, "".join(text)


async def stream_times(port: int, body: dict, timeout: float = 600.0) -> list[float]:
    """The arrival time of each text chunk of one streamed completion (tokens, for both servers)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    payload = json.dumps({**body, "stream": True}).encode()
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(payload) + payload)
    times = []
    try:
        async for line in _lines(reader, timeout):
            if line.startswith(b"data: {") and (json.loads(line[6:]).get("choices") or [{}])[0].get("text"):
                times.append(time.perf_counter())
    finally:
        writer.close()
    return times


async def _lines(reader: asyncio.StreamReader, timeout: float):
    while line := await asyncio.wait_for(reader.readline(), timeout):
        yield line.strip()


async def load_level(port: int, clients: int, requests: int, max_tokens: int, seed: int) -> dict:
    """`clients` concurrent clients, each sending `requests` streamed completions of distinct prompts."""
    prompts = distinct_prompts(clients * requests, seed)
    ttfts: list[float] = []

    async def client(c: int) -> None:
        for r in range(requests):
            body = {"prompt": prompts[c * requests + r], "max_tokens": max_tokens, "temperature": 0.8, "seed": c,
                    "ignore_eos": True}
            first, _, _ = await stream_once(port, "/v1/completions", body)
            ttfts.append(first)

    start = time.perf_counter()
    await asyncio.gather(*(client(c) for c in range(clients)))
    elapsed = time.perf_counter() - start
    ttfts.sort()
    return {"tok_s": clients * requests * max_tokens / elapsed, "p50": ttfts[len(ttfts) // 2],
            "p95": ttfts[min(len(ttfts) - 1, int(0.95 * len(ttfts)))]}


def conversation(seed: int, tokens: int = 1500) -> list[dict]:
    """A chat of about `tokens` tokens (a system prompt and earlier turns), different for each seed."""
    rng = random.Random(seed)
    said = lambda n: " ".join(rng.choice(WORDS) for _ in range(n))  # noqa: E731 - ~1.3 tokens a word
    messages = [{"role": "system", "content": f"You are a helpful guide. Context: {said(200)}"}]
    while sum(len(m["content"].split()) for m in messages) * 1.3 < tokens:
        messages += [{"role": "user", "content": f"Tell me about {said(120)}"},
                     {"role": "assistant", "content": f"Certainly. {said(160)}"}]
    return messages + [{"role": "user", "content": f"Summarise {said(20)}"}]


async def second_turn(port: int, seed: int, answer_tokens: int = 32) -> tuple[float, float]:
    """(time to first token of a cold ~1,500-token conversation, of its next turn)."""
    messages = conversation(seed)
    body = {"messages": messages, "max_tokens": answer_tokens, "temperature": 0}
    cold, _, answer = await stream_once(port, "/v1/chat/completions", body)
    more = messages + [{"role": "assistant", "content": answer}, {"role": "user", "content": "And then?"}]
    warm, _, _ = await stream_once(port, "/v1/chat/completions", {**body, "messages": more})
    return cold, warm
