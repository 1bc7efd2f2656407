"""The `glasslm` command line. Options for model and training settings are generated from the
`ModelConfig` and `TrainConfig` dataclass fields, so the CLI never drifts from the configs.

    glasslm train --preset shakespeare-char-cpu --data tinyshakespeare --out runs/shakespeare
    glasslm train --resume runs/shakespeare --max-steps 4000
    torchrun --nproc_per_node=2 -m glasslm.cli train --batch-size 6 --out runs/ddp
    glasslm plot runs/shakespeare
    glasslm generate --checkpoint runs/shakespeare --prompt "ROMEO:" --max-new-tokens 300
    glasslm eval --checkpoint runs/shakespeare --data tinyshakespeare
    glasslm info --preset gpt2-small --context-length 1024
    glasslm convert --from-hf path/to/hf-gpt2 --out runs/gpt2
    glasslm convert --to-hf --checkpoint runs/gpt2 --out runs/exported-gpt2
    glasslm convert --from nanogpt --checkpoint out/ckpt.pt --out runs/nano
    glasslm inspect attention --checkpoint runs/shakespeare --prompt "ROMEO:" --layer 0 --head 1 --out runs/attn.png
    glasslm inspect logit-lens --checkpoint runs/shakespeare --prompt "ROMEO:" --out runs/lens.png
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from glasslm import __version__
from glasslm.presets import PRESETS, get_preset
from glasslm.core.config import ModelConfig
from glasslm.training.config import get_recipe
from glasslm.io.formats import FORMATS
from glasslm.generation import GenerationConfig
from glasslm.cli.options import ArgumentParser, HelpFormatter, add_options, given_options, read_settings_file
from glasslm.core.fields import checked, did_you_mean
from glasslm.training.config import TrainConfig


@dataclass
class RunConfig:
    """What a training run trains on and where it writes: the top level of a `--config` file."""

    preset: str = "shakespeare-char-cpu"  # the model (glasslm info --preset NAME shows it); not with --resume
    recipe: str | None = None  # training recipe: a preset's name or 'default' (TrainConfig's); none: the preset's own
    data: str = "tinyshakespeare"  # dataset name, UTF-8 text file, or a directory made by `glasslm prepare`
    tokenizer: str = "char"  # for text files: char, gpt2, or a saved tokenizer directory
    data_dir: str | None = None  # where datasets are kept; none: $GLASSLM_DATA_DIR, else ~/.cache/glasslm
    out: str | None = None  # run directory for checkpoints and metrics.jsonl; none: runs/PRESET
    val_fraction: float = 0.1  # the last fraction of the text (from a line start) held out for validation
    sample_tokens: int = 300  # print a sample of this many tokens when training ends; 0: none


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


# The tables of a --config file, beside RunConfig's keys at its top level.
CONFIG_TABLES: dict[str, type] = {"model": ModelConfig, "train": TrainConfig}


def load_config_file(path: str) -> dict[str, Any]:
    """A run description from TOML (or YAML, if PyYAML is installed), every key checked.

    Top-level keys are RunConfig's (preset, data, out, ...); the tables [model] and [train]
    override fields of ModelConfig and TrainConfig:

        preset = "shakespeare-char-cpu"
        data = "tinyshakespeare"
        [model]
        n_layers = 2
        [train]
        max_steps = 500
        dtype = "bfloat16"

    Returns RunConfig's settings with the tables' settings under "model" and "train".
    """
    data = read_settings_file(path)
    top = {k: v for k, v in data.items() if k not in CONFIG_TABLES}
    names = [f.name for f in dataclasses.fields(RunConfig)] + list(CONFIG_TABLES)
    for key in top:
        if key not in names:
            raise ValueError(f"{path}: unknown setting {key!r}{did_you_mean(str(key), names)}")
    result = checked(RunConfig, top, str(path))
    for table, cls in CONFIG_TABLES.items():
        result[table] = checked(cls, data.get(table, {}), f"{path} [{table}]")
    return result


def cmd_train(args: argparse.Namespace) -> int:
    import torch

    from glasslm.io.checkpoint import load_config, read_json, resolve_checkpoint
    from glasslm.interp.accounting import parameter_count
    from glasslm.data import load_training_data
    from glasslm.training.distributed import barrier, init_distributed, resolve_device, shutdown_distributed
    from glasslm.generation import generate_tokens
    from glasslm.tokenizers import get_tokenizer, load_tokenizer
    from glasslm.training.rundir import check_run_dir
    from glasslm.training.loop import claim_run, train
    from glasslm.training.schedule import schedule_end
    from glasslm.training.trainer_state import TRAINER_STATE_JSON

    file = load_config_file(args.config) if args.config else {}
    given = {k: v for k, v in file.items() if k not in CONFIG_TABLES} | given_options(args, RunConfig)
    train_overrides = {**file.get("train", {}), **given_options(args, TrainConfig)}
    model_overrides = {**file.get("model", {}), **given_options(args, ModelConfig)}
    resume_dir = resolve_checkpoint(args.resume, prefer=("latest",)) if args.resume else None
    if resume_dir is not None:
        # The checkpoint records the run; the command line may change training settings (e.g.
        # raise max_steps to train longer), not the model.
        saved_meta = read_json(resume_dir / "meta.json")
        saved_state = read_json(resume_dir / TRAINER_STATE_JSON)
        missing = [k for k in ("step", "best_val_loss", "elapsed_s", "train_config")
                   if not isinstance(saved_state, dict) or k not in saved_state]
        if missing:
            raise ValueError(f"{resume_dir / TRAINER_STATE_JSON} lacks {', '.join(missing)}: not a complete "
                             "training checkpoint, so it cannot be resumed")
        if model_overrides:
            raise ValueError(f"--resume continues the checkpoint's model; drop {sorted(model_overrides)}")
        run = RunConfig(**{"preset": saved_meta.get("preset", "checkpoint"), "data": saved_meta.get("data"),
                           "val_fraction": saved_meta.get("val_fraction", 0.1), "out": str(resume_dir.parent),
                           **given})
        model_cfg = load_config(resume_dir / "config.json")
        saved_train = TrainConfig.from_dict(saved_state["train_config"], f"{resume_dir / TRAINER_STATE_JSON}")
        train_cfg = dataclasses.replace(saved_train, **train_overrides)
        if args.extend_schedule:
            if "lr_decay_steps" in train_overrides:
                raise ValueError("give either --extend-schedule or --lr-decay-steps, not both")
            train_cfg = dataclasses.replace(train_cfg, lr_decay_steps=train_cfg.max_steps)
    else:
        run = RunConfig(**given)
        # A preset without a recipe is refused unless --recipe names one (never silent defaults).
        train_cfg = get_recipe(run.recipe or run.preset, **train_overrides)
        if args.extend_schedule:
            raise ValueError("--extend-schedule only applies with --resume")
    preset, data_source, val_fraction = run.preset, run.data, run.val_fraction
    init_from = train_cfg.init_from if resume_dir is None else None  # fine-tuning: a new run from weights
    out = Path(run.out or (f"runs/finetune-{Path(init_from).name}" if init_from else f"runs/{preset}"))
    # Refused before any data is read: an unavailable device, an --out holding another run.
    resolve_device(train_cfg.device)
    if os.environ.get("RANK", "0") == "0":  # other torchrun processes may already see rank 0's files
        check_run_dir(out, resuming=resume_dir is not None and out.resolve() == resume_dir.parent.resolve(),
                      overwrite=args.overwrite)
    if train_cfg.threads:
        # Thread counts are the command's business, never the library's (train() leaves them alone).
        torch.set_num_threads(train_cfg.threads)

    data_dir = run.data_dir
    if resume_dir is not None:
        tokenizer = load_tokenizer(resume_dir)
    elif init_from:  # the data is encoded with the pretrained model's own tokenizer
        init_cfg, init_tokenizer = _init_from_checkpoint(init_from, given.get("tokenizer"), data_dir)
        tokenizer = init_tokenizer
    else:  # char: built from the text
        tokenizer = None if run.tokenizer == "char" else get_tokenizer(run.tokenizer, data_dir=data_dir)
    data = load_training_data(data_source, data_dir, val_fraction, tokenizer=tokenizer)
    tokenizer, train_tokens, val_tokens = data.tokenizer, data.train, data.val
    if init_from:
        preset = f"init-from {init_from}"
        model_cfg = _fine_tune_config(init_cfg, model_overrides, tokenizer, init_tokenizer, data_source, init_from)
    elif resume_dir is None:
        model_cfg = get_preset(preset, **{"vocab_size": tokenizer.vocab_size, **model_overrides})
    elif tokenizer.vocab_size != model_cfg.vocab_size:
        raise ValueError(f"{data_source} has a vocabulary of {tokenizer.vocab_size} tokens, but the checkpoint's "
                         f"model has {model_cfg.vocab_size}")

    ctx = init_distributed(train_cfg.device)
    say = print if ctx.is_main else (lambda *a, **k: None)
    say(f"data: {data.description}")
    say(f"model: {preset} ({parameter_count(model_cfg):,} parameters) -> {out}"
        + (f", {ctx.world_size} processes, device {ctx.device}" if ctx.enabled else f", device {ctx.device}")
        + (f", resuming from {resume_dir}" if resume_dir is not None else ""))
    if resume_dir is not None:
        end = schedule_end(train_cfg, saved_state["train_config"])
        if end < train_cfg.max_steps:
            say(f"learning rate: the run's schedule ends at step {end}; steps after it train at min_lr "
                f"{train_cfg.min_lr:g} (--extend-schedule stretches the cosine to --max-steps instead)")

    meta = {"preset": preset, "data": data.source, "val_fraction": val_fraction, "train_config": train_cfg.to_dict()}
    try:
        # Claimed (checked, locked, cleared for --overwrite) before any logger writes into it.
        with claim_run(out, resume_dir, args.overwrite, ctx):
            loggers = _optional_loggers(train_cfg, out, {"model": model_cfg.to_dict(), "train": train_cfg.to_dict()}) \
                if ctx.is_main else []
            model = _fine_tune_model(model_cfg, init_from) if init_from else model_cfg
            result = train(model, train_cfg, train_tokens, val_tokens, run_dir=out, resume=resume_dir,
                           tokenizer=tokenizer, meta=meta, dist_ctx=ctx, loggers=loggers)
            # Every process reaches the end before any tears its connections down: once, under load, a
            # rank aborted at exit ("terminate called without an active exception") after a good FSDP
            # run; a peer closing the gloo pair early is the likely cause this rules out.
            barrier(ctx)
    finally:
        shutdown_distributed()
    if result.stopped_by_signal is not None:
        say(f"interrupted after step {result.step}, saved {result.checkpoint}; continue with: "
            f"glasslm train --resume {out}")
        return 128 + result.stopped_by_signal
    if result.val_losses:
        step, val_loss = result.val_losses[-1]
        say(f"done: val loss {val_loss:.4f} after {step} steps, {result.tokens_per_second:,.0f} tokens/s; "
            f"checkpoints in {out}")
    if run.sample_tokens and ctx.is_main:
        model = result.model.eval()
        if train_cfg.fsdp and ctx.enabled:
            # The trained model's weights are shards spread over the processes; the checkpoint
            # just written holds them whole, so the sample comes from it.
            from glasslm.io.checkpoint import load_checkpoint

            model = load_checkpoint(result.checkpoint, device=ctx.device)[0]
        prompt = tokenizer.encode("\n")
        # GenerationConfig's defaults, as `glasslm generate` uses them.
        ids = generate_tokens(model, prompt, config=GenerationConfig(max_new_tokens=run.sample_tokens,
                                                                     seed=train_cfg.seed))
        print("--- sample ---")
        print(tokenizer.decode(list(ids)))
    return 0


def _init_from_checkpoint(path: str, tokenizer_spec: str | None, data_dir: str | None) -> tuple[ModelConfig, Any]:
    """The config and tokenizer of the weights to fine-tune (`--init-from`); the data is encoded
    with that tokenizer, and a --tokenizer given as well must be the same vocabulary."""
    from glasslm.hf.interop import checkpoint_config
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


def _fine_tune_model(config: ModelConfig, path: str) -> Any:
    """`config`'s model holding the weights of `path` (`--init-from`), to hand to train()."""
    from glasslm.core.model import TransformerLM
    from glasslm.hf.interop import init_weights_from

    model = TransformerLM(config)
    init_weights_from(model, path)
    return model


