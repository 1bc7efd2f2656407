"""lm-evaluation-harness on a glasslm model, in this process (what litgpt's `evaluate` does).

`GlassLMEval` is an lm-eval `LM`: it scores with glasslm's forward pass (`loglikelihood`,
`loglikelihood_rolling`) and writes with glasslm's own batched KV-cache decoding
(`generate_until`). It tokenizes exactly as lm-eval's `--model hf` does (trailing spaces of a
context move to its continuation, the pair is encoded whole and split, an empty context is
conditioned on the prefix token, long documents are cut into the same rolling windows), so a
model exported to Hugging Face format scores the same through either route.

`evaluate_tasks` runs named tasks (or task YAMLs under `include_path`) and returns lm-eval's
results dictionary; `results_table` prints it. lm-eval is optional: `pip install lm-eval` (the `eval` extra).

Example (a local task over a file the example writes; standard tasks download their data from
the hub):
    >>> import json, tempfile, pathlib
    >>> from glasslm.core.model import TransformerLM
    >>> from glasslm.presets import get_preset
    >>> from glasslm.tokenizers import CharTokenizer
    >>> folder = pathlib.Path(tempfile.mkdtemp())
    >>> rows = [{"q": "ab", "choices": ["a", "b"], "answer": 0}, {"q": "ba", "choices": ["a", "b"], "answer": 1}]
    >>> _ = (folder / "data.jsonl").write_text("".join(json.dumps(r) + "\\n" for r in rows))
    >>> _ = (folder / "pick.yaml").write_text(
    ...     "task: pick\\ndataset_path: json\\ndataset_kwargs:\\n  data_files:\\n"
    ...     f"    test: {folder / 'data.jsonl'}\\ntest_split: test\\noutput_type: multiple_choice\\n"
    ...     "doc_to_text: '{{q}}'\\ndoc_to_choice: '{{choices}}'\\ndoc_to_target: answer\\n"
    ...     "metric_list:\\n  - metric: acc\\n")
    >>> tok = CharTokenizer.from_text("ab \\n")  # lm-eval joins question and answer with a space
    >>> model = TransformerLM(get_preset("shakespeare-char-cpu", vocab_size=tok.vocab_size, n_layers=1)).eval()
    >>> results = evaluate_tasks(model, tok, ["pick"], include_path=folder)
    >>> 0.0 <= results["results"]["pick"]["acc,none"] <= 1.0
    True
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from glasslm.core.model import TransformerLM
from glasslm.generation import GenerationConfig, generate
from glasslm.runtime import keeps_global_rng
from glasslm.tokenizers import ENDOFTEXT, special_token_ids

try:
    from lm_eval.api.model import TemplateLM
except ImportError:  # the harness is an optional extra; `GlassLMEval` then explains how to get it
    TemplateLM = object  # type: ignore[assignment,misc]

EVAL_EXTRA_HINT = "lm-evaluation-harness is not installed: pip install lm-eval (in a glasslm checkout: pip install -e '.[eval]')"


def _require_harness() -> None:
    if TemplateLM is object:
        raise ImportError(EVAL_EXTRA_HINT)


def special_id(tokenizer: Any, role: str) -> int | None:
    """The tokenizer's `role` ("bos"/"eos") id, else `<|endoftext|>`'s, else None."""
    found = special_token_ids(tokenizer).get(role)
    if found is not None:
        return found
    return (getattr(tokenizer, "special_tokens", None) or {}).get(ENDOFTEXT)


class GlassLMEval(TemplateLM):  # type: ignore[misc,valid-type]
    """A glasslm model and tokenizer as an lm-eval `LM` (scoring and greedy generation).

    `batch_size` rows go through the model at once; `max_gen_toks` caps generation where a
    task gives no `max_gen_toks` of its own.
    """

    def __init__(self, model: TransformerLM, tokenizer: Any, batch_size: int = 16, max_gen_toks: int = 256):
        _require_harness()
        super().__init__()
        self.model, self.tokenizer = model.eval(), tokenizer
        self.batch_size, self.max_gen_toks = batch_size, max_gen_toks
        self.max_length = model.config.context_length
        self._device = next(model.parameters()).device
        self._eot = special_id(tokenizer, "eos")
        if self._eot is None:
            self._eot = 0  # a tokenizer with no end-of-text: lm-eval still needs a prefix for empty contexts
        self._prefix = special_id(tokenizer, "bos")

    @property
    def eot_token_id(self) -> int:
        return self._eot

    @property
    def prefix_token_id(self) -> int:
        return self._eot if self._prefix is None else self._prefix

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **_: Any) -> list[int]:
        return list(self.tokenizer.encode(string))

    def tok_decode(self, tokens: Sequence[int], **_: Any) -> str:
        return self.tokenizer.decode(list(tokens))

    def _loglikelihood_tokens(self, requests: list, disable_tqdm: bool = False, **_: Any) -> list[tuple[float, bool]]:
        """(sum of log p(continuation), whether greedy decoding gives it) for each
        (key, context_ids, continuation_ids) request."""
        scored: list[tuple[float, bool]] = []
        for batch in _batches(requests, self.batch_size):
            scored.extend(self._score_batch([(ctx, cont) for _, ctx, cont in batch]))
        return scored

    @torch.no_grad()
    def _score_batch(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        # The model sees context + continuation minus its last token, cut to the context length
        # from the left (as lm-eval's HF model does); the last len(continuation) positions score it.
        rows = [(list(ctx) + list(cont))[-(self.max_length + 1):][:-1] for ctx, cont in pairs]
        ids = _right_padded(rows, self._device)                                   # (batch, seq)
        log_probs = F.log_softmax(self.model(ids).float(), dim=-1)              # (batch, seq, vocab)
        results = []
        for row, (_, cont), row_log_probs in zip(rows, pairs, log_probs):
            positions = range(len(row) - len(cont), len(row))
            target = torch.tensor(cont, device=self._device)                     # (n_cont,)
            picked = row_log_probs[list(positions)]                             # (n_cont, vocab)
            total = picked.gather(1, target[:, None]).sum().item()
            results.append((total, bool((picked.argmax(-1) == target).all())))
        return results

    def loglikelihood_rolling(self, requests: list, disable_tqdm: bool = False) -> list[float]:
        """Each document's total log-likelihood over disjoint rolling windows of the full context."""
        from lm_eval import utils

        totals = []
        for (text,) in (request.args for request in requests):
            windows = [utils.make_disjoint_window(w) for w in utils.get_rolling_token_windows(
                token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length, context_len=1)]
            scores = self._loglikelihood_tokens([(None, ctx, cont) for ctx, cont in windows])
            totals.append(sum(score for score, _ in scores))
        return totals

    def generate_until(self, requests: list, disable_tqdm: bool = False) -> list[str]:
        """Greedy continuations, cut before the first of each request's `until` strings."""
        answers: list[str] = []
        for batch in _batches(requests, self.batch_size):
            answers.extend(self._generate_batch(batch))
        return answers

    def _generate_batch(self, batch: list) -> list[str]:
        answers = []
        for context, options in (request.args for request in batch):
            until = options.get("until") or []
            stops = [until] if isinstance(until, str) else list(until)
            new_tokens = int(options.get("max_gen_toks", self.max_gen_toks))
            prompt = self.tok_encode(context)[-max(1, self.max_length - new_tokens):] or [self.prefix_token_id]
            config = GenerationConfig(max_new_tokens=new_tokens, temperature=0.0, stop_strings=stops,
                                      stop_tokens=(self.eot_token_id,))
            answers.append(generate(self.model, [prompt], config, tokenizer=self.tokenizer)[0].text or "")
        return answers


