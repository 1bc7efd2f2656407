"""A glasslm model as a GGUF file that llama.cpp (and so Ollama, LM Studio, llama-cpp-python) runs.

The model goes out the way llama.cpp's own converter writes the same model's Hugging Face form:
the family's weight table gives the HF tensors, the family's GGUF form makes llama.cpp's changes
and names the metadata, the gguf package's name map names the tensors and its quantizers (which
reproduce llama.cpp's reference bytes) write `q8_0` / `q4_0` / `q4_1`. As in llama.cpp, norms,
biases, position tables and every 1-D tensor stay float32, and a matrix whose rows do not divide
into blocks of 32 falls back to f16. A layer already in the requested block format (a model read
from a GGUF file) is written with its own bytes, so GGUF -> glasslm -> GGUF gives the file's blocks
back unchanged.

Example:
    >>> import tempfile
    >>> from glasslm.core.model import TransformerLM
    >>> from glasslm.hf.gguf.reader import GGUFFile
    >>> from glasslm.presets import get_preset
    >>> path = export_gguf(TransformerLM(get_preset("llama-tiny")), tempfile.mkdtemp() + "/tiny.gguf", None, "q8_0")
    >>> file = GGUFFile.open(path)
    >>> file.arch, file.qtype("blk.0.ffn_up.weight"), file.qtype("blk.0.attn_norm.weight")
    ('llama', 'q8_0', 'f32')
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from glasslm.core.model import TransformerLM
from glasslm.hf.errors import UnsupportedModelError
from glasslm.hf.families import HFFamily, family_for
from glasslm.hf.gguf.rope_factors import llama3_factors
from glasslm.transforms.ggml import BLOCK_SIZE, BlockEmbedding, BlockLinear
from glasslm.transforms.split import RowSplitLinear

GGUF_TYPES = ("f32", "f16", "q8_0", "q4_0", "q4_1")
_FILE_TYPES = {"f32": "ALL_F32", "f16": "MOSTLY_F16", "q8_0": "MOSTLY_Q8_0", "q4_0": "MOSTLY_Q4_0", "q4_1": "MOSTLY_Q4_1"}


def _family(model: TransformerLM) -> HFFamily:
    family = family_for(model.config)
    if family.gguf is None:
        raise UnsupportedModelError(f"this model is a {family.name}, which llama.cpp has no exact architecture for "
                                    "(its 'llama' architecture ignores sliding windows)")
    return family


def _tensor_type(gguf_name: str, tensor: Tensor, qtype: str) -> str:
    """The type llama.cpp's converter would give this tensor at file type `qtype`."""
    if tensor.dim() <= 1 or gguf_name.endswith("_norm.weight") or not gguf_name.endswith(".weight"):
        return "f32"
    if gguf_name.startswith("position_embd"):
        return "f32"
    if qtype in ("q8_0", "q4_0", "q4_1") and tensor.shape[-1] % BLOCK_SIZE:
        return "f16"
    return qtype


def _encode(tensor: Tensor, qtype: str) -> tuple[Any, Any]:
    """(numpy data, raw dtype or None) for the gguf writer."""
    import numpy as np
    from gguf import GGMLQuantizationType, quants

    values = tensor.detach().float().cpu().numpy().astype(np.float32)
    if qtype == "f32":
        return values, None
    if qtype == "f16":
        return values.astype(np.float16), None
    return quants.quantize(values, GGMLQuantizationType[qtype.upper()]), GGMLQuantizationType[qtype.upper()]


def _block_layers(model: TransformerLM) -> dict[str, BlockLinear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, BlockLinear)}


def _tied_copy(model: TransformerLM) -> bool:
    """Whether the model's unembedding is a block copy of its embedding (a GGUF file's tied output)."""
    return model.config.tie_embeddings and isinstance(model.unembed, BlockLinear)


