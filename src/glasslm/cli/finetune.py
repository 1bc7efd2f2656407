"""`glasslm finetune`: fine-tune a pretrained model on chat / instruction JSONL, with LoRA adapters
(the default), QLoRA (--quantize int4|int8: the frozen base quantized) or every weight (--full);
resumable exactly like `glasslm train`. A LoRA run's checkpoints hold only the adapters plus a
reference to the base (its path and a hash of its weights); `generate`, `chat`, `serve` and `eval`
load them as base + adapters, `glasslm merge` writes a full model.

    glasslm finetune --checkpoint runs/base --data chat.jsonl --lora-rank 8 --out runs/ft
    glasslm finetune --resume runs/ft --max-steps 400
    glasslm finetune --checkpoint Qwen/Qwen2-0.5B --data chat.jsonl --quantize int4 --out runs/qlora \\
        --export-peft runs/qlora-peft
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

from glasslm.cli.command import Command
from glasslm.cli.common import resolve_device, set_threads
from glasslm.cli.options import Group
from glasslm.training.config import TrainConfig
from glasslm.training.finetune import FinetuneConfig

# Fine-tuning's defaults where they differ from pretraining's (TrainConfig's); options win.
FINETUNE_DEFAULTS = {"max_steps": 300, "batch_size": 8, "lr": 2e-4, "min_lr": 2e-5, "warmup_steps": 20,
                     "weight_decay": 0.0, "eval_interval": 50, "log_interval": 10}
TRAINING = Group("training (defaults: TrainConfig's, except " + ", ".join(f"{k} {v:g}" for k, v in
                                                                        FINETUNE_DEFAULTS.items()) + ")",
                 skip=frozenset({"init_from"}))


@dataclass
class FinetuneRun:
    """what to fine-tune, on what, and where"""

    checkpoint: str | None = None  # the base: glasslm checkpoint, HF model directory or cached hub name
    data: str | None = field(default=None, metadata={"metavar": "JSONL"})  # conversations or instruction records
    out: str | None = None  # run directory (checkpoints, metrics.jsonl); none: runs/finetune-<base name>
    resume: str | None = field(default=None, metadata={"metavar": "DIR"})  # continue a fine-tuning run exactly
    overwrite: bool = False  # replace the run an --out holds
    # also write the trained adapters as a PEFT adapter directory (LoRA runs)
    export_peft: str | None = field(default=None, metadata={"metavar": "DIR"})


def finetune(run: FinetuneRun, method: Annotated[dict[str, Any], FinetuneConfig],
             training: Annotated[dict[str, Any], TrainConfig, TRAINING]) -> int:
    from glasslm.training.loop import train
    from glasslm.transforms import parameter_count

    base, config, train_config, out, resume = _plan(run, method, training)
    if resolve_device(train_config.device) == "cpu" or train_config.threads:
        set_threads(train_config.threads)  # the thread count the estimate is timed with
    model, tokenizer, meta, data = _model_and_data(base, config, train_config, run.data if resume is None else None,
                                                   resume)
    n_train = sum(p.numel() for p in model.parameters() if p.requires_grad)
    print(f"fine-tuning {base} ({'full' if config.full else 'LoRA'}{', ' + config.quantize + ' base' if config.quantize != 'none' else ''}): "
          f"{n_train:,} trainable of {parameter_count(model):,} parameters; {len(data[0])} training / "
          f"{len(data[1]) if data[1] else 0} held-out conversations -> {out}")
    result = train(model, train_config, data[0], data[1], run_dir=out, resume=resume, tokenizer=tokenizer,
                   meta=meta, overwrite=run.overwrite)
    if result.stopped_by_signal is not None:
        print(f"interrupted after step {result.step}, saved {result.checkpoint}; continue with: "
              f"glasslm finetune --resume {out}")
        return 128 + result.stopped_by_signal
    if result.val_losses:
        print(f"done: val loss {result.val_losses[-1][1]:.4f} after {result.step} steps; checkpoints in {out}")
    if run.export_peft:
        _export_peft(result.model, run.export_peft, base, config)
    return 0


def _plan(run: FinetuneRun, method: dict[str, Any], training: dict[str, Any]) -> tuple[str, FinetuneConfig, TrainConfig, Path, Path | None]:
    """(base, method, training settings, run directory, checkpoint to resume) from the options, or
    from the resumed checkpoint's record (options may change training settings, not the method)."""
    from glasslm.training.finetune import FINETUNE_KEY
    from glasslm.training.rundir import read_resumed_run

    if run.resume is None:
        if not run.checkpoint or not run.data:
            raise ValueError("give --checkpoint BASE and --data JSONL (or --resume a fine-tuning run)")
        config = FinetuneConfig(**method)
        config.check()
        out = Path(run.out or f"runs/finetune-{Path(run.checkpoint).name}")
        return run.checkpoint, config, TrainConfig(**{**FINETUNE_DEFAULTS, **training}), out, None
    if run.checkpoint or method:
        raise ValueError("--resume continues the run's base and method; drop --checkpoint and the method options")
    resumed = read_resumed_run(run.resume)
    record = resumed.meta.get(FINETUNE_KEY) if isinstance(resumed.meta, dict) else None
    if not isinstance(record, dict):
        raise ValueError(f"{resumed.checkpoint} is not a fine-tuning checkpoint (meta.json has no {FINETUNE_KEY!r}); "
                         "resume it with glasslm train --resume")
    names = {f.name for f in dataclasses.fields(FinetuneConfig)}
    config = FinetuneConfig(**{k: v for k, v in record.items() if k in names})
    out = Path(run.out) if run.out else resumed.checkpoint.parent
    return record["base"], config, dataclasses.replace(resumed.train_config, **training), out, resumed.checkpoint


