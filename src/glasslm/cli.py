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
    glasslm convert --to-hf --checkpoint runs/gpt2 --out exported/gpt2
    glasslm inspect attention --checkpoint runs/shakespeare --prompt "ROMEO:" --layer 0 --head 1 --out attn.png
    glasslm inspect logit-lens --checkpoint runs/shakespeare --prompt "ROMEO:" --out lens.png
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import types
import typing
from pathlib import Path
from typing import Any

from .config import PRESETS, ModelConfig, get_preset
from .train import TRAIN_PRESETS, TrainConfig


def _field_type(cls: type, f: dataclasses.Field) -> type:
    """The plain Python type behind a dataclass field's annotation (int | None -> int)."""
    hint = typing.get_type_hints(cls)[f.name]
    if typing.get_origin(hint) is typing.Literal:
        return type(typing.get_args(hint)[0])
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    return hint


def _parse_bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {text!r}")


def add_dataclass_options(parser: argparse.ArgumentParser, cls: type, title: str, skip: set[str] = set()) -> None:
    """One --option per field of `cls`, defaulting to None so only given values override a preset."""
    group = parser.add_argument_group(title)
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        kind = _field_type(cls, f)
        hint = typing.get_type_hints(cls)[f.name]
        choices = typing.get_args(hint) if typing.get_origin(hint) is typing.Literal else None
        group.add_argument(
            "--" + f.name.replace("_", "-"), dest=f"{cls.__name__}.{f.name}", default=None,
            type=_parse_bool if kind is bool else kind, choices=choices, metavar=None if choices else kind.__name__.upper(),
        )


def dataclass_overrides(args: argparse.Namespace, cls: type) -> dict[str, Any]:
    prefix = cls.__name__ + "."
    return {k[len(prefix):]: v for k, v in vars(args).items() if k.startswith(prefix) and v is not None}


def load_config_file(path: str) -> dict[str, Any]:
    """A run description from TOML (or YAML, if PyYAML is installed).

    Top-level keys are the `train` command's own options (preset, data, out, ...); the tables
    [model] and [train] override fields of ModelConfig and TrainConfig:

        preset = "shakespeare-char-cpu"
        data = "tinyshakespeare"
        [model]
        n_layers = 2
        [train]
        max_steps = 500
        dtype = "bfloat16"
    """
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"config file {file} does not exist")
    if file.suffix in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError:
            raise ValueError(f"{file}: reading YAML needs PyYAML (pip install pyyaml); TOML works without") from None
        data = yaml.safe_load(file.read_text()) or {}
    else:
        import tomllib

        try:
            data = tomllib.loads(file.read_text())
        except tomllib.TOMLDecodeError as err:
            raise ValueError(f"{file} is not valid TOML: {err}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{file} must hold a table of settings")
    allowed = {"preset", "data", "data_dir", "out", "val_fraction", "sample_tokens", "model", "train"}
    unknown = set(data) - allowed
    if unknown:
        raise ValueError(f"{file}: unknown keys {sorted(unknown)}; allowed: {sorted(allowed)}")
    return data


def _pick(cli_value: Any, file: dict[str, Any], key: str, default: Any) -> Any:
    """Command line beats the config file beats the default."""
    return cli_value if cli_value is not None else file.get(key, default)


