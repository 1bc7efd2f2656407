"""`glasslm convert`: glasslm checkpoints to and from Hugging Face directories, GGUF files (llama.cpp,
Ollama) and other codebases' files."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from glasslm.cli.command import Command
from glasslm.cli.common import OutputOption
from glasslm.io.formats import FORMATS


ForeignFormat = Literal[tuple(FORMATS)]  # type: ignore[valid-type]
GGUFType = Literal["f32", "f16", "q8_0", "q4_0", "q4_1"]


def _from_hf_help() -> str:
    """--from-hf's description, naming every family the registry imports (read when the parser is built)."""
    from glasslm.hf.families import FAMILIES

    types = sorted({name for family in FAMILIES.values() for name in (family.name, *family.model_types)})
    return (f"an HF model directory whose config.json's model_type is one glasslm imports ({', '.join(types)}), "
            "or a hub name in the local HF cache")


@dataclass
class ConvertConfig:
    """what to convert (one of --from-hf, --to-hf, --from-gguf, --to-gguf, --from-peft, --to-peft, --from)"""

    # an HF model directory of a family glasslm imports, or a hub name in the local HF cache (the help
    # names the families: `_from_hf_help`)
    from_hf: str | None = field(default=None, metadata={"one_of": "direction", "help": _from_hf_help})
    to_hf: bool = field(default=False, metadata={"one_of": "direction"})  # export --checkpoint as an HF directory
    # a GGUF file (llama.cpp, Ollama) to import: 4-bit blocks are kept as they are, the rest dequantized
    from_gguf: str | None = field(default=None, metadata={"one_of": "direction"})
    # export --checkpoint as a GGUF file that llama.cpp runs (--out is the file; --type its matrices' format)
    to_gguf: bool = field(default=False, metadata={"one_of": "direction"})
    # --to-gguf: the format of the weight matrices (norms and biases stay f32, as in llama.cpp)
    gguf_type: GGUFType = field(default="f32", metadata={"option": "--type"})
    # a PEFT LoRA adapter directory (adapter_config.json + adapter_model.safetensors) to save as a glasslm
    # adapter checkpoint of its base (which glasslm merge, generate, serve ... then load)
    from_peft: str | None = field(default=None, metadata={"one_of": "direction", "metavar": "DIR"})
    # --from-peft: the base model to apply the adapter to; none: its adapter_config.json's base_model_name_or_path
    base: str | None = None
    # export the LoRA adapters of --checkpoint (a glasslm finetune run) as a PEFT adapter directory
    to_peft: bool = field(default=False, metadata={"one_of": "direction"})
    # import the --checkpoint file another codebase saved (nanoGPT ckpt.pt, a TransformerLens/ARENA,
    # CS336 or seed 001/002/004 state dict); no pickled code runs
    from_format: ForeignFormat | None = field(default=None, metadata={"one_of": "direction", "option": "--from"})
    checkpoint: str | None = None  # glasslm checkpoint to export (with --to-hf), or the file to import (with --from)
    # --to-hf/--to-peft of a LoRA checkpoint: its base where it is now, if it moved (weights hashing as recorded)
    base: str | None = field(default=None, metadata={"metavar": "PATH"})
    # --from cs336/seed001/seed002: the number of heads (their files do not record it)
    n_heads: int | None = field(default=None, metadata={"minimum": 1})
    # Llama: context length to use instead of max_position_embeddings; --from cs336: the context
    # length (none: the cs336-lm preset's)
    context_length: int | None = field(default=None, metadata={"minimum": 1})
    # --to-hf of a bias-free GPT-2-shaped model: write exact zero biases (HF GPT-2 always has biases);
    # glasslm re-imports it bias-free (off: refused for a bias-free model)
    zero_biases: bool = False


def convert(config: ConvertConfig, output: OutputOption) -> int:
    if config.from_format:
        _from_foreign(config, output)
    elif config.from_hf:
        _from_hf(config, output)
    elif config.from_gguf:
        _from_gguf(config, output)
    elif config.to_gguf:
        _to_gguf(config, output)
    elif config.from_peft:
        _from_peft(config, output)
    elif config.to_peft:
        _to_peft(config, output)
    else:  # --to-hf: the parser requires one of the three
        _to_hf(config, output)
    return 0


def _from_foreign(config: ConvertConfig, output: OutputOption) -> None:
    from glasslm.locations import check_output_dir
    from glasslm.io.checkpoint import save_checkpoint
    from glasslm.io.formats import load_foreign

    if not config.checkpoint:
        raise ValueError(f"--from {config.from_format} needs --checkpoint FILE (the file that code saved)")
    check_output_dir(output.out, output.overwrite, inputs=[config.checkpoint], what="checkpoint")
    given = {"n_heads": config.n_heads, "context_length": config.context_length}
    model = load_foreign(config.checkpoint, config.from_format, **{k: v for k, v in given.items() if v is not None})
    save_checkpoint(output.out, model, None, {"converted_from": f"{config.from_format}:{config.checkpoint}"})
    print(f"{config.checkpoint} ({config.from_format}) -> {output.out} ({model.num_parameters():,} parameters)")


