"""Compile-friendly decoding: a position-addressed KV cache gives the same logits as the cursor one,
and a compiled decoding step is traced once and reused (no recompilation per step or per layer)."""

from __future__ import annotations

import pytest
import torch

from glasslm.presets import get_preset
from glasslm.core.model import TransformerLM


@pytest.mark.parametrize("preset", ["llama-tiny", "gpt2-small"])
def test_static_cache_decoding_equals_the_cursor_cache(preset):
    torch.manual_seed(0)
    overrides = {"n_layers": 2, "d_model": 64, "n_heads": 4, "vocab_size": 97, "context_length": 32}
    if preset == "llama-tiny":
        overrides["n_kv_heads"] = 2  # grouped-query heads through the static path too
    model = TransformerLM(get_preset(preset, **overrides)).eval()
    tokens = torch.randint(0, 97, (2, 12))
    cursor, static = model.new_kv_cache(2, 32), model.new_static_kv_cache(2, 32)
    with torch.no_grad():
        expected = [model(tokens[:, :5], kv_cache=cursor)[:, -1]]
        got = [model(tokens[:, :5], positions=torch.arange(5), kv_cache=static)[:, -1]]
        for pos in range(5, 12):
            expected.append(model(tokens[:, pos:pos + 1], kv_cache=cursor)[:, -1])
            got.append(model(tokens[:, pos:pos + 1], positions=torch.tensor([pos]), kv_cache=static)[:, -1])
    torch.testing.assert_close(torch.stack(got), torch.stack(expected), atol=1e-5, rtol=1e-5)


def test_compiled_decoding_step_is_not_recompiled_after_warm_up(unchecked_shapes):
    # (The test-time shape checks wrap forward in Python the tracer cannot follow; they are off here.)
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = TransformerLM(get_preset("llama-tiny", n_layers=2, vocab_size=97, context_length=64)).eval()
    cache = model.new_static_kv_cache(1, 64)
    # The eager backend traces with dynamo exactly as inductor would, without generating kernels.
    step = torch.compile(model, backend="eager", dynamic=False)
    token = torch.tensor([[3]])
    with torch.no_grad():
        for pos in range(3):  # warm-up: the first decode shapes are traced here
            token = step(token, positions=torch.tensor([pos]), kv_cache=cache)[:, -1:].argmax(-1)
        with torch._dynamo.config.patch(error_on_recompile=True):
            for pos in range(3, 40):  # any recompilation raises
                token = step(token, positions=torch.tensor([pos]), kv_cache=cache)[:, -1:].argmax(-1)
    assert token.shape == (1, 1)
