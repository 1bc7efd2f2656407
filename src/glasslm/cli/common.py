"""Option groups several commands share, and loading a model the way those options say.

    >>> RuntimeOptions(dtype="bfloat16").quantize
    'none'
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any, Literal

from glasslm.transforms import apply_transform, transform_names

def quantization_choices() -> tuple[str, ...]:
    """none, or a quantization transform registered in glasslm.transforms (read when a parser is built)."""
    return ("none", *transform_names("quantization"))


@dataclass
class CheckpointOption:
    """the model"""

    # glasslm checkpoint or run directory, Hugging Face model directory, hub name (glasslm download), or GGUF file
    checkpoint: str
    revision: str | None = None  # with a hub name: the downloaded branch, tag or commit; none: main, else the newest
    # a LoRA checkpoint's base where it is now, if it moved or was copied (its weights must hash as
    # the adapters recorded); none: the base the adapters recorded
    base: str | None = field(default=None, metadata={"metavar": "PATH"})

    def __post_init__(self) -> None:
        # Resolved here, once, so that every command taking --checkpoint honours --revision alike.
        if self.revision is not None:
            from glasslm.hf.cache import resolve_model_path

            self.checkpoint = str(resolve_model_path(self.checkpoint, self.revision))


@dataclass
class OutputOption:
    """output"""

    out: str  # where to write the result (a directory)
    overwrite: bool = False  # replace what a non-empty --out holds; without it such an --out is refused


@dataclass
class DeviceOptions:
    """where the model runs"""

    device: str = "auto"  # auto (the best available: cuda, else mps, else cpu), cpu, cuda, cuda:N or mps
    # CPU threads; 0 is automatic: 1 for decoding models under 20M parameters (they decode fastest
    # on one thread), else one per core the machine's load leaves free
    threads: int = 0


@dataclass
class RuntimeOptions(DeviceOptions):
    """how the model runs"""

    # weights' dtype; auto: bfloat16 on CUDA and on CPUs with bf16 units. Decoding on a CPU keeps 16-bit
    # weights as they are and float32 activations (glasslm's kernels convert the weights in registers)
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = "float32"
    # weight-only int8 (a quarter of fp32's bytes), int4 (an eighth, in groups of 64 inputs with
    # their own scale), llama.cpp's q4_0 / q4_1 / q5_0 / q5_1 / q8_0 blocks of 32, or f16 / bf16
    # weights with float32 activations, for the Linear layers
    quantize: str = field(default="none", metadata={"choices": quantization_choices})
    # how a prompt of 32+ tokens rounds its activations for quantized weights on a CPU: int16 (two
    # int8 passes: the decoding step's numbers) or int8 (one pass, as llama.cpp rounds them: about
    # half the prompt time on K-quant files, each activation up to 1/254 of its block's largest off)
    prefill_activations: Literal["int16", "int8"] = "int16"


def load_for_inference(path: str, runtime: DeviceOptions, decoding: bool = False,
                       need_tokenizer: bool = True, base: str | None = None) -> tuple[Any, Any]:
    """The model and tokenizer at `path` (a LoRA checkpoint on `base`, if given) on the device,
    dtype, threads and quantization of `runtime`."""
    from glasslm.hf import load_model

    model, tokenizer = load_model(path, device=resolve_device(runtime.device), base=base)
    if getattr(model, "gguf_summary", None):
        print(f"{path}: {model.gguf_summary}", file=sys.stderr)
    if tokenizer is None and need_tokenizer:
        raise ValueError(f"{path} holds no tokenizer, so text cannot be encoded")
    return prepare_model(model, runtime, decoding), tokenizer


def prepare_model(model: Any, runtime: DeviceOptions, decoding: bool = False) -> Any:
    """Apply threads, dtype and quantization to a loaded model; threads are set here, in the CLI only."""
    import torch

    from glasslm.runtime import default_dtype, warn_if_slow_dtype

    device = next(model.parameters()).device.type
    if device == "cpu":
        set_threads(runtime.threads, model.num_parameters() if decoding else None)
    if not isinstance(runtime, RuntimeOptions):
        return model.eval()
    if device == "cpu":
        from glasslm.kernels.qmatmul import set_prefill_activations

        set_prefill_activations(runtime.prefill_activations)
    dtype = default_dtype(device) if runtime.dtype == "auto" else runtime.dtype
    if _sixteen_bit_weights(model, device, dtype, runtime.quantize, decoding):
        apply_transform(model, {"bfloat16": "bf16", "float16": "f16"}[dtype])
        return model.eval()
    warn_if_slow_dtype(dtype, device)
    model = model.to(getattr(torch, dtype)).eval()
    if runtime.quantize != "none":
        apply_transform(model, runtime.quantize)
    elif decoding:
        from glasslm.generation import optimize_for_decoding

        optimize_for_decoding(model)
    if decoding and device == "cpu":
        from glasslm.kernels.build import load

        load()  # a first build of the C++ kernels happens (and says so) here, not inside the first answer's time
    return model


def _sixteen_bit_weights(model: Any, device: str, dtype: str, quantize: str, decoding: bool) -> bool:
    """Whether `--dtype bfloat16/float16` is best served by keeping the float Linears' weights 16-bit with
    float32 activations (the `bf16` / `f16` transforms: decoding on a CPU with glasslm's kernels), rather
    than by running the whole model in that dtype (PyTorch's 16-bit CPU matmuls, slow without bf16 units)."""
    from glasslm.core.layers import Linear
    from glasslm.kernels.qmatmul import kernel_ops

    return (decoding and device == "cpu" and dtype in ("bfloat16", "float16") and quantize == "none"
            and kernel_ops() is not None and any(isinstance(m, Linear) for m in model.modules()))


def set_threads(requested: int, decoding_parameters: int | None = None) -> int | None:
    """Set torch's CPU threads as `runtime.choose_threads` decides (a line on stderr says why when
    it is fewer than the cores); the count set, or None where OMP_NUM_THREADS left torch's."""
    import torch

    from glasslm.runtime import choose_threads

    choice = choose_threads(requested, decoding_parameters)
    if choice.threads:
        torch.set_num_threads(choice.threads)
    if choice.note:
        print(choice.note, file=sys.stderr)
    return choice.threads


def resolve_device(name: str) -> str:
    """The device to load a model on; a missing one is refused before the checkpoint is read."""
    from glasslm.training.distributed import resolve_device as resolve

    return resolve(name)


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised like Ctrl-C so that commands clean up what they were writing."""

    signum = 15