def cmd_train(args: argparse.Namespace) -> int:
    from .checkpoint import load_config, read_json, resolve_checkpoint
    from .accounting import parameter_count
    from .data import load_training_data
    from .distributed import init_distributed, shutdown_distributed
    from .generate import generate_tokens
    from .tokenizers import get_tokenizer, load_tokenizer
    from .train import TRAINER_STATE_JSON, train

    file = load_config_file(args.config) if args.config else {}
    train_overrides = {**file.get("train", {}), **dataclass_overrides(args, TrainConfig)}
    model_overrides = {**file.get("model", {}), **dataclass_overrides(args, ModelConfig)}
    resume_dir = resolve_checkpoint(args.resume, prefer=("latest",)) if args.resume else None
    if resume_dir is not None:
        # The checkpoint records the run; the command line may change training settings (e.g.
        # raise max_steps to train longer), not the model.
        saved_meta = read_json(resume_dir / "meta.json")
        saved_state = read_json(resume_dir / TRAINER_STATE_JSON)
        if model_overrides:
            raise ValueError(f"--resume continues the checkpoint's model; drop {sorted(model_overrides)}")
        preset = saved_meta.get("preset", "checkpoint")
        data_source = _pick(args.data, file, "data", saved_meta.get("data"))
        val_fraction = _pick(args.val_fraction, file, "val_fraction", saved_meta.get("val_fraction", 0.1))
        model_cfg = load_config(resume_dir / "config.json")
        train_cfg = dataclasses.replace(TrainConfig.from_dict(saved_state["train_config"]), **train_overrides)
        out = Path(_pick(args.out, file, "out", resume_dir.parent))
    else:
        preset = _pick(args.preset, file, "preset", "shakespeare-char-cpu")
        data_source = _pick(args.data, file, "data", "tinyshakespeare")
        val_fraction = _pick(args.val_fraction, file, "val_fraction", 0.1)
        train_cfg = dataclasses.replace(TRAIN_PRESETS.get(preset, TrainConfig()), **train_overrides)
        out = Path(_pick(args.out, file, "out", f"runs/{preset}"))

    data_dir = _pick(args.data_dir, file, "data_dir", None)
    if resume_dir is not None:
        tokenizer = load_tokenizer(resume_dir)
    else:
        spec = _pick(args.tokenizer, file, "tokenizer", "char")
        tokenizer = None if spec == "char" else get_tokenizer(spec, data_dir=data_dir)  # char: built from the text
    data = load_training_data(data_source, data_dir, val_fraction, tokenizer=tokenizer)
    tokenizer, train_tokens, val_tokens = data.tokenizer, data.train, data.val
    if resume_dir is None:
        model_cfg = get_preset(preset, **{"vocab_size": tokenizer.vocab_size, **model_overrides})
    elif tokenizer.vocab_size != model_cfg.vocab_size:
        raise ValueError(f"{data_source} has a vocabulary of {tokenizer.vocab_size} tokens, but the checkpoint's "
                         f"model has {model_cfg.vocab_size}")

    ctx = init_distributed(train_cfg.device)
    say = print if ctx.is_main else (lambda *a, **k: None)
    say(f"data: {data.description}")
    say(f"model: {preset} ({parameter_count(model_cfg):,} parameters) -> {out}"
        + (f", {ctx.world_size} processes" if ctx.enabled else "")
        + (f", resuming from {resume_dir}" if resume_dir is not None else ""))

    meta = {"preset": preset, "data": data.source, "val_fraction": val_fraction, "train_config": train_cfg.to_dict()}
    loggers = _optional_loggers(train_cfg, out, {"model": model_cfg.to_dict(), "train": train_cfg.to_dict()}) \
        if ctx.is_main else []
    try:
        result = train(model_cfg, train_cfg, train_tokens, val_tokens, run_dir=out, resume=resume_dir,
                       tokenizer=tokenizer, meta=meta, dist_ctx=ctx, loggers=loggers)
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
    if args.sample_tokens and ctx.is_main and not (train_cfg.fsdp and ctx.enabled):
        model = result.model.eval()
        prompt = tokenizer.encode("\n")
        ids = generate_tokens(model, prompt, args.sample_tokens, temperature=0.8, top_k=200, seed=train_cfg.seed)
        print("--- sample ---")
        print(tokenizer.decode(list(ids)))
    return 0


def _optional_loggers(cfg: TrainConfig, run_dir: Path, config: dict[str, Any]) -> list:
    from .loggers import TensorBoardLogger, WandbLogger

    loggers: list = []
    for enabled, make, package in ((cfg.tensorboard, lambda: TensorBoardLogger(run_dir), "tensorboard"),
                                   (cfg.wandb, lambda: WandbLogger(run_dir, config), "wandb")):
        if enabled:
            try:
                loggers.append(make())
            except ImportError:
                raise ValueError(f"--{package} needs the {package} package: pip install 'glasslm[{package}]'") from None
    return loggers


def cmd_plot(args: argparse.Namespace) -> int:
    from .plot import plot_run

    path = plot_run(args.run_dir, args.out)
    print(f"wrote {path}")
    return 0


def _read_prompt(args: argparse.Namespace) -> str:
    if args.prompt_file:
        return Path(args.prompt_file).read_text(encoding="utf-8")
    if args.prompt == "-":
        return sys.stdin.read()
    return args.prompt