def _optional_loggers(cfg: TrainConfig, run_dir: Path, config: dict[str, Any]) -> list:
    from glasslm.training.loggers import TensorBoardLogger, WandbLogger

    loggers: list = []
    for enabled, make, package in ((cfg.tensorboard, lambda: TensorBoardLogger(run_dir), "tensorboard"),
                                   (cfg.wandb, lambda: WandbLogger(run_dir, config), "wandb")):
        if enabled:
            try:
                loggers.append(make())
            except ImportError:
                raise ValueError(f"--{package} needs the {package} package: pip install {package}") from None
    return loggers


def cmd_plot(args: argparse.Namespace) -> int:
    from glasslm.training.plot import plot_run

    path = plot_run(args.run_dir, args.out)
    print(f"wrote {path}")
    return 0


def _add_runtime_options(p: argparse.ArgumentParser, quantize: bool = True) -> None:
    """--threads, --dtype and (for inference) --quantize, the same on every command that computes."""
    p.add_argument("--threads", type=int, default=0,
                   help="CPU threads; 0 is automatic: 1 for models under 20M parameters, which decode fastest on "
                        "one thread, else one per core (default: 0)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "auto"],
                   help="weights' dtype; auto: bfloat16 on CUDA and on CPUs with bf16 units (default: float32)")
    if quantize:
        p.add_argument("--quantize", default="none", choices=["none", "int8", "int4"],
                       help="weight-only int8 (a quarter of fp32's bytes) or int4 (an eighth, in groups of 64 "
                            "inputs with their own scale) for the Linear layers (default: none)")