def _float_state_dict(model: TransformerLM) -> dict[str, Tensor]:
    """The model's tensors as a float model names them: every block-quantized weight dequantized under
    its Linear's name, a row split's parts joined again, a block embedding as its float table (a tied
    unembedding's blocks left out: the file's token embedding is that matrix)."""
    state = {name: t.detach() for name, t in model.state_dict().items() if not name.endswith(".weight_blocks")}
    whole: dict[str, nn.Module] = {}  # layers written as one float weight (their parts' entries dropped)
    for name, module in model.named_modules():
        if isinstance(module, (RowSplitLinear, BlockEmbedding)) or (
                isinstance(module, BlockLinear) and not any(name.startswith(w + ".") for w in whole)):
            whole[name] = module
    for name, module in whole.items():
        for key in [k for k in state if k.startswith(name + ".parts.") or k.startswith(name + ".table.")]:
            del state[key]
        if name == "unembed" and _tied_copy(model):
            continue
        if hasattr(module, "expert_matrices"):  # a mixture of experts' stacked projection (transforms/experts.py)
            state[name] = module.weight.detach()  # (n_experts, d_out, d_in), as the float parameter
            continue
        state[name + ".weight"] = (module.dequantized_weight() if isinstance(module, BlockLinear) else module.weight).detach()
        if isinstance(module, RowSplitLinear) and module.bias is not None:
            state[name + ".bias"] = module.bias.detach()
    return state


def _kept_blocks(model: TransformerLM, family: HFFamily, hf: dict[str, Any], qtype: str) -> dict[str, Tensor]:
    """GGUF name -> block bytes, for the HF tensors made only of rows of a layer already in `qtype`
    blocks (found by sending row numbers through the export steps, as import does)."""
    layers = {name: layer for name, layer in _block_layers(model).items() if layer.qtype == qtype}
    if _tied_copy(model) and model.unembed.qtype == qtype:
        layers["embed"] = layers.pop("unembed")  # the token embedding's own blocks, as the file held them
    elif isinstance(model.embed, BlockEmbedding) and model.embed.rows().qtype == qtype:
        layers["embed"] = layers.pop("embed.table")
    table = family.gguf_weight_table(model.config)
    name_map = _name_map(model, family)
    # HF name -> the blocks of each of our tensors cut from it (Phi-3's gate|up: two), in table order.
    parts: dict[str, list[Tensor | None]] = {}
    for ours, (hf_names, _, to_hf) in table.entries.items():
        layer = layers.get(ours.removesuffix(".weight"))
        probe = torch.arange(layer.d_out if layer else 1, dtype=torch.float64)[:, None]
        outs = [family.gguf.to_gguf(n, t, hf) for n, t in zip(hf_names, to_hf(probe))] if layer else []
        rows_only = layer is not None and all(t.dim() == 2 and t.shape[1] == 1 for t in outs)
        for i, hf_name in enumerate(hf_names):
            parts.setdefault(hf_name, []).append(layer.blocks()[outs[i][:, 0].long()] if rows_only else None)
    # An HF tensor is written from kept blocks only where every part of it is.
    return {name_map(hf_name): torch.cat(blocks) for hf_name, blocks in parts.items()
            if all(b is not None for b in blocks)}


def _name_map(model: TransformerLM, family: HFFamily) -> Callable[[str], str]:
    import gguf

    arch = {name: arch for arch, name in gguf.MODEL_ARCH_NAMES.items()}[family.gguf.arch]
    names = gguf.get_tensor_name_map(arch, model.config.n_layers)

    def name(hf_name: str) -> str:
        found = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if found is None:
            raise UnsupportedModelError(f"the gguf package has no GGUF name for {hf_name} ({family.name})")
        return found

    return name


def gguf_tensors(model: TransformerLM, qtype: str = "f32") -> dict[str, tuple[Any, Any]]:
    """GGUF name -> (numpy data, raw ggml type or None) of every tensor of `model` at file type `qtype`."""
    from glasslm.hf.convert import config_to_hf
    from glasslm.hf.plan import hf_tensors

    if qtype not in GGUF_TYPES:
        raise ValueError(f"GGUF type {qtype!r} is not one glasslm writes; choose from {', '.join(GGUF_TYPES)}")
    family = _family(model)
    # A bias-free GPT-2 shape is written with zero biases, which llama.cpp's GPT-2 always reads:
    # the same logits (GGUF has no way to say the biases are absent, so it reads back with zeros).
    hf = config_to_hf(model.config, zero_biases=True)
    table = family.gguf_weight_table(model.config)
    name_map = _name_map(model, family)
    kept = _kept_blocks(model, family, hf, qtype)
    out: dict[str, tuple[Any, Any]] = {}
    for hf_name, tensor in hf_tensors(table, _float_state_dict(model), zero_biases=True).items():
        gguf_name = name_map(hf_name)
        if gguf_name in kept:
            from gguf import GGMLQuantizationType

            out[gguf_name] = kept[gguf_name].numpy(), GGMLQuantizationType[qtype.upper()]
        else:
            tensor = family.gguf.to_gguf(hf_name, tensor, hf)
            out[gguf_name] = _encode(tensor, _tensor_type(gguf_name, tensor, qtype))
    if model.config.positional == "rope" and model.config.rope_scaling == "llama3":
        out["rope_freqs.weight"] = _encode(_llama3_divisors(model.config, family), "f32")
    return out


