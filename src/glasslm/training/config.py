"""What a training run is, apart from the architecture: `TrainConfig`, and each preset's recipe as one.

Example:
    >>> from glasslm.training.config import TrainConfig, get_recipe
    >>> TrainConfig(max_steps=10).max_steps
    10
    >>> get_recipe("shakespeare-char-cpu").optimizer
    'muon'
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

from glasslm.core.fields import checked
from glasslm.presets import DEFAULT_RECIPE, lookup_preset, presets_with_recipes

DType = Literal["float32", "bfloat16", "float16"]
OptimizerName = Literal["adamw", "muon"]
NSDType = Literal["auto", "bfloat16", "float32"]


@dataclass
class TrainConfig:
    """Everything about a run that is not the architecture. Saved (as JSON) with every checkpoint."""

    max_steps: int = 2000  # optimizer steps in the whole run (a resumed run continues up to it)
    batch_size: int = 12  # sequences per micro-batch per process
    grad_accum_steps: int = 1  # micro-batches per optimizer step
    lr: float = 1e-3  # peak learning rate, reached at the end of warmup
    min_lr: float = 1e-4  # learning rate at the end of the cosine decay, and after it
    warmup_steps: int = 100  # steps of linear warmup to lr
    lr_decay_steps: int | None = None  # step where the cosine decay ends; None (or 0): max_steps
    optimizer: OptimizerName = "adamw"  # adamw, or muon: Newton–Schulz-orthogonalised momentum for the blocks' matrices (AdamW for the rest)
    muon_lr: float = 0.02  # Muon's peak learning rate (lr is then AdamW's, for embeddings, unembedding, norms, biases)
    muon_momentum: float = 0.95  # Muon's momentum (Nesterov)
    # precision of Muon's Newton–Schulz iteration; auto: bfloat16 (as torch.optim.Muon) where the device multiplies
    # it natively (CUDA, a CPU with avx512_bf16/AMX), float32 elsewhere (bfloat16 is ~6x slower there)
    muon_ns_dtype: NSDType = "auto"
    beta1: float = 0.9  # AdamW's decay rate of the gradient's running mean
    beta2: float = 0.99  # AdamW's decay rate of the squared gradient's running mean
    eps: float = 1e-8  # AdamW's term added to the root-mean-square denominator
    weight_decay: float = 0.1  # AdamW's decoupled weight decay, on matrices only
    decay_embeddings: bool = False  # also decay token/position embeddings (nanoGPT does)
    grad_clip: float = 1.0  # max global L2 norm of the gradient; 0 disables clipping
    eval_interval: int = 250  # steps between validation runs; 0: only at the end
    eval_iters: int = 20  # validation batches per evaluation (the same batches every time)
    # stop once this many evaluations in a row have not lowered the best validation loss by
    # early_stop_delta (the best checkpoint is kept); 0: run to max_steps
    early_stop: int = 0
    early_stop_delta: float = 1e-3  # the least fall of the validation loss (nats) that counts as improving
    log_interval: int = 10  # steps between metrics records (JSONL) and progress-bar updates
    checkpoint_interval: int = 0  # steps between extra checkpoints; 0: only at evaluations and the end
    keep_last: int = 2  # numbered checkpoints kept (plus the best one); 0 keeps all
    seed: int = 1337  # seeds the initial weights, the batch order and dropout
    device: str = "auto"  # auto: the best available (cuda, else mps, else cpu; cuda:LOCAL_RANK under torchrun), or cpu, cuda, cuda:1, mps
    dtype: DType = "float32"  # bfloat16/float16: autocast the forward pass; weights stay float32
    compile: bool = False  # torch.compile the model (measured no faster on CPU; see docs/training.md)
    # CPU threads for training; 0: one per core the machine's load leaves free (as a library: PyTorch's count)
    threads: int = 0
    fsdp: bool = False  # shard parameters, gradients and optimizer state (FSDP2) instead of DDP
    activation_checkpointing: bool = False  # recompute each block's activations in backward: less memory, ~1 more forward of compute
    tensorboard: bool = False  # also log metrics to TensorBoard (RUN_DIR/tensorboard; needs tensorboard)
    wandb: bool = False  # also log metrics to Weights & Biases, offline unless WANDB_MODE says otherwise
    progress: bool = True  # draw a progress bar with loss, lr and tokens/s (plain lines when stderr is not a terminal)
    init_from: str | None = None  # fine-tune: start from these weights (a glasslm checkpoint, an HF
                                  # directory or a cached hub name) with a fresh optimizer, in a new run;
                                  # `glasslm train` loads them, train() only records the name

    def __post_init__(self) -> None:
        for name in ("max_steps", "batch_size", "eval_iters", "grad_accum_steps", "log_interval"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("warmup_steps", "eval_interval", "checkpoint_interval", "keep_last", "threads", "early_stop"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.early_stop_delta < 0:
            raise ValueError(f"early_stop_delta must be >= 0, got {self.early_stop_delta}")
        if not 0 <= self.min_lr <= self.lr:
            raise ValueError(f"need 0 <= min_lr <= lr, got min_lr={self.min_lr}, lr={self.lr}")
        if self.optimizer not in ("adamw", "muon"):
            raise ValueError(f"optimizer must be 'adamw' or 'muon', got {self.optimizer!r}")
        if self.muon_ns_dtype not in ("auto", "bfloat16", "float32"):
            raise ValueError(f"muon_ns_dtype must be 'auto', 'bfloat16' or 'float32', got {self.muon_ns_dtype!r}")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be 'float32', 'bfloat16' or 'float16', got {self.dtype!r}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "TrainConfig") -> "TrainConfig":
        """From `to_dict`'s output (or JSON/TOML), type-checked; `where` names the source in errors."""
        return cls(**checked(cls, data, where))


def get_recipe(name: str, **overrides: Any) -> "TrainConfig":
    """The training recipe of the preset called `name` as a TrainConfig, with optional overrides.

    `name` may also be "default" (TrainConfig's defaults). A preset with no recipe is refused
    rather than trained with defaults meant for a 0.8M-parameter model:

    >>> get_recipe("shakespeare-char").batch_size
    64
    >>> get_recipe("llama3-8b")
    Traceback (most recent call last):
    ...
    ValueError: preset 'llama3-8b' has no training recipe (...); pick one: recipe 'default' (...) or a preset's: ...
    """
    if name == DEFAULT_RECIPE:
        recipe: dict[str, Any] = {}
    else:
        preset = lookup_preset(name)
        if preset.recipe is None:
            raise ValueError(
                f"preset {name!r} has no training recipe ({preset.about}); pick one: recipe "
                f"'{DEFAULT_RECIPE}' (TrainConfig's defaults) or a preset's: {', '.join(presets_with_recipes())}")
        recipe = preset.recipe
    return TrainConfig(**{**recipe, **overrides})
