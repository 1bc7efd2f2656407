"""The `glasslm` command line. Options for model and training settings are generated from the
`ModelConfig` and `TrainConfig` dataclass fields, so the CLI never drifts from the configs.

    glasslm train --preset shakespeare-char-cpu --data tinyshakespeare --out runs/shakespeare
    glasslm sample --checkpoint runs/shakespeare --prompt "ROMEO:" --max-new-tokens 300
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


def cmd_sample(args: argparse.Namespace) -> None:
    from .generate import generate_tokens
    from .interop import load_model

    # A glasslm checkpoint or a Hugging Face GPT-2/Llama directory.
    model, tokenizer = load_model(args.checkpoint, device=args.device)
    if tokenizer is None:
        raise ValueError(f"{args.checkpoint} holds no tokenizer, so text cannot be encoded")
    model.eval()
    prompt = tokenizer.encode(args.prompt) if args.prompt else tokenizer.encode("\n")
    if not prompt:
        raise ValueError("the prompt encodes to no tokens")
    sys.stdout.write(args.prompt)
    for token in generate_tokens(model, prompt, args.max_new_tokens, args.temperature, args.top_k,
                                 args.top_p, args.seed):
        sys.stdout.write(tokenizer.decode([token]))
        sys.stdout.flush()
    sys.stdout.write("\n")


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
    p.add_argument("--preset", default="shakespeare-char-cpu", choices=sorted(PRESETS))
    p.add_argument("--data", default="tinyshakespeare", help="dataset name or path to a UTF-8 text file")
    p.add_argument("--data-dir", default=None, help="where datasets are kept (default $GLASSLM_DATA_DIR or ~/.cache/glasslm)")
    p.add_argument("--out", default="runs/shakespeare-char", help="checkpoint directory")
    p.add_argument("--val-fraction", type=float, default=0.1)
    p.add_argument("--sample-tokens", type=int, default=300, help="print a sample of this many tokens at the end")
    add_dataclass_options(p, TrainConfig, "training settings (override the preset's)")
    add_dataclass_options(p, ModelConfig, "model settings (override the preset's)", skip={"vocab_size"})
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("sample", aliases=["generate"], help="write text from a trained checkpoint")
    p.add_argument("--checkpoint", required=True, help="glasslm checkpoint or Hugging Face model directory")
    p.add_argument("--prompt", default="")
    p.add_argument("--max-new-tokens", type=int, default=500)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-k", type=int, default=200)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--device", default="cpu")
    p.set_defaults(func=cmd_sample)

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
        args.func(args)
    except (ValueError, FileNotFoundError, RuntimeError) as err:
        print(f"glasslm {args.command}: error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
