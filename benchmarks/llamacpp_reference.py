"""llama.cpp, the reference glasslm is measured and tested against, set up to run on every CPU kind here.

Used by benchmarks/bench_llamacpp.py (in its own process, to time it) and by the tests (through
tests/llamacpp.py, in a child process, so that a crash fails one test). Never imported by glasslm.

Why a set-up at all: llama.cpp's CPU backend may keep weights in "extra" buffer types, layouts
repacked for one instruction set. A native build on an Intel Xeon with AMX compiles its AMX buffer
type, and that build segfaults in `llama_decode` on SmolLM2's Q4_0 / Q4_1 / Q8_0 files on these
machines. With the extra buffer types off (`use_extra_bufts = False` in the model's parameters) the
same build runs the plain CPU kernels. So they are switched off exactly where the build has AMX
(llama.cpp's own system info says `AMX_INT8 = 1`), or where `GLASSLM_LLAMACPP_EXTRA_BUFTS=0` says
so (which lets a machine without AMX run the fallback too), and the choice is printed.

    from llamacpp_reference import LlamaCpp, configuration
    print(configuration())                      # llama.cpp 0.3.36 (...): extra buffer types on: ...
    model = LlamaCpp("SmolLM2-135M-Instruct.Q4_1.gguf", n_ctx=512, kv_type="f32")
    ids = model.tokenize("The capital of France is")
    logits = model.logits(ids)                  # (len(ids), vocab) float32, every position
"""

from __future__ import annotations

import ctypes
import os
import re
from pathlib import Path

import numpy as np

EXTRA_BUFTS_VARIABLE = "GLASSLM_LLAMACPP_EXTRA_BUFTS"
_SETTINGS = {"0": False, "off": False, "false": False, "no": False, "1": True, "on": True, "true": True, "yes": True}
_QUIET = None  # llama.cpp's log callback must outlive every model that logs through it


def _api():
    """llama-cpp-python's C API, its backend started and its log silenced once per process."""
    global _QUIET
    import llama_cpp

    if _QUIET is None:
        llama_cpp.llama_backend_init()
        _QUIET = llama_cpp.llama_log_callback(lambda level, text, user_data: None)
        llama_cpp.llama_log_set(_QUIET, ctypes.c_void_p(0))  # llama.cpp logs every tensor it loads
    return llama_cpp


def system_info() -> str:
    """llama.cpp's own list of what its CPU backend was built with ("AVX512 = 1 | AMX_INT8 = 1 | ...")."""
    return _api().llama_print_system_info().decode(errors="replace")


def extra_buffer_types(info: str | None = None, environ=os.environ) -> tuple[bool, str]:
    """(use llama.cpp's extra buffer types?, why): on unless its build has AMX kernels or
    GLASSLM_LLAMACPP_EXTRA_BUFTS says otherwise."""
    setting = environ.get(EXTRA_BUFTS_VARIABLE, "").strip().lower()
    if setting:
        if setting not in _SETTINGS:
            raise ValueError(f"{EXTRA_BUFTS_VARIABLE}={environ[EXTRA_BUFTS_VARIABLE]!r}: use 1 (on) or 0 (off)")
        return _SETTINGS[setting], f"{EXTRA_BUFTS_VARIABLE}={setting}"
    info = system_info() if info is None else info
    if re.search(r"\bAMX\w*\s*=\s*1", info):
        return False, ("this build has AMX kernels (AMX_INT8 = 1), whose weight buffers segfault llama_decode "
                       f"on these Xeons; {EXTRA_BUFTS_VARIABLE}=1 forces them on")
    return True, "llama.cpp's default (no AMX in this build)"


def configuration(extra_bufts: bool | None = None) -> str:
    """One line saying which llama.cpp runs and how, for a benchmark's output or a test report."""
    import llama_cpp

    reason = "asked for" if extra_bufts is not None else None
    if extra_bufts is None:
        extra_bufts, reason = extra_buffer_types()
    features = [f for f, on in re.findall(r"(\w+) = (\d)", system_info()) if on == "1"]
    state = "on" if extra_bufts else "off (use_extra_bufts=False: plain CPU kernels, no repacked weights)"
    return (f"llama.cpp (llama-cpp-python {llama_cpp.__version__}, built with {' '.join(features)}): "
            f"extra buffer types {state}; {reason}")


def quantize(source: str | Path, target: str | Path, ftype: str) -> None:
    """llama.cpp's own quantizer (llama-quantize) with its default choice of type per tensor
    (e.g. q6_K for a tied output at q4_0); `ftype` as in LLAMA_FTYPE_MOSTLY_*: "q4_0", "q4_k_m", "f16"."""
    api = _api()
    params = api.llama_model_quantize_default_params()
    params.ftype = getattr(api, f"LLAMA_FTYPE_MOSTLY_{ftype.upper()}")
    status = api.llama_model_quantize(str(source).encode(), str(target).encode(), ctypes.byref(params))
    if status != 0:
        raise RuntimeError(f"llama_model_quantize({ftype}) failed with {status} on {source}")