def _prepare_model(model: Any, args: argparse.Namespace, decoding: bool = False) -> Any:
    """Apply --threads, --dtype and --quantize to a loaded model; threads are set here, in the CLI only."""
    import torch

    from glasslm.runtime import decode_threads, default_dtype, warn_if_slow_dtype

    device = next(model.parameters()).device.type
    dtype = default_dtype(device) if args.dtype == "auto" else args.dtype
    warn_if_slow_dtype(dtype, device)
    if device == "cpu":
        threads = args.threads or (decode_threads(model.num_parameters()) if decoding else 0)
        if threads:
            torch.set_num_threads(threads)
    model = model.to(getattr(torch, dtype)).eval()
    if getattr(args, "quantize", "none") != "none":
        from glasslm.transforms.quantize import quantize

        quantize(model, args.quantize)
    elif decoding:
        from glasslm.generation import optimize_for_decoding

        optimize_for_decoding(model)
    return model


DEVICE_HELP = "auto (the best available: cuda, else mps, else cpu), cpu, cuda, cuda:N or mps (default: auto)"
DATA_DIR_HELP = "where datasets are kept (default: $GLASSLM_DATA_DIR, else ~/.cache/glasslm)"


def _device(name: str) -> str:
    """The device to load a model on; a missing one is refused before the checkpoint is read."""
    from glasslm.training.distributed import resolve_device

    return resolve_device(name)


def _read_prompt(args: argparse.Namespace) -> str:
    if args.prompt_file:
        if Path(args.prompt_file).is_dir():
            raise ValueError(f"--prompt-file {args.prompt_file} is a directory, not a text file")
        return Path(args.prompt_file).read_text(encoding="utf-8")
    if args.prompt == "-":
        return sys.stdin.read()
    return args.prompt