def _batches(items: list, size: int) -> Iterator[list]:
    for start in range(0, len(items), size):
        yield items[start:start + size]


def _right_padded(rows: list[list[int]], device: torch.device) -> Tensor:
    # Padding on the right leaves every real position's logits unchanged under the causal mask.
    width = max(len(row) for row in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long, device=device)   # (batch, seq)
    for i, row in enumerate(rows):
        ids[i, :len(row)] = torch.tensor(row, dtype=torch.long)
    return ids


@keeps_global_rng
def evaluate_tasks(
    model: TransformerLM, tokenizer: Any, tasks: Sequence[str], *, include_path: str | os.PathLike | None = None,
    num_fewshot: int | None = None, limit: int | None = None, batch_size: int = 16, seed: int = 1234,
    log_samples: bool = False,
) -> dict[str, Any]:
    """lm-eval's results dictionary for `tasks` run on `model` (task YAMLs under `include_path` too)."""
    _require_harness()
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=str(include_path) if include_path else None)
    unknown = [name for name in tasks if name not in manager.all_tasks]
    if unknown:
        raise ValueError(f"unknown lm-eval task(s): {', '.join(unknown)} (see `lm_eval ls tasks`; "
                         "local task YAMLs go under --include-path)")
    return simple_evaluate(model=GlassLMEval(model, tokenizer, batch_size=batch_size), tasks=list(tasks),
                           task_manager=manager, num_fewshot=num_fewshot, limit=limit, random_seed=seed,
                           numpy_random_seed=seed, torch_random_seed=seed, fewshot_random_seed=seed,
                           log_samples=log_samples)


def results_table(results: dict[str, Any]) -> str:
    """lm-eval's own Markdown table of `evaluate_tasks` results."""
    from lm_eval.utils import make_table

    return make_table(results)
