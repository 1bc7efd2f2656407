"""benchmarks/bench_llamacpp.py writes GGUF files llama.cpp reads as the same model glasslm loads:
on tiny random models with sharp logits, llama.cpp's greedy tokens (its own loader and kernels)
equal glasslm's, row for row in a batch of 8, for GPT-2 and for a Llama with grouped-query heads."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("llama_cpp")
pytest.importorskip("gguf")

from glasslm.hf import load_model  # noqa: E402
from tests.llamacpp import RemoteLlama  # noqa: E402


@pytest.fixture(scope="module")
def bench():
    path = Path(__file__).parents[2] / "benchmarks" / "bench_llamacpp.py"
    spec = importlib.util.spec_from_file_location("bench_llamacpp", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tiny(kind: str, directory: Path) -> dict:
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if kind == "gpt2":  # a wide init: logits far apart, so greedy tokens are a sharp comparison
        model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=128, n_head=4, initializer_range=0.5))
    else:
        model = LlamaForCausalLM(LlamaConfig(vocab_size=1000, hidden_size=128, intermediate_size=256,
                                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                             tie_word_embeddings=True, initializer_range=0.5))
    model.save_pretrained(directory)
    return json.loads((directory / "config.json").read_text())


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_llama_cpp_decodes_the_written_gguf_as_glasslm_decodes_the_hf_directory(bench, kind, tmp_path):
    from safetensors.torch import load_file

    from glasslm.locations import data_dir

    if not (data_dir() / "gpt2" / "gpt2_vocab.json").exists():
        pytest.skip("the GGUF vocabulary is GPT-2's, read from the data directory's gpt2/ folder")

    hf = tiny(kind, tmp_path / "hf")
    bench.write_gguf(kind, hf, load_file(tmp_path / "hf" / "model.safetensors"), tmp_path / "f32.gguf")
    ours, _ = load_model(tmp_path / "hf")
    prompts = [[i, 3 * i + 7] for i in range(8)]
    # The benchmark's own llama.cpp runner (llamacpp_reference.LlamaCpp), in the tests' child process.
    theirs = RemoteLlama(tmp_path / "f32.gguf", batch=8, n_ctx=64).greedy(prompts, 12)
    alone = [RemoteLlama(tmp_path / "f32.gguf", batch=1, n_ctx=64).greedy([p], 12)[0] for p in prompts[:2]]
    assert theirs[:2] == alone  # llama.cpp's batch runner keeps rows apart
    assert theirs == bench.glasslm_greedy(ours, prompts, 12)
