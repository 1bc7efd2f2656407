"""Model transforms: named in-place changes to a model (int8, int4, llama.cpp's blocks, LoRA adapters)
that checkpoints record.

`apply_transform(model, name)` applies one and records it on the model; `save_checkpoint` writes the
record and `load_checkpoint` re-applies it to the empty model before loading the weights (see
`registry`). A new transform is one module defining a `Transform` plus one `register_transform`
line below.

Example:
    >>> from glasslm.presets import get_preset
    >>> from glasslm.core.model import TransformerLM
    >>> model = TransformerLM(get_preset("llama-tiny"))
    >>> apply_transform(model, "int8")
    >>> applied_transforms(model), transform_names()
    ([{'name': 'int8'}], ('int8', 'int4', 'q4_0', 'q4_1', 'q5_0', 'q5_1', 'q8_0', 'q4_k', 'q5_k', 'q6_k', 'f16', 'bf16', 'f32', 'lora', 'row_split', 'expert_blocks'))
"""

from glasslm.core.layers import Embedding
from glasslm.transforms.experts import EXPERT_BLOCKS
from glasslm.transforms.ggml import BF16, F16, F32, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0
from glasslm.transforms.lora import LORA
from glasslm.transforms.quantize import INT4, INT8
from glasslm.transforms.split import ROW_SPLIT
from glasslm.transforms.registry import (TRANSFORMS, Transform, applied_transforms, apply_transform, get_transform,
                                         rebuild_transforms, register_transform, transform_names)

register_transform(INT8)
register_transform(INT4)
register_transform(Q4_0)
register_transform(Q4_1)
register_transform(Q5_0)
register_transform(Q5_1)
register_transform(Q8_0)
register_transform(Q4_K)
register_transform(Q5_K)
register_transform(Q6_K)
register_transform(F16)
register_transform(BF16)
register_transform(F32)
register_transform(LORA)
register_transform(ROW_SPLIT)
register_transform(EXPERT_BLOCKS)



def parameter_count(model) -> int:
    """The model's parameters, counting each quantized layer's weight (int8, int4, llama.cpp blocks:
    buffers, not trained parameters) as the d_out x d_in numbers it stands for: the same count
    whatever format the weights are in.

    >>> from glasslm.presets import get_preset
    >>> from glasslm.core.model import TransformerLM
    >>> model = TransformerLM(get_preset("llama-tiny"))
    >>> before = model.num_parameters()
    >>> apply_transform(model, "int4")
    >>> model.num_parameters() < before, parameter_count(model) == before
    (True, True)
    """
    # A tied model's quantized unembedding is a second copy of the embedding, which is counted already
    # (unless the embedding is itself a lookup into those blocks: then they are the only copy).
    tied = getattr(getattr(model, "config", None), "tie_embeddings", False)
    own_table = isinstance(getattr(model, "embed", None), Embedding)
    copy = model.unembed if tied and own_table else None
    quantized = [m for m in model.modules() if hasattr(m, "dequantized_weight") and hasattr(m, "d_in") and m is not copy]
    return model.num_parameters() + sum(m.d_in * m.d_out for m in quantized)


__all__ = ["TRANSFORMS", "Transform", "applied_transforms", "apply_transform", "get_transform", "parameter_count",
           "rebuild_transforms", "register_transform", "transform_names"]
