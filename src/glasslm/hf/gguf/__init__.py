"""GGUF files, llama.cpp's model format (also Ollama's and LM Studio's), both ways.

`reader` opens a file (metadata and lazily read tensors, through the gguf package), `form` says
what each family looks like in a file (declared in the family's own file beside its HF table),
`importer` builds a glasslm model from a file (`import_gguf`), `exporter` writes one
(`export_gguf`). Tokenizers go through `glasslm.tokenizers.gguf`, 4-bit blocks kept as they are
through `glasslm.transforms.ggml`.

Nothing here imports the importer or exporter at package import time: the families import
`form`, and the importer imports the families.
"""

from glasslm.hf.gguf.reader import GGUF_SUFFIX, GGUFFile, is_gguf_file

__all__ = ["GGUF_SUFFIX", "GGUFFile", "is_gguf_file"]
