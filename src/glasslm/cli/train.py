"""`glasslm train`: train a model, fresh from a preset, fine-tuned from weights (--init-from), or
resumed exactly from a checkpoint (--resume). Each setting comes from the preset and its recipe,
then a --config file, then the options typed: the later wins.

    glasslm train --preset shakespeare-char-cpu --data tinyshakespeare --out runs/shakespeare-char-cpu
    glasslm train --resume runs/shakespeare-char-cpu --max-steps 4000
    torchrun --nproc_per_node=2 -m glasslm.cli train --batch-size 6 --out runs/ddp
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

from glasslm.cli.command import Command
from glasslm.cli.common import set_threads
from glasslm.cli.options import Group
from glasslm.cli.run_config import CONFIG_TABLES, RunConfig, load_config_file
from glasslm.core.config import ModelConfig
from glasslm.presets import get_preset, lookup_preset
from glasslm.training.config import TrainConfig, get_recipe
from glasslm.training.rundir import ResumedRun
from glasslm.data.splits import VAL_FRACTION


@dataclass
class TrainOptions:
    """where the run's settings come from"""

    # TOML (or YAML) file: RunConfig keys at the top, [model] and [train] tables; none: options only
    config: str | None = field(default=None, metadata={"metavar": "FILE"})
    # continue exactly from a checkpoint; a run directory resumes its latest; none: a fresh run
    resume: str | None = field(default=None, metadata={"metavar": "DIR"})
    # train into an --out that holds an earlier run, deleting that run's checkpoints and metrics
    # (without it such an --out is refused)
    overwrite: bool = False
    # with --resume: stretch the cosine learning-rate decay to the new --max-steps (without it a
    # resumed run keeps its schedule and trains on at min_lr past its end)
    extend_schedule: bool = False
    # start even when the run is estimated to take more than a day on this device (the estimate
    # times one micro-batch before the first step; without --yes such a run is refused, nothing written)
    yes: bool = dataclasses.field(default=False, metadata={"flag_only": True})


DEFAULT_PRESET = RunConfig.preset  # what `glasslm train` trains without --preset: its defaults are the ones shown
RUN = Group("run: what to train on and where to write")
TRAINING = Group(f"training (defaults shown: the {DEFAULT_PRESET} preset's recipe; another --preset brings its own)",
                 shown_defaults=lambda: dataclasses.asdict(get_recipe(DEFAULT_PRESET)))
MODEL = Group(f"model (defaults shown: the {DEFAULT_PRESET} preset's; another --preset brings its own)",
              skip=frozenset({"vocab_size"}), shown_defaults=lambda: dataclasses.asdict(get_preset(DEFAULT_PRESET)))


@dataclass
class _Plan:
    """A run's settings once the preset, recipe, file, options and any resumed checkpoint are merged."""

    run: RunConfig
    train: TrainConfig
    model_overrides: dict[str, Any]  # ModelConfig fields given (file and options)
    resumed: ResumedRun | None
    tokenizer_given: bool  # --tokenizer (or the file's tokenizer) was set

    @property
    def init_from(self) -> str | None:
        return self.train.init_from if self.resumed is None else None  # fine-tuning: a new run from weights

    @property
    def out(self) -> Path:
        if self.run.out:
            return Path(self.run.out)
        return Path(f"runs/finetune-{Path(self.init_from).name}" if self.init_from else f"runs/{self.run.preset}")


