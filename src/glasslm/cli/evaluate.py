"""`glasslm eval --checkpoint DIR --data TEXT`: loss, perplexity and bits per byte of a model on a text;
`glasslm eval --checkpoint DIR --tasks NAME[,NAME]`: lm-evaluation-harness tasks, in this process;
`glasslm eval --checkpoint DIR --problems JSONL --reward exact_match`: greedy answers to problems with
checkable answers, scored by the reward a GRPO run trains with (its held-out measure)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from glasslm.cli.command import Command
from glasslm.cli.common import CheckpointOption, RuntimeOptions, load_for_inference
from glasslm.evaluation.config import EvalConfig
from glasslm.data.splits import VAL_FRACTION, Split


@dataclass
class EvalData:
    """what to score"""

    # dataset name, path to a UTF-8 text file, or a directory made by `glasslm prepare`
    data: str | None = field(default=None, metadata={"one_of": "what"})
    # comma-separated lm-eval task names (standard ones download their data from the hub), instead of --data
    tasks: str | None = field(default=None, metadata={"one_of": "what"})
    # problems JSONL (prompt or messages, answer; what finetune --method grpo trains on): greedy answers
    # scored by --reward, instead of --data
    problems: str | None = field(default=None, metadata={"one_of": "what", "metavar": "JSONL"})
    data_dir: str | None = None  # where datasets are kept; none: $GLASSLM_DATA_DIR, else ~/.cache/glasslm
    split: Split = "val"  # which part to score, split as in training (val: the text
                                                   # training did not see)
    val_fraction: float = VAL_FRACTION  # text files: validation starts at the first line start at or after
                               # 1 - this of the bytes
    max_chars: int | None = field(default=None, metadata={"minimum": 1})  # score only the first N characters;
                                                                          # none: all
    quiet: bool = False  # no progress bar (it goes to stderr)


@dataclass
class TaskOptions:
    """lm-evaluation-harness tasks, with --tasks (needs lm-eval: the eval extra)"""

    include_path: str | None = None  # a folder of your own task YAMLs (and the data files they name)
    # examples before each question; none: the task's default
    num_fewshot: int | None = field(default=None, metadata={"minimum": 0})
    # score only the first N documents of each task (--problems: the first N problems)
    limit: int | None = field(default=None, metadata={"minimum": 1})
    # also write the results as JSON to this file (lm-eval's; --problems: each answer and its reward)
    output: str | None = None


@dataclass
class ProblemOptions:
    """problems with checkable answers, with --problems (scored as finetune --method grpo rewards them)"""

    # exact_match, regex:PATTERN, MODULE:FUNCTION or file.py:FUNCTION (glasslm.evaluation.rewards)
    reward: str = "exact_match"
    max_new_tokens: int = field(default=32, metadata={"minimum": 1})  # the longest answer written
    chat_template: str | None = field(default=None, metadata={"metavar": "FILE"})  # Jinja file; none: the model's
    show: int = field(default=0, metadata={"minimum": 0})  # print the first N answers with their rewards


def evaluate(source: CheckpointOption, data: EvalData, tasks: TaskOptions, problems: ProblemOptions,
             scoring: EvalConfig, runtime: RuntimeOptions) -> int:
    import time

    from glasslm.evaluation.perplexity import evaluate_text

    if data.tasks:  # the parser allows exactly one of --data, --tasks and --problems
        return _run_tasks(source, data.tasks, tasks, scoring.batch_size, runtime)
    if data.problems:
        return _run_problems(source, data.problems, problems, tasks, scoring.batch_size, runtime)

    model, tokenizer = load_for_inference(source.checkpoint, runtime, need_tokenizer=False, base=source.base)
    tokenizer, text, ids, described = _text_to_score(model, tokenizer, source.checkpoint, data, scoring)
    start = time.perf_counter()
    result = evaluate_text(model, tokenizer, text, progress=not data.quiet, ids=ids, **dataclasses.asdict(scoring))
    seconds = time.perf_counter() - start
    stride = scoring.stride or model.config.context_length
    print(f"data: {described} ({result['tokens']:,} tokens scored, {result['bytes']:,} bytes; "
          f"context {model.config.context_length}, stride {stride})")
    print(f"loss {result['loss']:.4f}  perplexity {result['perplexity']:.3f}  "
          f"bits/byte {result['bits_per_byte']:.4f}  ({seconds:.1f} s)")
    return 0


def _run_tasks(source: CheckpointOption, task_names: str, options: TaskOptions, batch_size: int,
               runtime: RuntimeOptions) -> int:
    """Run lm-eval tasks on the checkpoint (glasslm's `GlassLMEval`), print the table, maybe write JSON."""
    import json
    from pathlib import Path

    try:
        from glasslm.evaluation.harness import evaluate_tasks, results_table
        import lm_eval  # noqa: F401
    except ImportError:
        raise RuntimeError("--tasks needs lm-evaluation-harness: pip install lm-eval "
                           "(in a glasslm checkout: pip install -e '.[eval]')") from None
    names = [name.strip() for name in task_names.split(",") if name.strip()]
    if not names:
        raise ValueError("--tasks: give at least one task name")
    if options.include_path and not Path(options.include_path).is_dir():
        raise ValueError(f"--include-path {options.include_path}: no such folder")
    model, tokenizer = load_for_inference(source.checkpoint, runtime, decoding=True, base=source.base)
    results = evaluate_tasks(model, tokenizer, names, include_path=options.include_path,
                             num_fewshot=options.num_fewshot, limit=options.limit, batch_size=batch_size)
    print(results_table(results))
    if options.output:
        keep = {key: results[key] for key in ("results", "versions", "n-shot", "config") if key in results}
        Path(options.output).write_text(json.dumps(keep, indent=2, default=str), encoding="utf-8")
        print(f"results written to {options.output}")
    return 0


def _run_problems(source: CheckpointOption, path: str, options: ProblemOptions, tasks: TaskOptions,
                  batch_size: int, runtime: RuntimeOptions) -> int:
    """Answer the problems greedily, score them with the reward, print accuracy (and --show answers)."""
    import json
    import time
    from pathlib import Path

    from glasslm.data.problems import load_problems
    from glasslm.evaluation.problems import check_answers, score_problems
    from glasslm.evaluation.rewards import load_reward
    from glasslm.hf import load_chat_template

    reward = load_reward(options.reward)  # a bad --reward is refused before the model loads
    model, tokenizer = load_for_inference(source.checkpoint, runtime, decoding=True, base=source.base)
    template = load_chat_template(source.checkpoint, tokenizer, options.chat_template)
    if template is None:
        raise ValueError(f"{source.checkpoint} has no chat template (chat_template.jinja or tokenizer_config.json's "
                         "chat_template): give one with --chat-template FILE")
    problems = load_problems(path, tokenizer, template)[:tasks.limit]
    check_answers(problems, options.reward, reward, path)
    start = time.perf_counter()
    result = score_problems(model, tokenizer, problems, reward, options.max_new_tokens, batch_size)
    seconds = time.perf_counter() - start
    for answer in result.answers[:options.show]:
        print(f"reward {answer.reward:g}  expected {answer.expected!r}  prompt {answer.prompt!r}\n  answer {answer.completion!r}")
    solved = sum(a.reward >= 1.0 for a in result.answers)
    print(f"problems: {path} ({result.count} problems; reward {options.reward}; greedy, up to "
          f"{options.max_new_tokens} new tokens)")
    print(f"accuracy {result.accuracy:.4f} ({solved}/{result.count} with reward 1)  mean reward {result.mean_reward:.4f}  "
          f"({seconds:.1f} s)")
    if tasks.output:
        summary = {"problems": path, "reward": options.reward, "accuracy": result.accuracy,
                   "mean_reward": result.mean_reward, "answers": [dataclasses.asdict(a) for a in result.answers]}
        Path(tasks.output).write_text(json.dumps(summary, indent=2), encoding="utf-8")
        print(f"results written to {tasks.output}")
    return 0


def _text_to_score(model: Any, tokenizer: Any, checkpoint: str, data: EvalData,
                   scoring: EvalConfig) -> tuple[Any, str | None, Any, str]:
    """(tokenizer, text, token ids, description) of the split to score: a prepared dataset gives
    ids and its own tokenizer, a text file gives text for the model's tokenizer. The split rule is
    training's: prepared datasets hold it in their files, text files are cut by data.split_offset."""
    import numpy as np

    from glasslm.data import is_prepared, load_prepared, read_split, resolve_text

    if is_prepared(data.data):
        prepared = load_prepared(data.data)
        ids = {"train": prepared.train, "val": prepared.val}.get(data.split)
        ids = np.concatenate([prepared.train, prepared.val]) if ids is None else ids
        if scoring.max_tokens:
            ids = ids[:scoring.max_tokens + 1]
        ids = np.asarray(ids, dtype=np.int64)
        _check_same_tokenizer(tokenizer, prepared.tokenizer, ids, model.config.vocab_size, data.data, checkpoint)
        return prepared.tokenizer, None, ids, f"{data.data} [{data.split}]"
    if tokenizer is None:
        raise ValueError(f"{checkpoint} holds no tokenizer, so text cannot be encoded")
    text_path = resolve_text(data.data, data.data_dir)
    text = read_split(text_path, data.split, data.val_fraction)
    if data.max_chars:
        text = text[:data.max_chars]
    if len(text) < 2:
        raise ValueError(f"the {data.split} split of {text_path} holds {len(text)} characters: nothing to score "
                         "(validation starts at the first line start in the last --val-fraction of the bytes)")
    return tokenizer, text, None, f"{text_path} [{data.split}]"


def _check_same_tokenizer(model_tokenizer: Any, data_tokenizer: Any, ids: Any, vocab_size: int, data: str,
                          checkpoint: str) -> None:
    """A prepared dataset's token ids mean something only to the tokenizer that made them."""
    if data_tokenizer.vocab_size > vocab_size:
        raise ValueError(f"{data} has a vocabulary of {data_tokenizer.vocab_size} tokens, more than the "
                         f"model's {vocab_size}: it was prepared with another tokenizer")
    sample = [int(i) for i in ids[:2000]]
    if model_tokenizer is not None and (model_tokenizer.vocab_size != data_tokenizer.vocab_size
                                        or model_tokenizer.decode(sample) != data_tokenizer.decode(sample)):
        raise ValueError(f"{data} was prepared with a different tokenizer than {checkpoint}'s; "
                         "prepare it with --tokenizer pointing at the checkpoint")


COMMAND = Command("eval", evaluate, "loss, perplexity and bits per byte of a checkpoint on a text, lm-eval tasks, "
                  "or accuracy on problems",
                  examples=(
                      'glasslm eval --checkpoint runs/shakespeare-char-cpu --data tinyshakespeare',
                      'glasslm eval --checkpoint runs/shakespeare-char-cpu --data my.txt --split all --stride 32',
                      'glasslm eval --checkpoint runs/llama --tasks hellaswag,arc_easy --limit 100 --output results.json',
                      'glasslm eval --checkpoint runs/grpo --problems heldout.jsonl --reward exact_match --show 3',
                  ))