def _from_hf(config: ConvertConfig, output: OutputOption) -> None:
    from glasslm.locations import check_output_dir
    from glasslm.hf import hf_tokenizer, import_hf
    from glasslm.hf.cache import resolve_model_path
    from glasslm.io.checkpoint import save_checkpoint

    from glasslm.hf.peft import is_peft_directory

    if is_peft_directory(resolve_model_path(config.from_hf)):
        raise ValueError(f"--from-hf {config.from_hf} is a PEFT adapter directory: convert it with --from-peft "
                         "(or use it as --checkpoint directly)")
    check_output_dir(output.out, output.overwrite, inputs=[config.from_hf], what="checkpoint")
    model = import_hf(config.from_hf, context_length=config.context_length)
    tokenizer = hf_tokenizer(config.from_hf)
    if tokenizer is not None and not hasattr(tokenizer, "save"):
        tokenizer = None
    save_checkpoint(output.out, model, tokenizer, {"converted_from": str(config.from_hf)})
    _keep_generation_files(resolve_model_path(config.from_hf), Path(output.out), model.eos_token_ids)
    print(f"{config.from_hf} -> {output.out} ({model.num_parameters():,} parameters, "
          f"tokenizer {'included' if tokenizer is not None else 'not found'})")


def _from_gguf(config: ConvertConfig, output: OutputOption) -> None:
    import json

    from glasslm.hf.gguf.importer import import_gguf
    from glasslm.io.checkpoint import save_checkpoint
    from glasslm.locations import check_output_dir
    from glasslm.tokenizers import GENERATION_CONFIG_FILE

    check_output_dir(output.out, output.overwrite, inputs=[config.from_gguf], what="checkpoint")
    loaded = import_gguf(config.from_gguf, context_length=config.context_length)
    path = save_checkpoint(output.out, loaded.model, loaded.tokenizer, {"converted_from": str(config.from_gguf)})
    if loaded.model.eos_token_ids:  # the file's eos/eot ids, where generation stops
        ids = list(loaded.model.eos_token_ids)
        (path / GENERATION_CONFIG_FILE).write_text(json.dumps({"eos_token_id": ids[0] if len(ids) == 1 else ids}))
    print(f"{config.from_gguf} -> {output.out}: {loaded.summary()}")


def _to_gguf(config: ConvertConfig, output: OutputOption) -> None:
    from glasslm.hf import load_chat_template, load_model
    from glasslm.hf.gguf.exporter import export_gguf

    if not config.checkpoint:
        raise ValueError("--to-gguf needs --checkpoint")
    out = Path(output.out)
    if out.is_dir():
        raise ValueError(f"--out {out} is a directory; --to-gguf writes one file, e.g. --out {out / 'model.gguf'}")
    if out.exists() and not output.overwrite:
        raise ValueError(f"--out {out} exists; choose another --out, or pass --overwrite to replace it")
    model, tokenizer = load_model(config.checkpoint, base=config.base)
    export_gguf(model, out, tokenizer, config.gguf_type, load_chat_template(config.checkpoint, tokenizer))
    size = out.stat().st_size / 2**20
    print(f"{config.checkpoint} -> {out} (GGUF, {config.gguf_type} matrices, {size:.1f} MiB)")


def _keep_generation_files(source: Path, checkpoint: Path, eos_ids: tuple[int, ...]) -> None:
    """Keep what says how the model ends and chats: generation_config.json, with the eos ids the
    import settled on (config.json's or the tokenizer's where it names none, so that the checkpoint
    stops where the HF directory does), and a chat_template.jinja; tokenizer_config.json's template
    travels with the tokenizer."""
    import json
    import shutil

    from glasslm.tokenizers import GENERATION_CONFIG_FILE, read_generation_config
    from glasslm.tokenizers.chat import CHAT_TEMPLATE_FILE

    generation = read_generation_config(source)
    if eos_ids:
        generation["eos_token_id"] = eos_ids[0] if len(eos_ids) == 1 else list(eos_ids)
    if generation:
        (checkpoint / GENERATION_CONFIG_FILE).write_text(json.dumps(generation, indent=2))
    if (source / CHAT_TEMPLATE_FILE).is_file():
        shutil.copyfile(source / CHAT_TEMPLATE_FILE, checkpoint / CHAT_TEMPLATE_FILE)


def _to_hf(config: ConvertConfig, output: OutputOption) -> None:
    from glasslm.locations import check_output_dir
    from glasslm.hf import checkpoint_summary, export_hf, load_chat_template, load_model

    if not config.checkpoint:
        raise ValueError("--to-hf needs --checkpoint")
    check_output_dir(output.out, output.overwrite, inputs=[config.checkpoint], what="export")
    model, tokenizer = load_model(config.checkpoint, base=config.base)
    dequantized = _dequantize_for_export(model)
    if config.zero_biases:
        _refuse_needless_zero_biases(model.config)
    template = load_chat_template(config.checkpoint, tokenizer)
    export_hf(model, output.out, tokenizer, checkpoint_summary(config.checkpoint), zero_biases=config.zero_biases,
              chat_template=template)
    print(f"{config.checkpoint} -> {output.out} (Hugging Face format{', with its chat template' if template else ''}"
          f"{'; ' + dequantized if dequantized else ''})")