def train(options: TrainOptions, run: Annotated[dict[str, Any], RunConfig, RUN],
          training: Annotated[dict[str, Any], TrainConfig, TRAINING],
          model: Annotated[dict[str, Any], ModelConfig, MODEL]) -> int:
    from glasslm.training.distributed import init_distributed, resolve_device, shutdown_distributed
    from glasslm.io.checkpoint import read_pointer
    from glasslm.training.rundir import check_run_dir, holds_no_checkpoint

    plan = _plan(options, run, training, model)
    # Refused before any data is read: an unavailable device, an --out holding another run.
    device = resolve_device(plan.train.device)
    main_process = os.environ.get("RANK", "0") == "0"  # other torchrun processes may already see rank 0's files
    resuming_here = plan.resumed is not None and plan.out.resolve() == plan.resumed.checkpoint.parent.resolve()
    fresh_start_over_leftovers = main_process and not resuming_here and not options.overwrite \
        and holds_no_checkpoint(plan.out)
    pointer_lost = resuming_here and read_pointer(plan.out, "latest") is None
    if main_process:
        check_run_dir(plan.out, resuming=resuming_here, overwrite=options.overwrite)
    if plan.resumed is not None and plan.resumed.step >= plan.train.max_steps:  # (a run in use was refused above)
        if main_process:
            print(f"nothing to train: {plan.resumed.checkpoint} is at step {plan.resumed.step} and --max-steps is "
                  f"{plan.train.max_steps}; a larger --max-steps continues the run")
        return 0
    if device == "cpu" or plan.train.threads:
        # Thread counts are the command's business, never the library's (train() leaves them alone).
        set_threads(plan.train.threads)
    data, model_cfg, label = _data_and_model(plan)
    ctx = init_distributed(plan.train.device)
    say = print if ctx.is_main else (lambda *a, **k: None)
    if fresh_start_over_leftovers:
        say(f"{plan.out} holds no checkpoint (its run stopped before the first save): starting it afresh, "
            "its old metrics.jsonl kept aside (renamed metrics.jsonl.unfinished)")
    if pointer_lost:
        say(f"{plan.out} has no `latest` pointer (its run stopped after saving a checkpoint, before naming it): "
            f"resuming from {plan.resumed.checkpoint.name} and writing the pointer again")
    _say_start(say, plan, data, model_cfg, label, ctx)
    try:
        result = _fit(plan, model_cfg, data, label, ctx, options)
    finally:
        shutdown_distributed()
    if result.stopped_by_signal is not None:
        if result.checkpoint is None:
            say(f"interrupted before a step completed; nothing to save in {plan.out}")
        else:
            say(f"interrupted after step {result.step}, saved {result.checkpoint}; continue with: "
                f"glasslm train --resume {plan.out}")
        return 128 + result.stopped_by_signal
    if result.val_losses:
        step, val_loss = result.val_losses[-1]
        say(f"done: val loss {val_loss:.4f} after {step} steps, {result.tokens_per_second:,.0f} tokens/s; "
            f"checkpoints in {plan.out}")
    if plan.run.sample_tokens and ctx.is_main:
        _print_sample(result, plan, data.tokenizer, ctx)
    return 0


def _plan(options: TrainOptions, run: dict[str, Any], training: dict[str, Any], model: dict[str, Any]) -> _Plan:
    """Merge the --config file, the options and (with --resume) the checkpoint's record of its run."""
    from glasslm.training.rundir import read_resumed_run

    file = load_config_file(options.config) if options.config else {}
    given = {k: v for k, v in file.items() if k not in CONFIG_TABLES} | run
    train_overrides = {**file.get("train", {}), **training}
    model_overrides = {**file.get("model", {}), **model}
    relaunched = _relaunched_run(options, given)
    if relaunched is not None:  # the same command again: its model options are the checkpoint's (checked on load)
        options, model_overrides = dataclasses.replace(options, resume=relaunched), {}
    if options.resume is None:
        if options.extend_schedule:
            raise ValueError("--extend-schedule only applies with --resume")
        run_config = RunConfig(**given)
        # A preset without a recipe is refused unless --recipe names one (never silent defaults).
        train_config = get_recipe(run_config.recipe or run_config.preset, **train_overrides)
        return _Plan(run_config, train_config, model_overrides, None, "tokenizer" in given)
    # The checkpoint records the run; the command line may change training settings (e.g. raise
    # max_steps to train longer), not the model.
    resumed = read_resumed_run(options.resume)
    if model_overrides:
        raise ValueError(f"--resume continues the checkpoint's model; drop {sorted(model_overrides)}")
    _refuse_guessing_the_run(options.resume, resumed.checkpoint, given)
    meta = resumed.meta
    recorded = {"preset": meta.get("preset", "checkpoint"), "data": meta.get("data"),
                "val_fraction": meta.get("val_fraction", VAL_FRACTION),
                "sample_tokens": meta.get("sample_tokens", RunConfig.sample_tokens)}  # (older runs did not record it)
    run_config = RunConfig(**{**recorded, "out": str(resumed.checkpoint.parent), **given})
    train_config = dataclasses.replace(resumed.train_config, **train_overrides)
    if options.extend_schedule:
        if "lr_decay_steps" in train_overrides:
            raise ValueError("give either --extend-schedule or --lr-decay-steps, not both")
        train_config = dataclasses.replace(train_config, lr_decay_steps=train_config.max_steps)
    return _Plan(run_config, train_config, {}, resumed, "tokenizer" in given)


