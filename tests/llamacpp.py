"""llama.cpp (through llama-cpp-python) as a reference in the tests, run in a child process.

llama.cpp is C++: where it crashes (as its native build does on AMX Xeons when its extra buffer
types are on) it would take the pytest worker down with every test queued on it. So every call
goes to a child process that holds the models (benchmarks/llamacpp_reference.py's LlamaCpp); a child
that dies fails the one test that called it with LlamaCppCrashed, naming the signal, the file and
the CPU, and the next call starts a new child.

    llm = quiet_llama(path, logits_all=True)           # a proxy: the model lives in the child
    ids = llm.tokenize(text, add_bos=False, special=True)
    scores = llm.logits(ids)                           # (len(ids), vocab) numpy float32
"""

from __future__ import annotations

import atexit
import os
import platform
import signal
import subprocess
import sys
import traceback
from multiprocessing.connection import Connection
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CALL_TIMEOUT_S = 900  # a call past this is a hang: the child is killed and the test fails


class LlamaCppCrashed(RuntimeError):
    """llama.cpp's process died (a signal) or hung during a call."""


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


class _Child:
    """The child process and its two pipes: requests (handle, method, args, kwargs) go down, and
    ("ok", value) or ("error", traceback text) come back."""

    def __init__(self):
        down_read, down_write = os.pipe()
        up_read, up_write = os.pipe()
        self.process = subprocess.Popen([sys.executable, __file__, str(down_read), str(up_write)],
                                        pass_fds=(down_read, up_write), cwd=ROOT)
        os.close(down_read)
        os.close(up_write)
        self.requests, self.replies = Connection(down_write, readable=False), Connection(up_read, writable=False)

    def call(self, handle, method: str, args: tuple, kwargs: dict, what: str):
        try:
            if self.process.poll() is not None:
                raise EOFError  # died since the last call (its models with it)
            self.requests.send((handle, method, args, kwargs))
            if self.replies.poll(CALL_TIMEOUT_S):
                status, value = self.replies.recv()
                if status == "error":
                    raise RuntimeError(f"llama.cpp's process raised in {what}:\n{value}")
                return value
            self.process.kill()
            died = f"hung for {CALL_TIMEOUT_S} s (killed)"
        except (EOFError, BrokenPipeError, ConnectionResetError):
            code = self.process.wait()
            died = f"died with {signal.Signals(-code).name}" if code < 0 else f"exited with status {code}"
        raise LlamaCppCrashed(f"llama.cpp {died} in {what} on {cpu_name()}; only this test fails "
                              "(the reference runs in its own process)")

    def close(self) -> None:
        self.requests.close()
        self.process.wait(timeout=30)


_child: _Child | None = None


def _live_child() -> _Child:
    """This process's child, a new one if there is none or the last one died."""
    global _child
    if _child is None or _child.process.poll() is not None:
        _child = _Child()
    return _child


def _call(handle, method: str, *args, what: str, **kwargs):
    return _live_child().call(handle, method, args, kwargs, what)


@atexit.register
def _stop_child() -> None:
    if _child is not None and _child.process.poll() is None:
        _child.close()


class RemoteLlama:
    """A LlamaCpp model held by the child process: call its methods as if it were here."""

    def __init__(self, path: str | Path, **options):
        self.path, self.child = Path(path), _live_child()  # the model dies with this child
        self.handle = self.child.call(None, "open", (str(path),), options, f"loading {path}")

    def __getattr__(self, method: str):
        if method.startswith("_") or method in ("path", "child", "handle"):
            raise AttributeError(method)
        return lambda *args, **kwargs: self.child.call(self.handle, method, args, kwargs, f"{method} on {self.path}")

    def __del__(self):
        child = self.__dict__.get("child")
        if child is not None and child.process.poll() is None:
            try:
                child.call(self.handle, "close", (), {}, "close")
            except Exception:
                pass


def quiet_llama(path: str | Path, *, n_ctx: int = 256, n_threads: int = 1, logits_all: bool = False,
                vocab_only: bool = False, **options) -> RemoteLlama:
    """llama.cpp's model for `path` in the child process, with float32 K/V (its default f16 cache
    would round every key and value to 11 bits) and without flash attention (llama-cpp-python's
    Llama class default, which the tests' tolerances were set on: with it a Gemma 3's logits moved
    2.2e-3 of the largest), one thread unless told otherwise. Every position's logits are
    always at hand (`logits`), so `logits_all` asks for nothing more."""
    return RemoteLlama(path, n_ctx=n_ctx, threads=n_threads, kv_type="f32", flash_attn=False, vocab_only=vocab_only,
                       **options)


def llama_cpp_quantize(source: str | Path, target: str | Path, ftype: str) -> None:
    """llama.cpp's own quantizer (llama-quantize) with its default choice of types per tensor."""
    _call(None, "quantize", str(source), str(target), ftype, what=f"quantizing {source} to {ftype}")


def llama_cpp_configuration(**options) -> str:
    """The child's llama.cpp and how it runs (benchmarks/llamacpp_reference.py's configuration)."""
    return _call(None, "configuration", what="reading llama.cpp's configuration", **options)


def crash_for_test() -> None:
    """Kills the child with SIGSEGV during a call, as llama.cpp's AMX path does (tests of the isolation)."""
    _call(None, "crash", what="crash_for_test")


# --- the child ------------------------------------------------------------------------------------

def _serve(requests: Connection, replies: Connection) -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import llamacpp_reference as reference

    models: dict[int, reference.LlamaCpp] = {}
    functions = {"quantize": reference.quantize, "configuration": reference.configuration,
                 "crash": lambda: os.kill(os.getpid(), signal.SIGSEGV)}
    while True:
        try:
            handle, method, args, kwargs = requests.recv()
        except EOFError:
            return  # the parent is done
        try:
            if method == "open":
                model = reference.LlamaCpp(*args, **kwargs)
                models[id(model)] = model
                value = id(model)
            elif method == "close":
                value = models.pop(handle).close()
            elif handle is None:
                value = functions[method](*args, **kwargs)
            else:
                value = getattr(models[handle], method)(*args, **kwargs)
            replies.send(("ok", value))
        except Exception:
            replies.send(("error", traceback.format_exc()))


if __name__ == "__main__":
    _serve(Connection(int(sys.argv[1]), writable=False), Connection(int(sys.argv[2]), readable=False))
