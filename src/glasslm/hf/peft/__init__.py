"""LoRA adapters both ways between glasslm and Hugging Face PEFT (peft 0.21 is the reference).

`export_peft_adapter` writes adapter_config.json + adapter_model.safetensors that
`peft.PeftModel.from_pretrained(<the exported base>, directory)` loads and computes the same with;
`import_peft_adapter` puts a PEFT LoRA adapter trained elsewhere onto a glasslm model of its base,
and `load_peft_model` loads a PEFT adapter directory with its base, as
`peft.AutoPeftModelForCausalLM.from_pretrained` does.

Supported both ways, with logits equal to PEFT's: LoRA on every linear map of a block, on the
unembedding (a tied one too) and on the token embedding; DoRA; rsLoRA; rank and alpha patterns;
trained biases (`bias="all"` / `"lora_only"`); whole trained embedding and unembedding
(`modules_to_save`). Anything else an adapter sets (lora_bias, trainable_token_indices, ...) is refused
by name: an adapter is never loaded as a different model.

Where things are: `files` (the directory: config checks, tensors sorted by module), `layout` (which
of glasslm's rows each HF module holds), `importer`, `exporter`, `loading` (an adapter with its base).

Example:
    >>> import copy, tempfile
    >>> import torch
    >>> from glasslm.core.model import TransformerLM
    >>> from glasslm.presets import get_preset
    >>> from glasslm.transforms import apply_transform
    >>> from glasslm.transforms.lora import LoRAConfig
    >>> base = TransformerLM(get_preset("llama-tiny", n_layers=1)).eval()
    >>> model = copy.deepcopy(base)
    >>> apply_transform(model, "lora", LoRAConfig(rank=4, sites=("q", "v"), dora=True))
    >>> folder = export_peft_adapter(model, tempfile.mkdtemp())
    >>> sorted(p.name for p in folder.iterdir())
    ['adapter_config.json', 'adapter_model.safetensors']
    >>> import_peft_adapter(base, folder)
    >>> ids = torch.tensor([[1, 2, 3]])
    >>> torch.allclose(base(ids), model(ids), atol=1e-5)
    True
"""

from glasslm.hf.peft.exporter import PEFT_BASE_DIR, export_peft_adapter, export_peft_with_base
from glasslm.hf.peft.files import (
    ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE, PeftAdapter, PeftAdapterError, is_peft_directory, read_peft_adapter,
)
from glasslm.hf.peft.importer import import_peft_adapter
from glasslm.hf.peft.loading import load_peft_model, peft_base

__all__ = [
    "ADAPTER_CONFIG_FILE", "ADAPTER_WEIGHTS_FILE", "PEFT_BASE_DIR", "PeftAdapter", "PeftAdapterError",
    "export_peft_adapter", "export_peft_with_base",
    "import_peft_adapter", "is_peft_directory", "load_peft_model", "peft_base", "read_peft_adapter",
]
