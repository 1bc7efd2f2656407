"""The `glasslm` command line. Options for model and training settings are generated from the
`ModelConfig` and `TrainConfig` dataclass fields, so the CLI never drifts from the configs.

    glasslm train --preset shakespeare-char-cpu --data tinyshakespeare --out runs/shakespeare
    glasslm generate --checkpoint runs/shakespeare --prompt "ROMEO:" --max-new-tokens 300
    glasslm eval --checkpoint runs/shakespeare --data tinyshakespeare
    glasslm info --preset gpt2-small
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


def cmd_train(args: argparse.Namespace) -> None:
    import torch

    from .checkpoint import save_checkpoint
    from .data import resolve_text, train_val_split
    from .generate import generate_tokens
    from .tokenizers import CharTokenizer
    from .train import train

    text_path = resolve_text(args.data, args.data_dir)
    text = text_path.read_text(encoding="utf-8")
    if not text:
        raise ValueError(f"{text_path} is empty")
    tokenizer = CharTokenizer.from_text(text)
    tokens = torch.tensor(tokenizer.encode(text), dtype=torch.long)
    train_tokens, val_tokens = train_val_split(tokens, args.val_fraction)

    model_cfg = get_preset(args.preset, **{"vocab_size": tokenizer.vocab_size, **dataclass_overrides(args, ModelConfig)})
    base_train = TRAIN_PRESETS.get(args.preset, TrainConfig())
    train_cfg = dataclasses.replace(base_train, **dataclass_overrides(args, TrainConfig))
    out = Path(args.out)
    print(f"data: {text_path} ({len(text):,} characters, vocab {tokenizer.vocab_size}, "
          f"{len(train_tokens):,} train / {len(val_tokens):,} val tokens)")
    print(f"model: {args.preset} ({_count(model_cfg):,} parameters) -> {out}")

    meta = {"preset": args.preset, "train_config": train_cfg.to_dict(), "data": str(text_path)}

    def checkpoint(step: int, val_loss: float, model) -> None:
        save_checkpoint(out, model, tokenizer, {**meta, "step": step, "val_loss": val_loss})

    result = train(model_cfg, train_cfg, train_tokens, val_tokens, on_eval=checkpoint)
    step, val_loss = result.val_losses[-1]
    print(f"done: val loss {val_loss:.4f} after {step} steps, {result.tokens_per_second:,.0f} tokens/s; "
          f"checkpoint in {out}")
    if args.sample_tokens > 0:
        model = result.model.eval()
        prompt = tokenizer.encode("\n")
        ids = generate_tokens(model, prompt, args.sample_tokens, temperature=0.8, top_k=200, seed=train_cfg.seed)
        print("--- sample ---")
        print(tokenizer.decode(list(ids)))


def _count(cfg: ModelConfig) -> int:
    from .model import TransformerLM

    return TransformerLM(cfg).num_parameters()


def _read_prompt(args: argparse.Namespace) -> str:
    if args.prompt_file:
        return Path(args.prompt_file).read_text(encoding="utf-8")
    if args.prompt == "-":
        return sys.stdin.read()
    return args.prompt


def cmd_sample(args: argparse.Namespace) -> None:
    import time

    import torch

    from .checkpoint import load_checkpoint
    from .generate import GenerationConfig, TextStreamer, generate_tokens, optimize_for_decoding

    model, tokenizer, _ = load_checkpoint(args.checkpoint, device=args.device)
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

    from .checkpoint import load_checkpoint
    from .data import resolve_text
    from .evaluate import evaluate_text

    model, tokenizer, _ = load_checkpoint(args.checkpoint, device=args.device)
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
    from .model import TransformerLM

    cfg = get_preset(args.preset, **dataclass_overrides(args, ModelConfig))
    import torch

    with torch.device("meta"):  # shapes only: even gpt2-xl costs no memory
        model = TransformerLM(cfg)
    print(f"{args.preset}: {model.num_parameters():,} parameters")
    for name, count in model.num_parameters(by_component=True).items():
        print(f"  {name:<28} {count:>15,}")
    if args.json:
        print(json.dumps(cfg.to_dict(), indent=2))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="glasslm", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("train", help="train a model on a text file or a named dataset")
    p.add_argument("--preset", default="shakespeare-char-cpu", choices=sorted(PRESETS))
    p.add_argument("--data", default="tinyshakespeare", help="dataset name or path to a UTF-8 text file")
    p.add_argument("--data-dir", default=None, help="where datasets are kept (default $GLASSLM_DATA_DIR or ~/.cache/glasslm)")
    p.add_argument("--out", default="runs/shakespeare-char", help="checkpoint directory")
    p.add_argument("--val-fraction", type=float, default=0.1)
    p.add_argument("--sample-tokens", type=int, default=300, help="print a sample of this many tokens at the end")
    add_dataclass_options(p, TrainConfig, "training settings (override the preset's)")
    add_dataclass_options(p, ModelConfig, "model settings (override the preset's)", skip={"vocab_size"})
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("sample", aliases=["generate"], help="write text from a trained checkpoint (streamed)")
    p.add_argument("--checkpoint", required=True)
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
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--data", required=True, help="dataset name or path to a UTF-8 text file")
    p.add_argument("--data-dir", default=None, help="where datasets are kept (default $GLASSLM_DATA_DIR or ~/.cache/glasslm)")
    p.add_argument("--stride", type=int, default=None,
                   help="tokens between window starts (default: the context length, i.e. chunks)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-chars", type=int, default=None, help="score only the first N characters")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--device", default="cpu")
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("info", help="parameter counts of a preset")
    p.add_argument("--preset", required=True, choices=sorted(PRESETS))
    p.add_argument("--json", action="store_true", help="also print the full config")
    add_dataclass_options(p, ModelConfig, "model settings (override the preset's)")
    p.set_defaults(func=cmd_info)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except (ValueError, FileNotFoundError, RuntimeError) as err:
        print(f"glasslm {args.command}: error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