def cmd_sample(args: argparse.Namespace) -> None:
    import time

    import torch

    from glasslm.generation import TextStreamer, generate_tokens
    from glasslm.hf.interop import load_model
    from glasslm.generation.speculative import SpeculativeStats, speculative_tokens

    config = GenerationConfig(**given_options(args, GenerationConfig))  # its defaults are the command's
    # A glasslm checkpoint or a Hugging Face GPT-2/Llama directory.
    model, tokenizer = load_model(args.checkpoint, device=_device(args.device))
    if tokenizer is None:
        raise ValueError(f"{args.checkpoint} holds no tokenizer, so text cannot be encoded")
    model = _prepare_model(model, args, decoding=True)
    draft = None
    if args.draft:
        if config.temperature != 0:
            raise ValueError("--draft (speculative decoding) is greedy here: add --temperature 0")
        draft, _ = load_model(args.draft, device=_device(args.device))
        draft = _prepare_model(draft, args, decoding=True)

    def respond(prompt: str, echo: bool) -> None:
        # An empty prompt starts from a newline, the most neutral context a text model knows.
        prompt_ids = tokenizer.encode(prompt or "\n")
        if not prompt_ids:
            raise ValueError("the prompt encodes to no tokens")
        if echo:
            sys.stdout.write(prompt)
        streamer = TextStreamer(tokenizer, config.stop_strings)
        start = time.perf_counter()
        n_tokens = 0
        stats = SpeculativeStats()
        tokens = (generate_tokens(model, prompt_ids, config=config) if draft is None else
                  speculative_tokens(model, draft, prompt_ids, config.max_new_tokens, args.lookahead,
                                     config.stop_tokens or (), stats))
        for token in tokens:
            n_tokens += 1
            sys.stdout.write(streamer.push(token))
            sys.stdout.flush()
            if streamer.stopped:
                break
        sys.stdout.write(streamer.finish() + "\n")
        sys.stdout.flush()
        seconds = time.perf_counter() - start
        speculation = "" if draft is None else (
            f", draft accepted {stats.acceptance_rate:.0%} of proposals, "
            f"{stats.tokens_per_target_pass:.2f} tokens per target pass")
        print(f"[{n_tokens} tokens in {seconds:.2f} s: {n_tokens / max(seconds, 1e-9):.1f} tokens/s, "
              f"prompt {len(prompt_ids)} tokens{speculation}]", file=sys.stderr)

    if not args.interactive:
        respond(_read_prompt(args), echo=True)
        return
    # Interactive: the model stays loaded; every line read from stdin is a new prompt, until EOF.
    # Ctrl-C stops the answer being written (back to the prompt); at the prompt it ends the session.
    tty = sys.stdin.isatty()
    print("glasslm interactive: one prompt per line; Ctrl-C stops an answer; Ctrl-D (or Ctrl-C here) quits",
          file=sys.stderr)
    while True:
        try:
            if tty:
                sys.stderr.write("> ")
                sys.stderr.flush()
            line = sys.stdin.readline()
        except KeyboardInterrupt:
            line = ""
        if not line:  # EOF or Ctrl-C at the prompt: a clean exit
            if tty:
                sys.stderr.write("\n")
            return
        try:
            respond(line.rstrip("\n"), echo=False)
        except Terminated:
            raise
        except KeyboardInterrupt:
            sys.stdout.write("\n")
            sys.stdout.flush()
            print("[stopped]", file=sys.stderr)


def cmd_eval(args: argparse.Namespace) -> None:
    import time

    import numpy as np
    import torch

    from glasslm.data import is_prepared, load_prepared, read_split, resolve_text
    from glasslm.evaluation.perplexity import evaluate_text
    from glasslm.hf.interop import load_model

    model, tokenizer = load_model(args.checkpoint, device=_device(args.device))  # glasslm or HF directory
    model = _prepare_model(model, args)
    # The split rule is training's: prepared datasets hold it in their files, text files are cut
    # by data.split_offset (validation from the first line start at or after 90% of the bytes).
    if is_prepared(args.data):
        data = load_prepared(args.data)
        ids = {"train": data.train, "val": data.val}.get(args.split)
        ids = np.concatenate([data.train, data.val]) if ids is None else ids
        if args.max_tokens:
            ids = ids[:args.max_tokens + 1]
        ids = np.asarray(ids, dtype=np.int64)
        _check_same_tokenizer(tokenizer, data.tokenizer, ids, model.config.vocab_size, args)
        tokenizer, text, source = data.tokenizer, None, f"{args.data} [{args.split}]"
    else:
        if tokenizer is None:
            raise ValueError(f"{args.checkpoint} holds no tokenizer, so text cannot be encoded")
        text_path = resolve_text(args.data, args.data_dir)
        text = read_split(text_path, args.split, args.val_fraction)
        if args.max_chars:
            text = text[:args.max_chars]
        if len(text) < 2:
            raise ValueError(f"the {args.split} split of {text_path} holds {len(text)} characters: nothing to score "
                             "(validation starts at the first line start in the last --val-fraction of the bytes)")
        ids, source = None, f"{text_path} [{args.split}]"
    start = time.perf_counter()
    result = evaluate_text(model, tokenizer, text, stride=args.stride, batch_size=args.batch_size,
                           max_tokens=args.max_tokens, progress=not args.quiet, ids=ids)
    seconds = time.perf_counter() - start
    stride = args.stride or model.config.context_length
    print(f"data: {source} ({result['tokens']:,} tokens scored, {result['bytes']:,} bytes; "
          f"context {model.config.context_length}, stride {stride})")
    print(f"loss {result['loss']:.4f}  perplexity {result['perplexity']:.3f}  "
          f"bits/byte {result['bits_per_byte']:.4f}  ({seconds:.1f} s)")


