"""`glasslm finetune`: fine-tune a pretrained model on chat / instruction JSONL, tune it towards
preferred answers (--method dpo on preference JSONL) or towards a reward on its own sampled answers
(--method grpo on problem JSONL), with LoRA adapters (the default), QLoRA
(--quantize int4|int8: the frozen base quantized) or every weight (--full); resumable exactly like
`glasslm train`. A LoRA run's checkpoints hold only the adapters, the exact
base checkpoint and a hash of its weights (--base PATH where the base has moved), and the chat
template; `generate`, `chat`, `serve` and `eval` load them as base + adapters, `glasslm merge`
writes a full model.

    glasslm finetune --checkpoint runs/shakespeare-char-cpu --data examples/chat/shakespeare.jsonl \\
        --chat-template examples/chat/template.jinja --out runs/ft
    glasslm finetune --resume runs/ft --max-steps 1200
    glasslm finetune --checkpoint HuggingFaceTB/SmolLM2-135M-Instruct --method dpo --data prefs.jsonl --out runs/dpo
    glasslm finetune --checkpoint Qwen/Qwen2-0.5B --data chat.jsonl --quantize int4 --lr 2e-4 --out runs/qlora \\
        --export-peft runs/qlora-peft
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

from glasslm.cli.command import Command
from glasslm.cli.common import resolve_device, set_threads
from glasslm.cli.options import Group
from glasslm.training.config import TrainConfig
from glasslm.training.finetune import FinetuneConfig

# Fine-tuning's defaults where they differ from pretraining's (TrainConfig's); options win. Length,
# learning rate, warm-up, evaluation and logging intervals then follow the data and the base
# (`fit_to_data`): a run is so many passes over the training records, or (supervised, with held-out
# conversations) runs until the held-out loss stops improving, at most max_steps. Help shows these
# rules (tests/training/test_finetune.py checks them against a run). Every weight moving at LoRA's
# rate would wreck a model, so --full keeps a full fine-tune's usual rate.
FINETUNE_DEFAULTS = {"max_steps": 1000, "batch_size": 8, "min_lr": 2e-5, "warmup_steps": 20,
                     "weight_decay": 0.0, "eval_interval": 100, "log_interval": 10}
FULL_FINETUNE_LR = 2e-4
DEFAULT_EPOCHS = 3  # passes over the data where no held-out loss decides (TRL's num_train_epochs)
EARLY_STOP = 3  # supervised runs stop after this many evaluations without improvement
# Where glasslm's defaults differ from TRL's (SFTTrainer, DPOTrainer, GRPOTrainer 1.16), help says so and why
# (docs/training.md#where-the-defaults-differ-from-trls).
TRL_DIFFERS = {
    "beta2": "0.99; TRL: 0.999. A shorter memory of gradient scale adapts faster to the few hundred steps "
             "of a fine-tune (nanoGPT's and glasslm train's value)",
    "warmup_steps": "a tenth of the steps, at most 20, from lr 0; TRL: none. A short ramp keeps the first "
                    "updates, while LoRA's B matrices are still zero, from overshooting",
    "min_lr": "2e-05, reached by a cosine; TRL: linear decay to 0. A run stopped early or resumed past "
              "its schedule still learns",
}
TRAINING = Group("training (defaults shown: fine-tuning's, where they differ from glasslm train's)",
                 skip=frozenset({"init_from"}),
                 shown_defaults=lambda: dataclasses.asdict(TrainConfig(**FINETUNE_DEFAULTS)) | TRL_DIFFERS | {
                     "lr": f"LoRA: 3e-3 x sqrt(10M / the base's parameters), within [1e-4, 3e-3] (8.2e-4 at "
                           f"135M), a third of it for dpo/simpo/orpo; --full: {FULL_FINETUNE_LR:g}",
                     "max_steps": f"{FINETUNE_DEFAULTS['max_steps']} for sft with conversations held out, which "
                                  f"stops early (--early-stop {EARLY_STOP}); else {DEFAULT_EPOCHS} passes "
                                  "over the data (--epochs)",
                     "eval_interval": "one pass over the training data, within [5, 100] steps",
                     "log_interval": "a tenth of the steps, within [1, 10]",
                     "early_stop": f"{EARLY_STOP} for sft with conversations held out, else 0"})


@dataclass
class FinetuneRun:
    """what to fine-tune, on what, and where"""

    checkpoint: str | None = None  # the base: glasslm checkpoint, HF model directory or cached hub name
    # conversations or instruction records (--method dpo: prompt / chosen / rejected records; grpo: prompt / answer)
    data: str | None = field(default=None, metadata={"metavar": "JSONL"})
    out: str | None = None  # run directory (checkpoints, metrics.jsonl); none: runs/finetune-<base name>
    resume: str | None = field(default=None, metadata={"metavar": "DIR"})  # continue a fine-tuning run exactly
    # with --resume: the base checkpoint where it is now, if it moved (its weights must hash as recorded)
    base: str | None = field(default=None, metadata={"metavar": "PATH"})
    overwrite: bool = False  # replace the run an --out holds
    # passes over the training records (sets --max-steps); none: sft with held-out conversations runs until
    # their loss stops improving (at most --max-steps), every other method 3 passes
    epochs: float | None = field(default=None, metadata={"metavar": "N"})
    # also write the trained adapters as a PEFT adapter directory (LoRA runs)
    export_peft: str | None = field(default=None, metadata={"metavar": "DIR"})


def finetune(run: FinetuneRun, method: Annotated[dict[str, Any], FinetuneConfig],
             training: Annotated[dict[str, Any], TrainConfig, TRAINING]) -> int:
    from glasslm.training.loop import train
    from glasslm.transforms import parameter_count

    base, config, train_config, out, resume = _plan(run, method, training)
    if resolve_device(train_config.device) == "cpu" or train_config.threads:
        set_threads(train_config.threads)  # the thread count the estimate is timed with
    model, tokenizer, meta, data, objective = _model_and_data(base, config, train_config,
                                                              run.data if resume is None else None, resume,
                                                              (merged_base_dir(out), run.overwrite))
    _keep_base(meta, out)
    if meta["finetune"].get("merged_from") and resume is None:
        print(f"note: {run.checkpoint} holds LoRA adapters, so they were merged into its base, written to "
              f"{merged_base_dir(out)}: this run's adapters train on that full model (and --method "
              f"{config.method}'s reference is it); TRL would train a second adapter on top of the first, "
              "which starts from the same model")
    n_train = sum(p.numel() for p in model.parameters() if p.requires_grad)
    fitted = None
    if resume is None:  # the base's own size: a LoRA model's count holds its adapters
        base_size = parameter_count(model) - (0 if config.full else n_train)
        train_config, fitted = fit_to_data(train_config, set(training), config, base_size, len(data[0]),
                                           data[1] is not None, run.epochs)
    what = {"sft": "conversations", "grpo": "problems"}.get(config.method, "preference pairs")
    print(f"fine-tuning {meta['finetune']['base']} ({'' if config.method == 'sft' else config.method.upper() + ', '}"
          f"{'full' if config.full else 'LoRA'}{', ' + config.quantize + ' base' if config.quantize != 'none' else ''}): "
          f"{n_train:,} trainable of {parameter_count(model):,} parameters; {len(data[0])} training / "
          f"{len(data[1]) if data[1] else 0} held-out {what} -> {out}")
    if fitted:
        print(fitted)
    result = train(model, train_config, data[0], data[1], run_dir=out, resume=resume, tokenizer=tokenizer,
                   meta=meta, overwrite=run.overwrite, chat_template=meta["finetune"]["template"],
                   objective=objective, warn_longer_than_s=WARN_LONGER_THAN_S)
    if result.stopped_by_signal is not None:
        print(f"interrupted after step {result.step}, saved {result.checkpoint}; continue with: "
              f"glasslm finetune --resume {out}")
        return 128 + result.stopped_by_signal
    print(done_line(result, out))
    if run.export_peft:
        _export_peft(result.model, run.export_peft, meta["finetune"]["base"], config)
    return 0


def _plan(run: FinetuneRun, method: dict[str, Any], training: dict[str, Any]) -> tuple[str, FinetuneConfig, TrainConfig, Path, Path | None]:
    """(base, method, training settings, run directory, checkpoint to resume) from the options, or
    from the resumed checkpoint's record (options may change training settings, not the method)."""
    from glasslm.training.finetune import FINETUNE_KEY
    from glasslm.training.rundir import read_resumed_run

    if run.epochs is not None and ("max_steps" in training or not run.epochs > 0):
        raise ValueError("--epochs sets the run's length: give it (a positive number) or --max-steps, not both")
    if run.resume is None:
        if not run.checkpoint or not run.data:
            raise ValueError("give --checkpoint BASE and --data JSONL (or --resume a fine-tuning run)")
        if run.base:
            raise ValueError("--base points a resumed run (--resume) at its moved base; a new run takes --checkpoint")
        config = FinetuneConfig(**method)
        config.check()
        out = Path(run.out or f"runs/finetune-{Path(run.checkpoint).name}")
        defaults = FINETUNE_DEFAULTS | ({"lr": FULL_FINETUNE_LR} if config.full else {})
        return run.checkpoint, config, TrainConfig(**{**defaults, **training}), out, None
    if run.epochs is not None:
        raise ValueError("--epochs sets a new run's length; a resumed run continues to --max-steps")
    if run.checkpoint or method:
        raise ValueError("--resume continues the run's base and method; drop --checkpoint and the method options "
                         "(--base PATH points it at its base where that is now)")
    resumed = read_resumed_run(run.resume)
    record = resumed.meta.get(FINETUNE_KEY) if isinstance(resumed.meta, dict) else None
    if not isinstance(record, dict):
        raise ValueError(f"{resumed.checkpoint} is not a fine-tuning checkpoint (meta.json has no {FINETUNE_KEY!r}); "
                         "resume it with glasslm train --resume")
    names = {f.name for f in dataclasses.fields(FinetuneConfig)}
    config = FinetuneConfig(**{k: v for k, v in record.items() if k in names})
    out = Path(run.out) if run.out else resumed.checkpoint.parent
    return run.base or record["base"], config, dataclasses.replace(resumed.train_config, **training), out, \
        resumed.checkpoint


