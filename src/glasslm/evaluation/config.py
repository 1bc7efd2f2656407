"""`EvalConfig`: how `evaluate_text` scores a text (the scoring options of `glasslm eval`).

Its fields are `evaluate_text`'s keywords, so a config passes straight through:

    >>> import dataclasses, torch
    >>> from glasslm.presets import get_preset
    >>> from glasslm.core.model import TransformerLM
    >>> from glasslm.tokenizers import CharTokenizer
    >>> from glasslm.evaluation.perplexity import evaluate_text
    >>> model = TransformerLM(get_preset("shakespeare-char-cpu", vocab_size=4, n_layers=1))
    >>> with torch.no_grad():
    ...     _ = model.ln_final.weight.zero_()  # every logit 0: a uniform guess over 4 tokens
    >>> config = EvalConfig(batch_size=2, max_tokens=6)
    >>> result = evaluate_text(model, CharTokenizer.from_text("abcd"), "abcdabcd", **dataclasses.asdict(config))
    >>> result["tokens"], round(result["perplexity"], 6)
    (6, 4.0)
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class EvalConfig:
    """how to score"""

    stride: int | None = field(default=None, metadata={"minimum": 1})  # tokens between window starts; none: the
                                                                       # context length, i.e. chunks
    batch_size: int = field(default=8, metadata={"minimum": 1})  # windows scored per forward pass
    max_tokens: int | None = field(default=None, metadata={"minimum": 1})  # score at most N tokens (from the
                                                                           # split's start); none: the whole split

    def __post_init__(self) -> None:
        for name in ("stride", "batch_size", "max_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