def _check_same_tokenizer(model_tokenizer: Any, data_tokenizer: Any, ids: Any, vocab_size: int,
                          args: argparse.Namespace) -> None:
    """A prepared dataset's token ids mean something only to the tokenizer that made them."""
    if data_tokenizer.vocab_size > vocab_size:
        raise ValueError(f"{args.data} has a vocabulary of {data_tokenizer.vocab_size} tokens, more than the "
                         f"model's {vocab_size}: it was prepared with another tokenizer")
    sample = [int(i) for i in ids[:2000]]
    if model_tokenizer is not None and (model_tokenizer.vocab_size != data_tokenizer.vocab_size
                                        or model_tokenizer.decode(sample) != data_tokenizer.decode(sample)):
        raise ValueError(f"{args.data} was prepared with a different tokenizer than {args.checkpoint}'s; "
                         "prepare it with --tokenizer pointing at the checkpoint")


def cmd_info(args: argparse.Namespace) -> None:
    from glasslm.interp.accounting import format_cost_table

    # --context-length (a ModelConfig option) sets the model's context and the FLOPs' context alike.
    if args.checkpoint:
        cfg = _print_checkpoint_info(args.checkpoint).replace(**given_options(args, ModelConfig))
    elif args.preset:
        cfg = get_preset(args.preset, **given_options(args, ModelConfig))
    else:
        raise ValueError("info needs --preset NAME or --checkpoint PATH")
    print(format_cost_table(cfg, title=args.preset or args.checkpoint))
    if args.json:
        print(json.dumps(cfg.to_dict(), indent=2))


def _print_checkpoint_info(path: str) -> ModelConfig:
    """What `glasslm info --checkpoint` says before the cost table (kind, tokenizer, provenance);
    returns the checkpoint's config."""
    from glasslm.hf.interop import checkpoint_config, family_of, is_hf_directory, resolve_model_path
    from glasslm.tokenizers import special_token_ids

    config, tokenizer, summary = checkpoint_config(path)
    kind = "Hugging Face directory" if is_hf_directory(resolve_model_path(path)) else "glasslm checkpoint"
    try:
        family = family_of(config)
    except ValueError:
        family = "none (glasslm only)"
    print(f"{path}: {kind} at {resolve_model_path(path)}; Hugging Face family: {family}")
    if tokenizer is None:
        print("tokenizer: none")
    else:
        ids = {k: v for k, v in special_token_ids(tokenizer).items() if v is not None}
        print(f"tokenizer: {tokenizer.kind}, {tokenizer.vocab_size:,} tokens, special ids {ids or 'none'}")
    known = {k: v for k, v in summary.items() if v is not None}
    if known:
        print("history: " + ", ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in known.items()))
    return config


def cmd_convert(args: argparse.Namespace) -> None:
    from glasslm.io.checkpoint import save_checkpoint
    from glasslm.data import check_output_dir
    from glasslm.hf.interop import checkpoint_summary, export_hf, import_hf, hf_tokenizer, load_model

    if args.from_format:
        from glasslm.io.formats import load_foreign

        if not args.checkpoint:
            raise ValueError(f"--from {args.from_format} needs --checkpoint FILE (the file that code saved)")
        check_output_dir(args.out, args.overwrite, inputs=[args.checkpoint], what="checkpoint")
        given = {"n_heads": args.n_heads, "context_length": args.context_length}
        model = load_foreign(args.checkpoint, args.from_format, **{k: v for k, v in given.items() if v is not None})
        save_checkpoint(args.out, model, None, {"converted_from": f"{args.from_format}:{args.checkpoint}"})
        print(f"{args.checkpoint} ({args.from_format}) -> {args.out} ({model.num_parameters():,} parameters)")
    elif args.from_hf:
        check_output_dir(args.out, args.overwrite, inputs=[args.from_hf], what="checkpoint")
        model = import_hf(args.from_hf, context_length=args.context_length)
        tokenizer = hf_tokenizer(args.from_hf)
        if tokenizer is not None and not hasattr(tokenizer, "save"):
            tokenizer = None
        meta = {"converted_from": str(args.from_hf)}
        save_checkpoint(args.out, model, tokenizer, meta)
        print(f"{args.from_hf} -> {args.out} ({model.num_parameters():,} parameters, "
              f"tokenizer {'included' if tokenizer is not None else 'not found'})")
    else:
        if not args.checkpoint:
            raise ValueError("--to-hf needs --checkpoint")
        check_output_dir(args.out, args.overwrite, inputs=[args.checkpoint], what="export")
        model, tokenizer = load_model(args.checkpoint)
        export_hf(model, args.out, tokenizer, checkpoint_summary(args.checkpoint), zero_biases=args.zero_biases)
        print(f"{args.checkpoint} -> {args.out} (Hugging Face format)")


def cmd_inspect(args: argparse.Namespace) -> None:
    from glasslm.interp.inspection import draw_attention, draw_logit_lens
    from glasslm.hf.interop import load_model

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.checkpoint, device=_device(args.device))
    if args.what == "attention":
        path = draw_attention(model, tokenizer, args.prompt, args.layer, args.head, args.out)
    else:
        path = draw_logit_lens(model, tokenizer, args.prompt, args.out)
    print(f"wrote {path}")


def cmd_serve(args: argparse.Namespace) -> None:
    from glasslm.hf.interop import load_model

    try:
        from glasslm.serving.server import serve
        import fastapi, uvicorn  # noqa: F401
    except ImportError:
        raise RuntimeError("serving needs fastapi and uvicorn: pip install fastapi uvicorn") from None
    model, tokenizer = load_model(args.checkpoint, device=_device(args.device))
    if tokenizer is None:
        raise ValueError(f"{args.checkpoint} holds no tokenizer, so text cannot be encoded")
    model = _prepare_model(model, args, decoding=True)
    from glasslm.serving.config import ServeConfig

    config = ServeConfig(host=args.host, port=args.port, name=args.name or Path(args.checkpoint).resolve().name,
                         max_batch=args.max_batch, max_queue=args.max_queue, max_tokens_limit=args.max_tokens_limit,
                         grace=args.grace, log_level=args.log_level)
    serve(model, tokenizer, config)