def _relaunched_run(options: TrainOptions, given: dict[str, Any]) -> str | None:
    """The run directory to continue under `torchrun --max-restarts N` (N > 0), which relaunches this
    same command on every node after a process fails: the command then resumes from its --out's
    latest checkpoint (a run that had saved none starts afresh). Which launch is a relaunch cannot be
    told from the environment (a node whose own processes did not fail is relaunched with
    TORCHELASTIC_RESTART_COUNT unchanged), so with N > 0 any launch continues an --out that holds a
    run, unless --overwrite or --resume says otherwise.

    >>> _relaunched_run(TrainOptions(), {"out": "runs/none"}) is None   # not relaunched
    True
    """
    from glasslm.io.checkpoint import read_pointer

    if options.resume is not None or options.overwrite or int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) == 0:
        return None
    out = RunConfig(**given).out
    return out if read_pointer(out, "latest") is not None else None


def _refuse_guessing_the_run(resume: str, checkpoint: Path, given: dict[str, Any]) -> None:
    """A checkpoint copied out of its run has no run directory to continue in: --out must name one
    (its parent would otherwise become the run, gaining a lock, pointers and metrics)."""
    from glasslm.io.checkpoint import numbered_checkpoints, read_pointer

    if given.get("out") or read_pointer(checkpoint.parent, "latest") is not None:
        return
    if checkpoint in numbered_checkpoints(checkpoint.parent):  # a run directory whose pointer was never written
        return
    raise ValueError(f"--resume {resume}: {checkpoint} is a checkpoint outside a run directory ({checkpoint.parent} "
                     "has no latest pointer), so there is no run to continue in; name a directory for the "
                     f"continued run: glasslm train --resume {resume} --out DIR")


def _data_and_model(plan: _Plan) -> tuple[Any, ModelConfig, str]:
    """The tokenized data, the model's config and how to name the model: a resumed run keeps its
    tokenizer and model, fine-tuning encodes the data with the pretrained model's tokenizer, and a
    fresh run builds the preset around the data's vocabulary."""
    from glasslm.data import load_training_data
    from glasslm.tokenizers import get_tokenizer, load_tokenizer

    run = plan.run
    if plan.resumed is not None:
        tokenizer = load_tokenizer(plan.resumed.checkpoint)
    elif plan.init_from:
        init_cfg, tokenizer = _init_from_checkpoint(plan.init_from, run.tokenizer if plan.tokenizer_given else None,
                                                    run.data_dir)
        init_tokenizer = tokenizer
    else:  # char: built from the text (with <|endoftext|> unless the preset reproduces a vocabulary without it)
        tokenizer = None if run.tokenizer == "char" else get_tokenizer(run.tokenizer, data_dir=run.data_dir)
    data = load_training_data(run.data, run.data_dir, run.val_fraction, tokenizer=tokenizer,
                              char_end_of_text=tokenizer is not None or lookup_preset(run.preset).char_end_of_text)
    if plan.init_from:
        return data, _fine_tune_config(init_cfg, plan.model_overrides, data.tokenizer, init_tokenizer, run.data,
                                       plan.init_from), f"init-from {plan.init_from}"
    if plan.resumed is None:
        return data, get_preset(run.preset, **{"vocab_size": data.tokenizer.vocab_size, **plan.model_overrides}), \
            run.preset
    model_cfg = plan.resumed.model_config
    if data.tokenizer.vocab_size != model_cfg.vocab_size:
        raise ValueError(f"{run.data} has a vocabulary of {data.tokenizer.vocab_size} tokens, but the checkpoint's "
                         f"model has {model_cfg.vocab_size}")
    return data, model_cfg, run.preset