def _model_and_data(base: str, config: FinetuneConfig, train_config: TrainConfig, data: str | None,
                    resume: Path | None) -> tuple[Any, Any, dict[str, Any], tuple[Any, Any]]:
    """The model to train (base + adapters), its tokenizer, the checkpoints' meta and the batches;
    a resumed run re-reads its recorded data and template and checks its base is unchanged."""
    from glasslm.hf.load import adapter_base
    from glasslm.training.finetune import FINETUNE_KEY, chat_batches, chat_template, prepare_model

    model, tokenizer, meta = prepare_model(base, config, seed=train_config.seed)
    if resume is not None:
        from glasslm.io.checkpoint import ADAPTER_BASE_KEY, META_FILE, read_json

        saved = read_json(resume / META_FILE)
        record = saved[FINETUNE_KEY]
        if ADAPTER_BASE_KEY in saved and adapter_base(saved, str(resume))[1] != meta[ADAPTER_BASE_KEY]["sha256"]:
            raise ValueError(f"{resume}: the base {base} has changed since this run started (its weights hash "
                             "differently); the adapters only fit the weights they were trained on")
        data, template = record["data"], record["template"]
    else:
        template = chat_template(base, config)
    batches = chat_batches(data, tokenizer, template, model.config.context_length, config.val_fraction,
                           train_config.seed)
    meta[FINETUNE_KEY] |= {"data": str(Path(data).resolve()), "template": template}
    return model, tokenizer, meta, batches


def _export_peft(model: Any, directory: str, base: str, config: FinetuneConfig) -> None:
    from glasslm.hf.peft import export_peft_adapter

    if config.full:
        raise ValueError("--export-peft writes LoRA adapters; a --full run has none (glasslm convert --to-hf exports it)")
    export_peft_adapter(model, directory, base_model=base)
    print(f"wrote the PEFT adapter to {directory}")


COMMAND = Command("finetune", finetune, "fine-tune a model on chat JSONL: LoRA, QLoRA (--quantize) or --full",
                  description=__doc__.split("\n\n")[0],
                  examples=(
                      'glasslm finetune --checkpoint runs/base --data chat.jsonl --lora-rank 8 --out runs/ft',
                      'glasslm finetune --checkpoint runs/base --data chat.jsonl --quantize int4 --out runs/qlora',
                      'glasslm finetune --resume runs/ft --max-steps 400',
                  ))
