"""Blocks of llama.cpp's formats for tests that need them without llama.cpp (its K-quants, which the
gguf package can read but not write)."""

from __future__ import annotations

import torch

from glasslm.transforms.ggml import FORMATS


def random_blocks(qtype: str, d_out: int, d_in: int, seed: int = 0) -> torch.Tensor:
    """Valid blocks of `qtype` with random levels and sub-scales: random bytes, the fp16 scales then
    set to small numbers of either sign (any bit pattern of the rest is a block llama.cpp could write)."""
    fmt = FORMATS[qtype]
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (d_out, d_in // fmt.inputs, fmt.bytes), generator=g, dtype=torch.uint8)
    scale = 0.02 / 2 ** fmt.bits / (40 if fmt.inputs == 256 else 1)  # (K sub-scales are up to 63 or 127)
    fields = {"q6_k": [208], "q4_k": [0, 2], "q5_k": [0, 2], "q4_1": [0, 2], "q5_1": [0, 2]}.get(qtype, [0])
    for start in fields:
        values = (torch.randn(d_out, d_in // fmt.inputs, generator=g) * scale).half()
        blocks[..., start:start + 2] = values.view(torch.uint8).reshape(d_out, -1, 2)
    return blocks.reshape(d_out, -1)


def held_bytes(model: torch.nn.Module) -> int:
    """The bytes of every weight tensor a model holds, each storage once: parameters, saved buffers and
    the kernels' packed copies of quantized layers (what its weights cost in memory, whatever their
    layout; not the tables computed from the config, such as rotary angles)."""
    tensors = list(model.parameters())
    for module in model.modules():
        tensors += [b for name, b in module.named_buffers(recurse=False)
                    if b is not None and name not in module._non_persistent_buffers_set]
        packed = getattr(module, "_kernel", None)
        if packed is not None and hasattr(packed, "operands"):
            tensors += [t for t in packed.operands() if isinstance(t, torch.Tensor)]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors if t.device.type != "meta"}
    return sum(storages.values())