def _say_start(say: Any, plan: _Plan, data: Any, model_cfg: ModelConfig, label: str, ctx: Any) -> None:
    from glasslm.interp.accounting import parameter_count
    from glasslm.training.schedule import schedule_end

    say(f"data: {data.description}")
    say(f"model: {label} ({parameter_count(model_cfg):,} parameters) -> {plan.out}"
        + (f", {ctx.world_size} processes, device {ctx.device}" if ctx.enabled else f", device {ctx.device}")
        + (f", resuming from {plan.resumed.checkpoint}" if plan.resumed is not None else ""))
    if plan.train.optimizer == "muon" and plan.train.muon_ns_dtype == "auto" and plan.resumed is None:
        say(_newton_schulz_choice(ctx.device))
    if plan.resumed is not None:
        changed = _overridden_settings(plan)
        if changed:
            say("settings changed from the run's: " + ", ".join(f"{name} {old!r} -> {new!r}"
                                                                  for name, (old, new) in changed.items()))
        end = schedule_end(plan.train, plan.resumed.saved_train_config)
        if end < plan.train.max_steps:
            say(f"learning rate: the run's schedule ends at step {end}; steps after it train at min_lr "
                f"{plan.train.min_lr:g} (--extend-schedule stretches the cosine to --max-steps instead)")


def _newton_schulz_choice(device: str) -> str:
    from glasslm.training.optim import newton_schulz_dtype

    dtype = newton_schulz_dtype("auto", str(device).split(":")[0])
    if dtype == "bfloat16":
        why = "the device multiplies bfloat16 natively"
    elif str(device).startswith("cpu"):
        why = "this CPU has no bfloat16 units (no avx512_bf16/amx_bf16 flag), so bfloat16 would be ~6x slower"
    else:
        why = f"bfloat16 matmuls are not known to be fast on {device}"
    return f"Muon's Newton–Schulz in {dtype}: {why} (--muon-ns-dtype sets it)"


def _overridden_settings(plan: _Plan) -> dict[str, tuple[Any, Any]]:
    """{setting: (the run's value, this command's)} for each setting a resume changes: the training
    settings its checkpoint recorded, and the run's data, validation fraction and sample length."""
    assert plan.resumed is not None
    saved, meta = plan.resumed.train_config, plan.resumed.meta
    changed = {f.name: (getattr(saved, f.name), getattr(plan.train, f.name)) for f in dataclasses.fields(TrainConfig)
               if getattr(saved, f.name) != getattr(plan.train, f.name)}
    for name in ("data", "val_fraction", "sample_tokens"):
        old, new = meta.get(name, getattr(RunConfig, name)), getattr(plan.run, name)
        if old != new and not (name == "data" and Path(str(old)).resolve() == Path(str(new)).resolve()):
            changed[name] = (old, new)
    return changed


def _fit(plan: _Plan, model_cfg: ModelConfig, data: Any, label: str, ctx: Any, options: TrainOptions) -> Any:
    """Train; `train` claims the run directory (checked, locked, cleared for --overwrite) once,
    before the first logger writes into it, and only after the estimate allowed the run."""
    from glasslm.training.distributed import barrier
    from glasslm.training.estimate import DAY_S, TrainingTooLong
    from glasslm.training.loop import train as train_model

    meta = {"preset": label, "data": data.source, "val_fraction": plan.run.val_fraction,
            "sample_tokens": plan.run.sample_tokens, "train_config": plan.train.to_dict()}
    loggers = _optional_loggers(plan.train, plan.out, {"model": model_cfg.to_dict(), "train": plan.train.to_dict()}) \
        if ctx.is_main else []
    model = _fine_tune_model(model_cfg, plan.init_from) if plan.init_from else model_cfg
    try:
        result = train_model(model, plan.train, data.train, data.val, run_dir=plan.out,
                             resume=plan.resumed.checkpoint if plan.resumed else None, tokenizer=data.tokenizer,
                             meta=meta, dist_ctx=ctx, loggers=loggers, overwrite=options.overwrite,
                             refuse_longer_than_s=None if options.yes else DAY_S)
    except TrainingTooLong as refusal:
        raise ValueError(_too_long_message(refusal, plan, options, data.tokenizer.vocab_size)) from None
    # Every process reaches the end before any tears its connections down: once, under load, a
    # rank aborted at exit ("terminate called without an active exception") after a good FSDP
    # run; a peer closing the gloo pair early is the likely cause this rules out.
    barrier(ctx)
    return result