def _dequantize_for_export(model) -> str | None:
    """Hugging Face's layers hold plain weights: a quantized model (a GGUF file's blocks, an int8/int4
    checkpoint) is written dequantized to float32, the values it computes with; returns what was
    dequantized, to say so. LoRA adapters are left for export_hf to refuse (glasslm merge writes them)."""
    from glasslm.training.finetune import dequantize
    from glasslm.transforms import applied_transforms
    from glasslm.transforms.lora import lora_layers

    names = [t["name"] for t in applied_transforms(model)]
    if not names or lora_layers(model):
        return None
    dequantize(model)
    model.applied_transforms = []
    return f"its {', '.join(dict.fromkeys(names))} weights dequantized to float32"


def _refuse_needless_zero_biases(model_config) -> None:
    """--zero-biases only fills biases the HF architecture has and the model lacks; anywhere else it
    would do nothing, so it is refused rather than silently ignored."""
    from glasslm.hf.families import family_for

    family = family_for(model_config)
    if not family.weight_table(model_config, None).absent_biases:
        raise ValueError(f"--zero-biases: this model exports as {family.architecture} with every bias it has, so "
                         "there are no missing biases to fill; drop --zero-biases")


def _from_peft(config: ConvertConfig, output: OutputOption) -> None:
    """An adapter checkpoint (as glasslm finetune writes): the base's path and weights hash, the lora
    transform with PEFT's options, and only the adapter's tensors."""
    from glasslm.hf import load_model
    from glasslm.hf.load import hf_tokenizer
    from glasslm.hf.peft import import_peft_adapter, peft_base
    from glasslm.hf.peft.files import read_adapter_config
    from glasslm.io.checkpoint import ADAPTER_BASE_KEY, save_checkpoint, weights_sha256
    from glasslm.locations import check_output_dir
    from glasslm.training.finetune import base_reference
    from glasslm.transforms.lora import lora_state_dict

    check_output_dir(output.out, output.overwrite, inputs=[config.from_peft], what="checkpoint")
    model, _ = load_model(peft_base(config.from_peft, config.base))
    name = config.base or read_adapter_config(config.from_peft)["base_model_name_or_path"]  # a hub name stays one
    reference = {"path": base_reference(name), "sha256": weights_sha256(model.state_dict())}
    import_peft_adapter(model, config.from_peft)
    adapter_tokenizer = hf_tokenizer(config.from_peft)  # saved beside the adapter; else the base's is used
    meta = {ADAPTER_BASE_KEY: reference, "converted_from": f"peft:{config.from_peft}"}
    save_checkpoint(output.out, model, adapter_tokenizer, meta, state_dict=lora_state_dict(model))
    print(f"{config.from_peft} -> {output.out} (glasslm adapter checkpoint for {reference['path']}: "
          f"{sum(t.numel() for t in lora_state_dict(model).values()):,} adapter parameters)")


def _to_peft(config: ConvertConfig, output: OutputOption) -> None:
    from glasslm.hf import load_model
    from glasslm.hf.load import adapter_base
    from glasslm.hf.peft import export_peft_with_base
    from glasslm.io.checkpoint import ADAPTER_BASE_KEY, META_FILE, read_json, resolve_checkpoint
    from glasslm.locations import check_output_dir

    if not config.checkpoint:
        raise ValueError("--to-peft needs --checkpoint (a LoRA fine-tuning run or checkpoint)")
    check_output_dir(output.out, output.overwrite, inputs=[config.checkpoint], what="adapter")
    directory = resolve_checkpoint(config.checkpoint)
    meta = read_json(directory / META_FILE)
    if ADAPTER_BASE_KEY not in meta:
        raise ValueError(f"--checkpoint {config.checkpoint} holds no LoRA adapters (not a glasslm finetune LoRA run)")
    model, _ = load_model(config.checkpoint, base=config.base)
    _, named = export_peft_with_base(model, output.out, config.base or adapter_base(meta, str(directory))[0])
    print(f"{config.checkpoint} -> {output.out} (PEFT adapter; base_model_name_or_path: {named})")


COMMAND = Command("convert", convert, "convert between glasslm checkpoints and Hugging Face directories",
                  examples=(
                      'glasslm convert --from-hf path/to/hf-gpt2 --out runs/gpt2',
                      'glasslm convert --to-hf --checkpoint runs/shakespeare-char-cpu --out runs/shakespeare-char-cpu-hf',
                      'glasslm convert --from-gguf SmolLM2-135M-Instruct.Q4_1.gguf --out runs/smollm2',
                      'glasslm convert --to-gguf --checkpoint runs/shakespeare-char-cpu --out shakespeare.gguf --type q8_0',
                      'glasslm convert --from nanogpt --checkpoint out/ckpt.pt --out runs/nano',
                      'glasslm convert --from-peft path/to/peft-adapter --out runs/adapter   # or --base PATH',
                      'glasslm convert --to-peft --checkpoint runs/ft --out runs/ft-peft',
                  ))