class LlamaCpp:
    """One GGUF model in llama.cpp through llama-cpp-python's C API: `batch` sequences of up to `n_ctx`
    tokens each, greedy decoding with the argmax on the host (as glasslm's greedy sampler does),
    every position's logits, and its tokenizer. `kv_type="f32"` keeps keys and values in float32
    (the default f16 cache rounds them to 11 bits); `flash_attn=None` and `extra_bufts=None` leave the
    choice to llama.cpp's default and to extra_buffer_types."""

    def __init__(self, path: str | Path, batch: int = 1, n_ctx: int = 256, *, threads: int = 1,
                 kv_type: str = "f16", flash_attn: bool | None = None, vocab_only: bool = False,
                 extra_bufts: bool | None = None):
        api = self.api = _api()
        self.path = Path(path)
        model_params = api.llama_model_default_params()
        model_params.use_extra_bufts = extra_buffer_types()[0] if extra_bufts is None else extra_bufts
        model_params.vocab_only = vocab_only
        self.model = api.llama_model_load_from_file(str(path).encode(), model_params)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        self.vocab = api.llama_model_get_vocab(self.model)
        self.n_vocab = api.llama_vocab_n_tokens(self.vocab)
        self.ctx = self.batch = None
        if not vocab_only:
            params = api.llama_context_default_params()
            params.n_ctx, params.n_batch, params.n_ubatch, params.n_seq_max = n_ctx * batch, 512, 512, batch
            params.n_threads = params.n_threads_batch = threads
            params.type_k = params.type_v = getattr(api, f"GGML_TYPE_{kv_type.upper()}")
            if flash_attn is not None:
                params.flash_attn_type = api.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash_attn else api.LLAMA_FLASH_ATTN_TYPE_DISABLED
            self.ctx = api.llama_init_from_model(self.model, params)
            if not self.ctx:
                raise RuntimeError(f"llama.cpp could not make a context for {path}")
            self.batch = api.llama_batch_init(512, 0, batch)

    def close(self) -> None:
        """Frees llama.cpp's batch, context and model (a long-lived process loads many)."""
        if self.batch is not None:
            self.api.llama_batch_free(self.batch)
        if self.ctx:
            self.api.llama_free(self.ctx)
        if self.model:
            self.api.llama_model_free(self.model)
        self.model = self.ctx = self.batch = None

    def tokenize(self, text: str | bytes, add_bos: bool = False, special: bool = True) -> list[int]:
        """llama.cpp's tokenizer; `special`: special tokens written in the text become their ids."""
        data = text.encode() if isinstance(text, str) else text
        room = len(data) + 16
        tokens = (self.api.llama_token * room)()
        count = self.api.llama_tokenize(self.vocab, data, len(data), tokens, room, add_bos, special)
        if count < 0:  # more tokens than room: -count is how many
            room = -count
            tokens = (self.api.llama_token * room)()
            count = self.api.llama_tokenize(self.vocab, data, len(data), tokens, room, add_bos, special)
        return list(tokens[:count])

    def set_threads(self, threads: int) -> None:
        self.api.llama_set_n_threads(self.ctx, threads, threads)

    def clear(self) -> None:
        self.api.llama_memory_clear(self.api.llama_get_memory(self.ctx), True)

    def _decode(self, items: list[tuple[int, int, int, bool]]) -> None:
        """items: (token, position, sequence, wants logits), at most 512."""
        b = self.batch
        for i, (token, position, sequence, logits) in enumerate(items):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = token, position, 1, logits
            b.seq_id[i][0] = sequence
        b.n_tokens = len(items)
        status = self.api.llama_decode(self.ctx, b)
        if status != 0:
            raise RuntimeError(f"llama_decode returned {status}")

    def _logits_at(self, index: int) -> np.ndarray:
        return np.ctypeslib.as_array(self.api.llama_get_logits_ith(self.ctx, index), shape=(self.n_vocab,))

    def _argmax(self, index: int) -> int:
        return int(self._logits_at(index).argmax())

    def prefill(self, prompt: list[int], every_position: bool = False) -> list[np.ndarray]:
        """Reads `prompt` into sequence 0 from an empty cache, 512 tokens a call; returns the logits of
        every position (every_position) or none (the last one stays readable at index -1)."""
        self.clear()
        rows = []
        for start in range(0, len(prompt), 512):
            chunk = prompt[start:start + 512]
            self._decode([(t, start + i, 0, every_position or start + i == len(prompt) - 1)
                          for i, t in enumerate(chunk)])
            rows += [self._logits_at(i).copy() for i in range(len(chunk))] if every_position else []
        return rows

    def logits(self, prompt: list[int]) -> np.ndarray:
        """Every position's logits after reading `prompt`: float32 (len(prompt), vocab)."""
        return np.stack(self.prefill(prompt, every_position=True))

    def last_logits(self, prompt: list[int]) -> np.ndarray:
        """The logits after `prompt`, as float32 (vocab,)."""
        self.prefill(prompt)
        return self._logits_at(-1).copy()

    def greedy(self, prompts: list[list[int]], n_new: int) -> list[list[int]]:
        """`n_new` greedy tokens after each prompt, the prompts decoded together as one batch."""
        self.clear()
        items = [(t, p, s, p == len(row) - 1) for s, row in enumerate(prompts) for p, t in enumerate(row)]
        self._decode(items)
        last = [i for i, item in enumerate(items) if item[3]]
        out = [[self._argmax(i)] for i in last]
        for step in range(n_new - 1):
            self._decode([(row[-1], len(prompt) + step, s, True) for s, (row, prompt) in enumerate(zip(out, prompts))])
            for s, row in enumerate(out):
                row.append(self._argmax(s))
        return out