def _too_long_message(refusal: Any, plan: _Plan, options: TrainOptions, vocab_size: int) -> str:
    """Why the run was not started, and what fits: fewer steps, a CPU-sized preset, or --yes."""
    import shlex

    from glasslm.interp.accounting import parameter_count
    from glasslm.training.estimate import format_duration

    estimate, limit = refusal.estimate, format_duration(refusal.limit_s)
    done = plan.train.max_steps - estimate.steps
    in_limit = done + int(refusal.limit_s / (estimate.seconds / max(estimate.steps, 1)))
    ways = [f"fewer steps (--max-steps {in_limit} takes about {limit} here)"] if in_limit > done else []
    if plan.resumed is None and plan.init_from is None and plan.run.preset not in CPU_PRESETS:
        typed = (("data", plan.run.data), ("tokenizer", plan.run.tokenizer if plan.tokenizer_given else None),
                 ("data-dir", plan.run.data_dir), ("out", plan.run.out))
        keep = "".join(f" --{name} {shlex.quote(str(value))}" for name, value in typed if value)
        keep += " --overwrite" if options.overwrite else ""
        ways.append("a model sized for a CPU: " + " or ".join(
            f"glasslm train --preset {name}{keep} ({parameter_count(get_preset(name, vocab_size=vocab_size)) / 1e6:.1f}M "
            f"parameters, {get_recipe(name).max_steps:,} steps)" for name in CPU_PRESETS))
    ways.append("or start it anyway: add --yes")
    return (f"this run would take {estimate.describe()}: more than {limit}, so it was not started and nothing was "
            f"written to {plan.out}. Instead: " + "; ".join(ways))


# Presets whose recipes train in minutes on a laptop CPU (the README's demo: shakespeare-char-cpu's
# 600 steps in under a minute on 2 cores).
CPU_PRESETS = ("shakespeare-char-cpu", "shakespeare-char-cpu-nanogpt")


def _fine_tune_model(config: ModelConfig, path: str) -> Any:
    """`config`'s model holding the weights of `path` (`--init-from`), to hand to train()."""
    from glasslm.core.model import TransformerLM
    from glasslm.hf import init_weights_from

    model = TransformerLM(config)
    init_weights_from(model, path)  # strict about names and shapes: every weight is overwritten
    return model


def _print_sample(result: Any, plan: _Plan, tokenizer: Any, ctx: Any) -> None:
    from glasslm.generation import GenerationConfig, generate_tokens, with_vocab_limit

    model = result.model.eval()
    if plan.train.fsdp and ctx.enabled:
        # The trained model's weights are shards spread over the processes; the checkpoint
        # just written holds them whole, so the sample comes from it.
        from glasslm.io.checkpoint import load_checkpoint

        model = load_checkpoint(result.checkpoint, device=ctx.device)[0]
    # GenerationConfig's defaults, as `glasslm generate` uses them.
    config = GenerationConfig(max_new_tokens=plan.run.sample_tokens, seed=plan.train.seed)
    config = with_vocab_limit(config, model, tokenizer)  # a --vocab-size past the tokenizer's pads the table
    ids = generate_tokens(model, tokenizer.encode("\n"), config=config)
    print("--- sample ---")
    print(tokenizer.decode(list(ids)))