def _llama3_divisors(config: Any, family: HFFamily) -> Tensor:
    """Llama 3's rope scaling as llama.cpp reads it: one divisor per rotated pair (rope_freqs.weight)."""
    import gguf

    arch = {name: arch for arch, name in gguf.MODEL_ARCH_NAMES.items()}[family.gguf.arch]
    if gguf.MODEL_TENSOR.ROPE_FREQS not in gguf.MODEL_TENSORS[arch]:
        raise UnsupportedModelError(f"llama.cpp's {family.gguf.arch} reads no rope_freqs, which Llama 3's rope "
                                    "scaling needs")
    c = config
    return llama3_factors(c.rope_theta, c.rotary_dims or c.d_head, c.rope_factor, c.rope_low_freq_factor,
                          c.rope_high_freq_factor, c.rope_original_context)


def _write_value(writer: Any, key: str, value: Any) -> None:
    if isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        writer.add_uint32(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    elif isinstance(value, str):
        writer.add_string(key, value)
    else:
        raise TypeError(f"no GGUF value type for {key}={value!r}")


def _write_vocabulary(writer: Any, vocab: Any) -> None:
    writer.add_tokenizer_model(vocab.model)
    if vocab.pre is not None:
        writer.add_tokenizer_pre(vocab.pre)
    writer.add_token_list(vocab.tokens)
    writer.add_token_types(vocab.token_types)
    if vocab.merges is not None:
        writer.add_token_merges(vocab.merges)
    if vocab.scores is not None:
        writer.add_token_scores(vocab.scores)
    for role, write in (("bos", writer.add_bos_token_id), ("eos", writer.add_eos_token_id),
                        ("unk", writer.add_unk_token_id), ("pad", writer.add_pad_token_id)):
        if role in vocab.special_ids:
            write(vocab.special_ids[role])
    writer.add_add_bos_token(vocab.add_bos)
    if vocab.add_space_prefix is not None:
        writer.add_add_space_prefix(vocab.add_space_prefix)
    if vocab.chat_template:
        writer.add_chat_template(vocab.chat_template)


def export_gguf(model: TransformerLM, path: str | os.PathLike, tokenizer: Any | None, qtype: str = "f32",
                chat_template: str | None = None, name: str | None = None) -> Path:
    """Write `model` (and `tokenizer`, with `chat_template` or the tokenizer's own) as a GGUF file at
    `path`, its matrices in `qtype` (f32, f16, q8_0, q4_0, q4_1). Written to a temporary name and
    renamed into place: a failed export leaves nothing half-written."""
    import gguf

    from glasslm.hf.convert import config_to_hf
    from glasslm.tokenizers.gguf import gguf_vocabulary

    family = _family(model)
    tensors = gguf_tensors(model, qtype)  # first: refusals come before anything is written
    vocab = gguf_vocabulary(tokenizer, chat_template, model.config.vocab_size) if tokenizer is not None else None
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        writer = gguf.GGUFWriter(staging, family.gguf.arch)
        writer.add_name(name or path.stem)
        writer.add_file_type(gguf.LlamaFileType[_FILE_TYPES[qtype]])
        for key, value in family.gguf.gguf_values(config_to_hf(model.config, zero_biases=True)).items():
            _write_value(writer, f"{family.gguf.arch}.{key}", value)
        if vocab is not None:
            _write_vocabulary(writer, vocab)
        for tensor_name, (data, raw_dtype) in tensors.items():
            writer.add_tensor(tensor_name, data, raw_dtype=raw_dtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(staging, path)
    finally:
        staging.unlink(missing_ok=True)
    return path