def merged_base_dir(out: Path) -> Path:
    """Where a run whose --checkpoint holds LoRA adapters writes them merged into their base: beside it."""
    return out.with_name(out.name + "-merged-base")


def _model_and_data(base: str, config: FinetuneConfig, train_config: TrainConfig, data: str | None,
                    resume: Path | None,
                    merge_into: tuple[Path, bool]) -> tuple[Any, Any, dict[str, Any], tuple[Any, Any], Any]:
    """The model to train (base + adapters), its tokenizer, the checkpoints' meta, the batches and
    the loss (DPO's holds its reference: the base, taken before any resumed weights are loaded); a
    resumed run re-reads its recorded data and template, on the base its adapters were trained on."""
    from glasslm.training.dpo import preference_objective
    from glasslm.training.finetune import FINETUNE_KEY, chat_batches, chat_template, prepare_model
    from glasslm.training.grpo import grpo_setup
    from glasslm.training.step import next_token_loss

    if resume is not None:
        from glasslm.io.checkpoint import META_FILE, read_json

        saved = read_json(resume / META_FILE)
        base = _resumed_base(saved, base, resume)
        data, template = saved[FINETUNE_KEY]["data"], saved[FINETUNE_KEY]["template"]
    model, tokenizer, meta = prepare_model(base, config, seed=train_config.seed,
                                           merge_into=merge_into[0] if resume is None else None, overwrite=merge_into[1])
    if resume is None:
        template = chat_template(meta[FINETUNE_KEY]["base"] if "merged_from" in meta[FINETUNE_KEY] else base,
                                 tokenizer, config)
    if config.method == "grpo":
        batches, objective = grpo_setup(data, model, tokenizer, template, config)
    else:
        batches = chat_batches(data, tokenizer, template, model.config.context_length, config.val_fraction,
                               train_config.seed, preferences=config.method != "sft")
        objective = (next_token_loss if config.method == "sft" else
                     preference_objective(config.method, model, config.full, config.dpo_beta, config.simpo_gamma))
    meta[FINETUNE_KEY] |= {"data": str(Path(data).resolve()), "template": template}
    return model, tokenizer, meta, batches, objective