def cmd_quantize(args: argparse.Namespace) -> None:
    from glasslm.io.checkpoint import save_checkpoint
    from glasslm.hf.interop import load_model
    from glasslm.transforms.quantize import quantize

    out = Path(args.out)
    if Path(args.checkpoint).exists() and out.resolve() == Path(args.checkpoint).resolve():
        raise ValueError(f"--out {out} is the checkpoint itself; write the quantized copy elsewhere (the fp32 "
                         "weights would be replaced)")
    if out.is_file():
        raise ValueError(f"--out {out} is a file, not a directory")
    if out.exists() and any(out.iterdir()) and not args.overwrite:
        raise ValueError(f"{out} is not empty; pass --overwrite to replace it")
    model, tokenizer = load_model(args.checkpoint, device="cpu")
    before = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    quantize(model, args.method)
    after = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    save_checkpoint(out, model, tokenizer, {"quantization": args.method, "quantized_from": str(args.checkpoint)})
    print(f"wrote {out}: {args.method} weights, {after / 1e6:.1f} MB (was {before / 1e6:.1f} MB)")


def cmd_train_tokenizer(args: argparse.Namespace) -> None:
    import time

    from glasslm.data import check_output_dir, resolve_text
    from glasslm.tokenizers import train_tokenizer

    paths = [resolve_text(source, args.data_dir) for source in args.inputs]
    check_output_dir(args.out, args.overwrite, inputs=paths, what="tokenizer")
    start = time.perf_counter()
    tokenizer = train_tokenizer(paths, args.vocab_size, args.special_tokens, args.out, args.workers)
    print(f"trained a {tokenizer.vocab_size:,}-token byte-level BPE in {time.perf_counter() - start:.2f} s "
          f"-> {args.out} (vocab.json, merges.txt)")


def cmd_prepare(args: argparse.Namespace) -> None:
    from glasslm.data import char_vocabulary, check_output_dir, prepare, resolve_text
    from glasslm.tokenizers import CharTokenizer, get_tokenizer

    paths = [resolve_text(source, args.data_dir) for source in args.inputs]
    check_output_dir(args.out, args.overwrite, inputs=paths, what="dataset")  # before the slow part
    if args.tokenizer == "char":
        tokenizer = CharTokenizer(char_vocabulary(paths))
    else:
        tokenizer = get_tokenizer(args.tokenizer, data_dir=args.data_dir)
    meta = prepare(paths, tokenizer, args.out, args.val_fraction, progress=not args.quiet, overwrite=args.overwrite)
    print(f"{args.out}: {meta['train_tokens']:,} train + {meta['val_tokens']:,} val tokens "
          f"({meta['dtype']}, vocab {meta['vocab_size']:,})")


