"""Scoring a model on problems with checkable answers: the held-out measure of a GRPO run.

`score_problems` answers each problem greedily (temperature 0) through glasslm's batched KV-cache
decoding (`glasslm.generation.generate`, ragged prompts in one batch) and scores each answer with a
reward (glasslm.evaluation.rewards), the same function and the same text a GRPO run trains on: the
completion without its stop token, the last user message as the prompt. `glasslm eval --problems
FILE --reward exact_match` prints it, so a user scores held-out problems before and after
`glasslm finetune --method grpo`.

The result holds the mean reward, the share of problems whose reward is at least 1 (for
`exact_match`, the exact-match accuracy) and each problem's answer.

Example (a model that cannot answer scores 0; one whose answer is right would score 1):
    >>> from glasslm.core.model import TransformerLM
    >>> from glasslm.data.problems import Problem, encode_problem
    >>> from glasslm.presets import get_preset
    >>> from glasslm.tokenizers import CharTokenizer
    >>> from glasslm.tokenizers.chat import ChatFormat
    >>> from glasslm.evaluation.rewards import load_reward
    >>> tok = CharTokenizer.from_text("u:a;12+?")
    >>> chat = ChatFormat.for_tokenizer("{% for m in messages %}u:{{ m['content'] }};{% endfor %}a:", tok)
    >>> problems = [encode_problem(tok, chat, Problem([{"role": "user", "content": "1+1?"}], "2"))]
    >>> model = TransformerLM(get_preset("llama-tiny", vocab_size=tok.vocab_size, n_layers=1)).eval()
    >>> result = score_problems(model, tok, problems, load_reward("exact_match"), max_new_tokens=3)
    >>> result.count, len(result.answers[0].completion) <= 3, result.accuracy in (0.0, 1.0)
    (1, True, True)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from glasslm.core.model import TransformerLM
from glasslm.data.problems import EncodedProblem
from glasslm.evaluation.rewards import Reward, exact_match, score
from glasslm.generation import GenerationConfig, generate

__all__ = ["Answer", "ProblemScores", "check_answers", "prompt_text", "score_problems"]


@dataclass(frozen=True)
class Answer:
    """One problem's greedy answer (text, stop token left out) and its reward."""

    prompt: str
    completion: str
    expected: str | None
    reward: float


@dataclass(frozen=True)
class ProblemScores:
    """What `score_problems` measured: the answers, their mean reward and the share solved."""

    answers: list[Answer]

    @property
    def count(self) -> int:
        return len(self.answers)

    @property
    def mean_reward(self) -> float:
        return sum(a.reward for a in self.answers) / max(1, self.count)

    @property
    def accuracy(self) -> float:
        """The share of problems whose reward reached 1 (exact_match: answered exactly)."""
        return sum(a.reward >= 1.0 for a in self.answers) / max(1, self.count)


def prompt_text(problem: EncodedProblem) -> str:
    """What a reward is given as the prompt: the last user message's text (training's choice too)."""
    return problem.problem.prompt[-1].get("content") or ""


@torch.no_grad()
def score_problems(model: TransformerLM, tokenizer: Any, problems: Sequence[EncodedProblem], reward: Reward,
                   max_new_tokens: int = 32, batch_size: int = 16) -> ProblemScores:
    """Greedy answers to `problems`, `batch_size` at a time, each scored by `reward`."""
    if not problems:
        raise ValueError("no problems to score")
    if max_new_tokens < 1 or batch_size < 1:
        raise ValueError(f"max_new_tokens and batch_size must be at least 1, got {max_new_tokens} and {batch_size}")
    training = model.training
    model.eval()
    config = GenerationConfig(max_new_tokens=max_new_tokens, temperature=0.0)
    answers: list[Answer] = []
    try:
        for start in range(0, len(problems), batch_size):
            batch = problems[start:start + batch_size]
            generations = generate(model, [p.prompt_ids for p in batch], config, tokenizer=tokenizer)
            for problem, generation in zip(batch, generations):
                text = tokenizer.decode(generation.tokens)  # `generate` leaves the stop token out
                answers.append(Answer(prompt_text(problem), text, problem.problem.answer,
                                      score(reward, prompt_text(problem), text, problem.problem.answer)))
    finally:
        model.train(training)
    return ProblemScores(answers)


def check_answers(problems: Sequence[EncodedProblem], spec: str, reward: Reward, where: str) -> None:
    """Refuse, before any answer is written, problems without an answer for a reward that compares
    with one (exact_match; a reward of your own that takes `answer` decides for itself)."""
    if reward is exact_match:
        missing = [i for i, p in enumerate(problems, 1) if p.problem.answer is None]
        if missing:
            raise ValueError(f"{where}: {len(missing)} of {len(problems)} problems have no 'answer' field (the first: "
                             f"problem {missing[0]}); --reward {spec} compares each answer with it")