def cmd_sample(args: argparse.Namespace) -> None:
    import time

    import torch

    from .generate import GenerationConfig, TextStreamer, generate_tokens, optimize_for_decoding
    from .interop import load_model

    # A glasslm checkpoint or a Hugging Face GPT-2/Llama directory.
    model, tokenizer = load_model(args.checkpoint, device=args.device)
    if tokenizer is None:
        raise ValueError(f"{args.checkpoint} holds no tokenizer, so text cannot be encoded")
    model = model.to(getattr(torch, args.dtype)).eval()
    optimize_for_decoding(model)
    config = GenerationConfig(
        max_new_tokens=args.max_new_tokens, temperature=args.temperature,
        top_k=args.top_k if args.top_k and args.top_k > 0 else None, top_p=args.top_p, min_p=args.min_p,
        repetition_penalty=args.repetition_penalty, seed=args.seed, stop_tokens=args.stop_token or (),
        stop_strings=args.stop or (),
    )

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
        for token in generate_tokens(model, prompt_ids, config=config):
            n_tokens += 1
            sys.stdout.write(streamer.push(token))
            sys.stdout.flush()
            if streamer.stopped:
                break
        sys.stdout.write(streamer.finish() + "\n")
        sys.stdout.flush()
        seconds = time.perf_counter() - start
        print(f"[{n_tokens} tokens in {seconds:.2f} s: {n_tokens / max(seconds, 1e-9):.1f} tokens/s, "
              f"prompt {len(prompt_ids)} tokens]", file=sys.stderr)

    if not args.interactive:
        respond(_read_prompt(args), echo=True)
        return
    # Interactive: the model stays loaded; every line read from stdin is a new prompt, until EOF.
    print("glasslm interactive: one prompt per line, end with Ctrl-D", file=sys.stderr)
    for line in sys.stdin:
        respond(line.rstrip("\n"), echo=False)


def cmd_eval(args: argparse.Namespace) -> None:
    import time

    import torch

    from .data import resolve_text
    from .evaluate import evaluate_text
    from .interop import load_model

    model, tokenizer = load_model(args.checkpoint, device=args.device)  # glasslm or HF directory
    if tokenizer is None:
        raise ValueError(f"{args.checkpoint} holds no tokenizer, so text cannot be encoded")
    model = model.to(getattr(torch, args.dtype))
    text_path = resolve_text(args.data, args.data_dir)
    text = text_path.read_text(encoding="utf-8")
    if args.max_chars:
        text = text[:args.max_chars]
    start = time.perf_counter()
    result = evaluate_text(model, tokenizer, text, stride=args.stride, batch_size=args.batch_size)
    seconds = time.perf_counter() - start
    stride = args.stride or model.config.context_length
    print(f"data: {text_path} ({result['tokens']:,} tokens scored, {result['bytes']:,} bytes; "
          f"context {model.config.context_length}, stride {stride})")
    print(f"loss {result['loss']:.4f}  perplexity {result['perplexity']:.3f}  "
          f"bits/byte {result['bits_per_byte']:.4f}  ({seconds:.1f} s)")


def cmd_info(args: argparse.Namespace) -> None:
    from .accounting import format_cost_table

    # --context-length (a ModelConfig option) sets the model's context and the FLOPs' context alike.
    cfg = get_preset(args.preset, **dataclass_overrides(args, ModelConfig))
    print(format_cost_table(cfg, title=args.preset))
    if args.json:
        print(json.dumps(cfg.to_dict(), indent=2))


def cmd_convert(args: argparse.Namespace) -> None:
    from .checkpoint import save_checkpoint
    from .interop import export_hf, import_hf, hf_tokenizer, load_model

    if args.from_hf:
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
        model, tokenizer = load_model(args.checkpoint)
        export_hf(model, args.out, tokenizer)
        print(f"{args.checkpoint} -> {args.out} (Hugging Face format)")


def cmd_inspect(args: argparse.Namespace) -> None:
    from .inspection import draw_attention, draw_logit_lens
    from .interop import load_model

    model, tokenizer = load_model(args.checkpoint, device=args.device)
    if args.what == "attention":
        path = draw_attention(model, tokenizer, args.prompt, args.layer, args.head, args.out)
    else:
        path = draw_logit_lens(model, tokenizer, args.prompt, args.out)
    print(f"wrote {path}")


def cmd_serve(args: argparse.Namespace) -> None:
    import torch

    from .generate import optimize_for_decoding
    from .interop import load_model

    try:
        from .serve import serve
        import fastapi, uvicorn  # noqa: F401
    except ImportError:
        raise RuntimeError("serving needs fastapi and uvicorn: pip install 'glasslm[serve]'") from None
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.checkpoint, device=args.device)
    if tokenizer is None:
        raise ValueError(f"{args.checkpoint} holds no tokenizer, so text cannot be encoded")
    model = optimize_for_decoding(model.to(getattr(torch, args.dtype)).eval())
    name = args.name or Path(args.checkpoint).resolve().name
    serve(model, tokenizer, args.host, args.port, name, args.max_batch, args.max_queue, args.max_tokens_limit,
          args.grace, args.log_level)