def cmd_fetch(args: argparse.Namespace) -> None:
    from glasslm.data import DATA_DIR_RULE, DATASETS, data_dir, fetch_dataset

    print(f"data directory: {data_dir(args.data_dir)} ({DATA_DIR_RULE})")
    for name in args.names or list(DATASETS):
        path = fetch_dataset(name, args.data_dir, source_dir=args.source)
        print(f"{name}: {path} (sha256 verified)")


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="glasslm", description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    parser.add_argument("--version", action="version", version=f"glasslm {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("train", help="train a model on a text file or a named dataset", formatter_class=HelpFormatter,
                       description="Train a model. Each setting comes from the preset and its recipe, then\n"
                                   "a --config file, then these options: the later wins.")
    p.add_argument("--config", default=None, metavar="FILE",
                   help="TOML (or YAML) file: RunConfig keys at the top, [model] and [train] tables (default: none)")
    p.add_argument("--resume", default=None, metavar="DIR",
                   help="continue exactly from a checkpoint; a run directory resumes its latest (default: a fresh run)")
    add_options(p, RunConfig, "run: what to train on and where to write")
    p.add_argument("--overwrite", action="store_true",
                   help="train into an --out that holds an earlier run, deleting that run's checkpoints and "
                        "metrics (default: such an --out is refused)")
    p.add_argument("--extend-schedule", action="store_true",
                   help="with --resume: stretch the cosine learning-rate decay to the new --max-steps (default: "
                        "a resumed run keeps its schedule and trains on at min_lr past its end)")
    add_options(p, TrainConfig, "training (defaults shown are TrainConfig's; the preset's recipe may change them)")
    add_options(p, ModelConfig, "model (defaults shown are ModelConfig's; the preset sets most)", skip={"vocab_size"})
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("plot", help="PNG of train/val loss against steps and tokens of a run")
    p.add_argument("run_dir", help="run directory holding metrics.jsonl")
    p.add_argument("--out", default=None, help="PNG path (default: RUN_DIR/loss.png)")
    p.set_defaults(func=cmd_plot)

    p = sub.add_parser("sample", aliases=["generate"], help="write text from a trained checkpoint (streamed)")
    p.add_argument("--checkpoint", required=True, help="glasslm checkpoint or run directory, or Hugging Face model directory")
    source = p.add_mutually_exclusive_group()
    source.add_argument("--prompt", default="",
                        help="the prompt text; '-' reads it from stdin (default: empty, i.e. a newline)")
    source.add_argument("--prompt-file", default=None, help="read the prompt from this UTF-8 file (default: none)")
    source.add_argument("--interactive", action="store_true",
                        help="keep the model loaded and answer each line of stdin until EOF (default: off)")
    add_options(p, GenerationConfig, "sampling", skip={"logprobs", "pad_token"},
                aliases={"stop_strings": ["--stop"], "stop_tokens": ["--stop-token"]})
    _add_runtime_options(p)
    p.add_argument("--draft", default=None,
                   help="a small checkpoint with the same vocabulary for speculative decoding; output stays the "
                        "model's own greedy tokens, needs --temperature 0 (default: none)")
    p.add_argument("--lookahead", type=_positive_int, default=4,
                   help="tokens the draft proposes per target pass (default: 4)")
    p.add_argument("--device", default="auto", help=DEVICE_HELP)
    p.set_defaults(func=cmd_sample)

    p = sub.add_parser("eval", help="loss, perplexity and bits per byte of a checkpoint on a text")
    p.add_argument("--checkpoint", required=True, help="glasslm checkpoint or run directory, or Hugging Face model directory")
    p.add_argument("--data", required=True,
                   help="dataset name, path to a UTF-8 text file, or a directory made by `glasslm prepare`")
    p.add_argument("--data-dir", default=None, help=DATA_DIR_HELP)
    p.add_argument("--split", default="val", choices=["val", "train", "all"],
                   help="which part to score, split as in training (default: val, the text training did not see)")
    p.add_argument("--val-fraction", type=float, default=0.1,
                   help="text files: validation starts at the first line start at or after 1 - this of the bytes (default: 0.1)")
    p.add_argument("--stride", type=_positive_int, default=None,
                   help="tokens between window starts (default: the context length, i.e. chunks)")
    p.add_argument("--batch-size", type=_positive_int, default=8, help="windows scored per forward pass (default: 8)")
    p.add_argument("--max-tokens", type=_positive_int, default=None, help="score at most N tokens (from the split's start) (default: the whole split)")
    p.add_argument("--max-chars", type=_positive_int, default=None, help="score only the first N characters (default: all)")
    p.add_argument("--quiet", action="store_true", help="no progress bar (default: a bar on stderr)")
    _add_runtime_options(p)
    p.add_argument("--device", default="auto", help=DEVICE_HELP)
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("info", help="parameters and FLOPs per token of a preset or checkpoint, by component")
    p.add_argument("--preset", default=None, choices=sorted(PRESETS),
                   help="the preset to describe (default: none; give --preset or --checkpoint)")
    p.add_argument("--checkpoint", default=None,
                   help="instead of --preset: a glasslm checkpoint or run directory, HF directory or cached hub "
                        "name (default: none)")
    p.add_argument("--json", action="store_true", help="also print the full config (default: off)")
    add_options(p, ModelConfig, "model settings (override the preset's)")
    p.set_defaults(func=cmd_info)

    p = sub.add_parser("convert", help="convert between glasslm checkpoints and Hugging Face directories")
    direction = p.add_mutually_exclusive_group(required=True)
    direction.add_argument("--from-hf", metavar="DIR",
                           help="an HF GPT-2 / Llama / Mistral / Qwen2 directory, or a hub name in the local HF cache")
    direction.add_argument("--to-hf", action="store_true", help="export --checkpoint as an HF directory")
    direction.add_argument("--from", dest="from_format", choices=list(FORMATS),
                           help="import the --checkpoint file another codebase saved (nanoGPT ckpt.pt, a "
                                "TransformerLens/ARENA, CS336 or seed 001/002/004 state dict); no pickled code runs")
    p.add_argument("--checkpoint", help="glasslm checkpoint to export (with --to-hf), or the file to import (with --from) (default: none)")
    p.add_argument("--n-heads", type=_positive_int, default=None,
                   help="--from cs336/seed001/seed002: the number of heads (their files do not record it) (default: none)")
    p.add_argument("--out", required=True, help="where to write the converted model")
    p.add_argument("--context-length", type=_positive_int, default=None,
                   help="Llama: context length to use instead of max_position_embeddings; --from cs336: the "
                        "context length (default: the cs336-lm preset's)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out (default: refused)")
    p.add_argument("--zero-biases", action="store_true",
                   help="--to-hf of a bias-free GPT-2-shaped model: write exact zero biases (HF GPT-2 always has "
                        "biases); glasslm re-imports it bias-free (default: off, refused for a bias-free model)")
    p.set_defaults(func=cmd_convert)

    p = sub.add_parser("inspect", help="draw attention patterns or the logit lens (PNG)")
    what = p.add_subparsers(dest="what", required=True)
    for name, help_text in (("attention", "one head's attention pattern, tokens on both axes"),
                            ("logit-lens", "top next token read from every layer, as a grid")):
        q = what.add_parser(name, help=help_text)
        q.add_argument("--checkpoint", required=True, help="glasslm checkpoint or Hugging Face model directory")
        q.add_argument("--prompt", required=True, help="the text to run through the model")
        q.add_argument("--out", required=True, help="PNG file to write")
        q.add_argument("--device", default="auto", help=DEVICE_HELP)
        q.add_argument("--threads", type=int, default=0, help="CPU threads; 0 leaves torch's choice (default: 0)")
        if name == "attention":
            q.add_argument("--layer", type=int, required=True, help="layer index, from 0")
            q.add_argument("--head", type=int, required=True, help="head index within the layer, from 0")
        q.set_defaults(func=cmd_inspect)

    p = sub.add_parser("serve", help="OpenAI-compatible completions server and the explorer page (needs fastapi, uvicorn)")
    p.add_argument("--checkpoint", required=True, help="glasslm checkpoint or run directory, or Hugging Face model directory")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1, this machine only)")
    p.add_argument("--port", type=int, default=8000, help="TCP port; 0 picks a free one (default: 8000)")
    p.add_argument("--name", default=None, help="model name in the API (default: the checkpoint directory's name)")
    p.add_argument("--max-batch", type=int, default=32, help="requests decoded together; 1 serves one at a time (default: 32)")
    p.add_argument("--max-queue", type=int, default=64, help="requests that may wait; more get HTTP 429 (default: 64)")
    p.add_argument("--max-tokens-limit", type=int, default=2048, help="largest max_tokens a request may ask for (default: 2048)")
    p.add_argument("--grace", type=float, default=10.0,
                   help="seconds in-flight requests get to finish after SIGTERM before they are aborted (default: 10)")
    _add_runtime_options(p)
    p.add_argument("--device", default="auto", help=DEVICE_HELP)
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="server log detail; info logs one line per request (default: info)")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("quantize", help="write a weight-only int8 or int4 copy of a checkpoint (for generate/eval/serve)")
    p.add_argument("--checkpoint", required=True, help="glasslm checkpoint or run directory, or Hugging Face model directory")
    p.add_argument("--out", required=True, help="directory for the quantized checkpoint")
    p.add_argument("--method", default="int8", choices=["int8", "int4"],
                   help="int8: one scale per output channel; int4: a scale and zero per group of 64 inputs "
                        "(default: int8)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out (default: refused)")
    p.set_defaults(func=cmd_quantize)

    p = sub.add_parser("train-tokenizer", help="train a byte-level BPE vocabulary on text files")
    p.add_argument("inputs", nargs="+", help="UTF-8 text files or dataset names")
    p.add_argument("--vocab-size", type=_positive_int, required=True,
                   help="tokens in the vocabulary: 256 bytes + merges + special tokens")
    p.add_argument("--special-tokens", nargs="*", default=["<|endoftext|>"],
                   help="strings kept whole, never merged or split (default: <|endoftext|>)")
    p.add_argument("--out", required=True, help="directory for vocab.json + merges.txt")
    p.add_argument("--workers", type=int, default=None, help="pre-tokenizing processes (default: all cores)")
    p.add_argument("--data-dir", default=None, help=DATA_DIR_HELP)
    p.add_argument("--overwrite", action="store_true", help="write into a non-empty --out (default: refused)")
    p.set_defaults(func=cmd_train_tokenizer)

    p = sub.add_parser("fetch", help="put known datasets into the data directory (download, or copy with --from)")
    p.add_argument("names", nargs="*", help="dataset names (default: all known)")
    p.add_argument("--from", dest="source", default=None, metavar="DIR",
                   help="copy from this local folder instead of downloading (sha256 still checked) (default: download)")
    p.add_argument("--data-dir", default=None, help=DATA_DIR_HELP)
    p.set_defaults(func=cmd_fetch)

    p = sub.add_parser("prepare", help="tokenize text files into train.bin / val.bin for training")
    p.add_argument("inputs", nargs="+", help="UTF-8 text files or dataset names")
    p.add_argument("--tokenizer", default="char", help="char, gpt2, or a saved tokenizer directory (default: char)")
    p.add_argument("--out", required=True, help="dataset directory to write")
    p.add_argument("--val-fraction", type=float, default=0.1,
                   help="the last fraction of each file (from a line start) becomes validation data (default: 0.1)")
    p.add_argument("--data-dir", default=None, help=DATA_DIR_HELP)
    p.add_argument("--overwrite", action="store_true",
                   help="delete what --out holds first (default: a non-empty --out is refused)")
    p.add_argument("--quiet", action="store_true", help="no progress output (default: progress on stderr)")
    p.set_defaults(func=cmd_prepare)
    return parser


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised like Ctrl-C so that commands clean up what they were writing."""

    signum = 15


def _raise_terminated(signum: int, frame: Any) -> None:
    raise Terminated()


def _describe(err: BaseException) -> str:
    """One line for the user: OS errors as "what: path", everything else as its message."""
    if isinstance(err, OSError) and err.strerror:
        where = f": {err.filename}" if err.filename else ""
        return f"{err.strerror}{where}"
    return " ".join(str(err).split("\n"))


def main(argv: list[str] | None = None) -> int:
    """Run one command. Every user-facing error goes through here once: a single line
    `glasslm COMMAND: error: ...` on stderr and exit status 1, never a traceback."""
    import signal
    import threading

    args = build_parser().parse_args(argv)
    if args.command != "train" and threading.current_thread() is threading.main_thread():
        # train saves a checkpoint on SIGTERM itself; other commands unwind like Ctrl-C, removing
        # half-written output (prepare's .tmp files) on the way out.
        signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        code = args.func(args)
    except (ValueError, FileNotFoundError, RuntimeError, FloatingPointError, OSError) as err:
        print(f"glasslm {args.command}: error: {_describe(err)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as err:
        print(f"glasslm {args.command}: interrupted", file=sys.stderr)
        return 128 + getattr(err, "signum", 2)
    return code or 0


def run() -> NoReturn:
    """The `glasslm` executable: `main` on the command line's arguments, its status the exit code."""
    from glasslm.training.distributed import exit_process

    exit_process(main())
