"""llama.cpp (through llama-cpp-python) as a reference in the tests: a quiet loader for GGUF files."""

from __future__ import annotations

import ctypes
from pathlib import Path

_QUIET = None  # the log callback must outlive every model that logs through it


def quiet_llama(path: str | Path, **options):
    """llama.cpp's model for `path`, with its log silenced and float32 K/V (its default f16 cache
    would round every key and value to 11 bits), one thread unless told otherwise."""
    global _QUIET
    import llama_cpp

    if _QUIET is None:
        llama_cpp.llama_backend_init()
        _QUIET = llama_cpp.llama_log_callback(lambda level, text, user_data: None)
        llama_cpp.llama_log_set(_QUIET, ctypes.c_void_p(0))
    options = {"n_ctx": 256, "n_threads": 1, "verbose": False, "type_k": llama_cpp.GGML_TYPE_F32,
               "type_v": llama_cpp.GGML_TYPE_F32, **options}
    return llama_cpp.Llama(str(path), **options)