def cmd_train_tokenizer(args: argparse.Namespace) -> None:
    import time

    from .data import resolve_text
    from .tokenizers import train_tokenizer

    paths = [resolve_text(source, args.data_dir) for source in args.inputs]
    start = time.perf_counter()
    tokenizer = train_tokenizer(paths, args.vocab_size, args.special_tokens, args.out, args.workers)
    print(f"trained a {tokenizer.vocab_size:,}-token byte-level BPE in {time.perf_counter() - start:.2f} s "
          f"-> {args.out} (vocab.json, merges.txt)")


def cmd_prepare(args: argparse.Namespace) -> None:
    from .data import char_vocabulary, prepare, resolve_text
    from .tokenizers import CharTokenizer, get_tokenizer

    paths = [resolve_text(source, args.data_dir) for source in args.inputs]
    if args.tokenizer == "char":
        tokenizer = CharTokenizer(char_vocabulary(paths))
    else:
        tokenizer = get_tokenizer(args.tokenizer, data_dir=args.data_dir)
    meta = prepare(paths, tokenizer, args.out, args.val_fraction, progress=not args.quiet)
    print(f"{args.out}: {meta['train_tokens']:,} train + {meta['val_tokens']:,} val tokens "
          f"({meta['dtype']}, vocab {meta['vocab_size']:,})")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="glasslm", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("train", help="train a model on a text file or a named dataset")
    p.add_argument("--config", default=None, help="TOML file of settings ([model], [train] tables); flags override it")
    p.add_argument("--resume", default=None, metavar="DIR",
                   help="continue exactly from a checkpoint (a run directory resumes its latest)")
    p.add_argument("--preset", default=None, choices=sorted(PRESETS), help="default shakespeare-char-cpu")
    p.add_argument("--data", default=None,
                   help="dataset name, UTF-8 text file, or a directory made by `glasslm prepare` (default tinyshakespeare)")
    p.add_argument("--tokenizer", default=None,
                   help="for text files: char (default), gpt2, or a saved tokenizer directory")
    p.add_argument("--data-dir", default=None, help="where datasets are kept (default $GLASSLM_DATA_DIR or ~/.cache/glasslm)")
    p.add_argument("--out", default=None, help="run directory: checkpoints, metrics.jsonl (default runs/PRESET)")
    p.add_argument("--val-fraction", type=float, default=None, help="default 0.1")
    p.add_argument("--sample-tokens", type=int, default=300, help="print a sample of this many tokens at the end")
    add_dataclass_options(p, TrainConfig, "training settings (override the preset's)")
    add_dataclass_options(p, ModelConfig, "model settings (override the preset's)", skip={"vocab_size"})
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("plot", help="PNG of train/val loss against steps and tokens of a run")
    p.add_argument("run_dir", help="run directory holding metrics.jsonl")
    p.add_argument("--out", default=None, help="PNG path (default RUN_DIR/loss.png)")
    p.set_defaults(func=cmd_plot)

    p = sub.add_parser("sample", aliases=["generate"], help="write text from a trained checkpoint (streamed)")
    p.add_argument("--checkpoint", required=True, help="glasslm checkpoint or run directory, or Hugging Face model directory")
    source = p.add_mutually_exclusive_group()
    source.add_argument("--prompt", default="", help="the prompt text; '-' reads it from stdin")
    source.add_argument("--prompt-file", default=None, help="read the prompt from this UTF-8 file")
    source.add_argument("--interactive", action="store_true",
                        help="keep the model loaded and answer each line of stdin until EOF")
    p.add_argument("--max-new-tokens", type=int, default=500)
    p.add_argument("--temperature", type=float, default=0.8, help="0 means greedy")
    p.add_argument("--top-k", type=int, default=200, help="0 turns top-k off")
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--min-p", type=float, default=None)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--stop", action="append", default=None, metavar="TEXT", help="stop before this text (repeatable)")
    p.add_argument("--stop-token", action="append", type=int, default=None, metavar="ID",
                   help="stop at this token id (repeatable)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="weights' dtype for decoding")
    p.add_argument("--device", default="cpu")
    p.set_defaults(func=cmd_sample)

    p = sub.add_parser("eval", help="loss, perplexity and bits per byte of a checkpoint on a text")
    p.add_argument("--checkpoint", required=True, help="glasslm checkpoint or run directory, or Hugging Face model directory")
    p.add_argument("--data", required=True, help="dataset name or path to a UTF-8 text file")
    p.add_argument("--data-dir", default=None, help="where datasets are kept (default $GLASSLM_DATA_DIR or ~/.cache/glasslm)")
    p.add_argument("--stride", type=int, default=None,
                   help="tokens between window starts (default: the context length, i.e. chunks)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-chars", type=int, default=None, help="score only the first N characters")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--device", default="cpu")
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("info", help="parameters and FLOPs per token of a preset, by component")
    p.add_argument("--preset", required=True, choices=sorted(PRESETS))
    p.add_argument("--json", action="store_true", help="also print the full config")
    add_dataclass_options(p, ModelConfig, "model settings (override the preset's)")
    p.set_defaults(func=cmd_info)

    p = sub.add_parser("convert", help="convert between glasslm checkpoints and Hugging Face directories")
    direction = p.add_mutually_exclusive_group(required=True)
    direction.add_argument("--from-hf", metavar="DIR", help="an HF GPT-2 or Llama directory to import")
    direction.add_argument("--to-hf", action="store_true", help="export --checkpoint as an HF directory")
    p.add_argument("--checkpoint", help="glasslm checkpoint to export (with --to-hf)")
    p.add_argument("--out", required=True, help="where to write the converted model")
    p.add_argument("--context-length", type=int, default=None,
                   help="Llama only: context length to use instead of max_position_embeddings")
    p.set_defaults(func=cmd_convert)

    p = sub.add_parser("inspect", help="draw attention patterns or the logit lens (needs matplotlib)")
    what = p.add_subparsers(dest="what", required=True)
    for name, help_text in (("attention", "one head's attention pattern, tokens on both axes"),
                            ("logit-lens", "top next token read from every layer, as a grid")):
        q = what.add_parser(name, help=help_text)
        q.add_argument("--checkpoint", required=True, help="glasslm checkpoint or Hugging Face model directory")
        q.add_argument("--prompt", required=True)
        q.add_argument("--out", required=True, help="PNG file to write")
        q.add_argument("--device", default="cpu")
        if name == "attention":
            q.add_argument("--layer", type=int, required=True)
            q.add_argument("--head", type=int, required=True)
        q.set_defaults(func=cmd_inspect)

    p = sub.add_parser("serve", help="OpenAI-compatible completions server and the explorer page (needs glasslm[serve])")
    p.add_argument("--checkpoint", required=True, help="glasslm checkpoint or run directory, or Hugging Face model directory")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    p.add_argument("--name", default=None, help="model name in the API (default: the checkpoint directory's name)")
    p.add_argument("--max-batch", type=int, default=32, help="requests decoded together; 1 serves one at a time")
    p.add_argument("--max-queue", type=int, default=64, help="requests that may wait; more get HTTP 429")
    p.add_argument("--max-tokens-limit", type=int, default=2048, help="largest max_tokens a request may ask for")
    p.add_argument("--grace", type=float, default=10.0,
                   help="seconds in-flight requests get to finish after SIGTERM before they are aborted")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=0,
                   help="CPU threads for the model (0: torch's default, one per core); small models on a busy CPU "
                        "decode fastest with 1")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("train-tokenizer", help="train a byte-level BPE vocabulary on text files")
    p.add_argument("inputs", nargs="+", help="UTF-8 text files or dataset names")
    p.add_argument("--vocab-size", type=int, required=True)
    p.add_argument("--special-tokens", nargs="*", default=["<|endoftext|>"])
    p.add_argument("--out", required=True, help="directory for vocab.json + merges.txt")
    p.add_argument("--workers", type=int, default=None, help="pre-tokenizing processes (default: all cores)")
    p.add_argument("--data-dir", default=None)
    p.set_defaults(func=cmd_train_tokenizer)

    p = sub.add_parser("prepare", help="tokenize text files into train.bin / val.bin for training")
    p.add_argument("inputs", nargs="+", help="UTF-8 text files or dataset names")
    p.add_argument("--tokenizer", default="char", help="char, gpt2, or a saved tokenizer directory")
    p.add_argument("--out", required=True, help="dataset directory to write")
    p.add_argument("--val-fraction", type=float, default=0.1,
                   help="the last fraction of each file (from a line start) becomes validation data")
    p.add_argument("--data-dir", default=None)
    p.add_argument("--quiet", action="store_true")
    p.set_defaults(func=cmd_prepare)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code = args.func(args)
    except (ValueError, FileNotFoundError, RuntimeError, FloatingPointError) as err:
        print(f"glasslm {args.command}: error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return code or 0


if __name__ == "__main__":
    sys.exit(main())