def _resumed_base(saved: dict[str, Any], base: str, resume: Path) -> str:
    """The base a resumed LoRA run continues on: `base` if its weights hash as the run recorded (in a
    recorded run directory, the numbered checkpoint that does), else an error saying what to do."""
    from glasslm.hf.load import adapter_base, load_base_checked
    from glasslm.io.checkpoint import ADAPTER_BASE_KEY

    if ADAPTER_BASE_KEY not in saved:  # a full fine-tune: its checkpoints hold every weight
        return base
    recorded, sha256 = adapter_base(saved, str(resume))
    return load_base_checked(base, sha256, source=str(resume), given=base != recorded)[2]


def _keep_base(meta: dict[str, Any], out: Path) -> None:
    """Note in the base checkpoint that this LoRA run uses it, so training its run further never
    prunes it (glasslm.io.checkpoint.record_adapter_run); say so where that cannot be written."""
    from glasslm.io.checkpoint import ADAPTER_BASE_KEY, record_adapter_run

    if ADAPTER_BASE_KEY in meta and not record_adapter_run(meta[ADAPTER_BASE_KEY]["path"], out):
        print(f"note: could not write to {meta[ADAPTER_BASE_KEY]['path']}, so --keep-last in its run may delete "
              "it; keep a copy (and pass it with --base) if you train that run further")


WARN_LONGER_THAN_S = 3600.0  # a fine-tune estimated past an hour says so before its first step