def _init_from_checkpoint(path: str, tokenizer_spec: str | None, data_dir: str | None) -> tuple[ModelConfig, Any]:
    """The config and tokenizer of the weights to fine-tune (`--init-from`); the data is encoded
    with that tokenizer, and a --tokenizer given as well must be the same vocabulary."""
    from glasslm.hf import checkpoint_config
    from glasslm.tokenizers import get_tokenizer, same_vocabulary

    config, tokenizer, _ = checkpoint_config(path)
    if tokenizer is None:
        raise ValueError(f"--init-from {path} holds no tokenizer, so the data cannot be encoded in its vocabulary")
    if tokenizer_spec and tokenizer_spec != "char":
        other = get_tokenizer(tokenizer_spec, data_dir=data_dir)
        if not same_vocabulary(tokenizer, other):
            raise ValueError(f"--tokenizer {tokenizer_spec} is not the vocabulary of --init-from {path}; "
                             "drop --tokenizer to encode the data with the checkpoint's")
    return config, tokenizer


def _fine_tune_config(config: ModelConfig, overrides: dict[str, Any], tokenizer: Any, own: Any,
                      data_source: str, path: str) -> ModelConfig:
    """The pretrained model's config with the few changes fine-tuning may make (dropout, attention
    impl, and the context length of a rotary model), after checking the data's vocabulary fits."""
    from glasslm.tokenizers import same_vocabulary

    if not same_vocabulary(tokenizer, own):
        raise ValueError(f"{data_source} was tokenized with a different vocabulary ({tokenizer.vocab_size:,} tokens) "
                         f"than --init-from {path} ({own.vocab_size:,} tokens); prepare it with that checkpoint's tokenizer")
    if tokenizer.vocab_size > config.vocab_size:
        raise ValueError(f"the tokenizer has {tokenizer.vocab_size:,} tokens but the model of {path} only {config.vocab_size:,}")
    allowed = {"dropout", "impl"} | ({"context_length"} if config.positional != "learned" else set())
    refused = sorted(set(overrides) - allowed)
    if refused:
        raise ValueError(f"--init-from keeps the pretrained architecture; only {sorted(allowed)} may change, not {refused}")
    return config.replace(**overrides)


class _LazyLogger:
    """A logger made at its first record: `train` calls it only after claiming the run directory,
    so nothing is written there before the claim (and the --overwrite clearing) happens."""

    def __init__(self, make: Any):
        self._make, self._logger = make, None

    def log(self, record: dict[str, Any]) -> None:
        if self._logger is None:
            self._logger = self._make()
        self._logger.log(record)

    def close(self) -> None:
        if self._logger is not None:
            self._logger.close()


def _optional_loggers(cfg: TrainConfig, run_dir: Path, config: dict[str, Any]) -> list:
    """TensorBoard and W&B loggers, if asked for; a missing package is refused before training."""
    import importlib.util

    from glasslm.training.loggers import TensorBoardLogger, WandbLogger

    loggers: list = []
    for enabled, make, package in ((cfg.tensorboard, lambda: TensorBoardLogger(run_dir), "tensorboard"),
                                   (cfg.wandb, lambda: WandbLogger(run_dir, config), "wandb")):
        if enabled:
            if importlib.util.find_spec(package) is None:
                raise ValueError(f"--{package} needs the {package} package: pip install {package}")
            loggers.append(_LazyLogger(make))
    return loggers


COMMAND = Command("train", train, "train a model on a text file or a named dataset",
                  description="Train a model. Each setting comes from the preset and its recipe, then\n"
                              "a --config file, then these options: the later wins.",
                  examples=(
                      "glasslm train                                   # shakespeare-char-cpu on tinyshakespeare",
                      "glasslm train --data my.txt --out runs/mine --max-steps 300",
                      "glasslm train --resume runs/shakespeare-char-cpu --max-steps 1200 --extend-schedule",
                      "glasslm train --preset gpt2-small --init-from gpt2 --data data/mine --max-steps 200",
                      "glasslm info --preset gpt2-small                # a preset's size before training it",
                      "glasslm train --preset gpt2-small --yes         # even if it would take more than a day here",
                  ))