def fit_to_data(cfg: TrainConfig, given: set[str], method: FinetuneConfig, n_parameters: int, n_train: int,
                held_out: bool, epochs: float | None) -> tuple[TrainConfig, str]:
    """(the run's settings, a line saying what was chosen): the length, learning rate, warm-up and
    intervals that no option gave, fitted to `n_train` training records and a base of `n_parameters`."""
    from glasslm.training.finetune import lora_learning_rate

    per_pass = math.ceil(n_train / (cfg.batch_size * cfg.grad_accum_steps))  # steps in one pass over the data
    what = {"sft": "conversations", "grpo": "problems"}.get(method.method, "preference pairs")
    early = method.method == "sft" and held_out and epochs is None and "max_steps" not in given
    changes: dict[str, Any] = {}
    if epochs is not None:
        changes["max_steps"] = max(1, math.ceil(epochs * per_pass))
    elif "max_steps" not in given and not early:
        changes["max_steps"] = DEFAULT_EPOCHS * per_pass
    steps = changes.get("max_steps", cfg.max_steps)
    fitted = {"lr": FULL_FINETUNE_LR if method.full else lora_learning_rate(n_parameters, method.method),
              "warmup_steps": min(20, steps // 10), "eval_interval": min(100, max(5, per_pass)),
              "log_interval": min(10, max(1, steps // 10)),
              "early_stop": EARLY_STOP if method.method == "sft" and held_out else 0}
    changes |= {name: value for name, value in fitted.items() if name not in given}
    cfg = dataclasses.replace(cfg, **changes)
    length = (f"at most {cfg.max_steps:,} steps, stopping once the held-out loss has not fallen by "
              f"{cfg.early_stop_delta:g} in {cfg.early_stop} evaluations (one every {cfg.eval_interval} steps)"
              if cfg.early_stop and held_out else f"{cfg.max_steps:,} steps")
    rate = "" if "lr" in given else (f", lr {cfg.lr:.2g} (" + ("--full" if method.full else
                                     f"LoRA on {n_parameters / 1e6:,.1f}M parameters") + ")")
    return cfg, (f"training: {length}{rate}; {n_train} {what} make {per_pass} step{'s' if per_pass != 1 else ''} "
                 f"of {cfg.batch_size * cfg.grad_accum_steps} a pass")


def done_line(result: Any, out: Path) -> str:
    """What the run ended at: steps, the held-out loss and best, and the last record's rewards (DPO,
    GRPO), so a run whose loss says nothing (DPO's falls to 0 as the model collapses) shows more."""
    from glasslm.training.metrics import shown_stats

    steps = f"after {result.step} steps" + (" (stopped early: the held-out loss stopped improving)"
                                             if result.stopped_early else "")
    parts = [f"val loss {result.val_losses[-1][1]:.4f} (best {result.best_val_loss:.4f}) {steps}"
             if result.val_losses else steps]
    record = result.last_metrics
    trained = shown_stats(record)
    if trained:
        parts.append("training " + ", ".join(f"{name} {value}" for name, value in trained.items()))
    held = shown_stats({key[4:]: value for key, value in record.items() if key.startswith("val_")})
    if held:
        parts.append("held-out " + ", ".join(f"{name} {value}" for name, value in held.items()))
    return f"done: {'; '.join(parts)}; checkpoints in {out}"


def _export_peft(model: Any, directory: str, base: str, config: FinetuneConfig) -> None:
    from glasslm.hf.peft import export_peft_with_base

    if config.full:
        raise ValueError("--export-peft writes LoRA adapters; a --full run has none (glasslm convert --to-hf exports it)")
    _, named = export_peft_with_base(model, directory, base)
    print(f"wrote the PEFT adapter to {directory} (base_model_name_or_path: {named})")


COMMAND = Command("finetune", finetune, "fine-tune a model on chat JSONL: LoRA, QLoRA (--quantize) or --full",
                  description=__doc__.split("\n\n")[0],
                  examples=(
                      'glasslm finetune --checkpoint runs/shakespeare-char-cpu --data examples/chat/shakespeare.jsonl '
                      '--chat-template examples/chat/template.jinja --out runs/ft',
                      'glasslm finetune --checkpoint Qwen/Qwen2-0.5B --data chat.jsonl --quantize int4 --lr 2e-4 '
                      '--out runs/qlora',
                      'glasslm finetune --resume runs/ft --max-steps 1200',
                      'glasslm finetune --checkpoint HuggingFaceTB/SmolLM2-135M-Instruct --method dpo --data prefs.jsonl --out runs/dpo',
                      'glasslm finetune --checkpoint HuggingFaceTB/SmolLM2-135M-Instruct --method grpo --data problems.jsonl '
                      '--reward exact_match --out runs/grpo',
                      'glasslm finetune --resume runs/ft --base copies/ckpt-000600 --max-steps 1200   # the base moved',
                  ))
