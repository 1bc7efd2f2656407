"""Text generation: the public API of glasslm's decoding, from one prompt to a batching server's engine.

Import from here (`from glasslm.generation import generate`); the modules behind it each do one job:

- `sampling`: `GenerationConfig` (every control, checked) and picking a token from logits
  (repetition penalty, temperature, top-k, top-p, min-p: `sample_next`, `filter_logits`), never
  one of a padded embedding table's rows past the tokenizer (`with_vocab_limit`);
- `decoding`: prefill once into a KV cache, then one token per step, for ragged batches of prompts
  (`generate`, `generate_tokens`, `decode_steps`); `DecodeWindow` is that cache with its padding,
  positions and mask, whose rows can join and leave between steps; `optimize_for_decoding`;
- `streaming`: UTF-8-safe text as tokens arrive, and stop strings (`TextStreamer`, `stream_text`,
  `generate_text`);
- `speculative`: greedy speculative decoding with a small draft model (`speculative_tokens`);
- `engine`: continuous batching on a worker thread, for servers (`Engine`, `Job`, `Sampling`).

Every path gives each row what decoding it alone would give: the tests compare batched, ragged,
streamed, speculative and served outputs with `generate_tokens` of one prompt.

Example:
    >>> from glasslm.presets import get_preset
    >>> from glasslm.core.model import TransformerLM
    >>> from glasslm.tokenizers import CharTokenizer
    >>> model = TransformerLM(get_preset("llama-tiny")).eval()
    >>> greedy = list(generate_tokens(model, [1, 2, 3], max_new_tokens=4, temperature=0.0))
    >>> len(greedy)
    4
    >>> batch = generate(model, [[1, 2, 3], [4]], GenerationConfig(max_new_tokens=4, temperature=0.0))
    >>> batch[0].tokens == greedy, [g.finish_reason for g in batch]
    (True, ['length', 'length'])
    >>> tok = CharTokenizer.from_text("ab \\n")
    >>> small = TransformerLM(get_preset("shakespeare-char-cpu", vocab_size=tok.vocab_size, n_layers=1)).eval()
    >>> text = generate_text(small, tok, "ab", max_new_tokens=5, temperature=0.0)
    >>> isinstance(text, str)
    True
"""

from glasslm.generation.decoding import (
    DecodeWindow, Generation, Step, decode_steps, generate, generate_tokens, optimize_for_decoding,
)
from glasslm.generation.compiled import StaticDecodeWindow
from glasslm.generation.cpu import onednn_disabled
from glasslm.generation.engine import Engine, Job, Overloaded, Sampling, ShuttingDown
from glasslm.generation.sampling import (
    SMALLEST_TEMPERATURE, GenerationConfig, Tokenizer, apply_repetition_penalty, eos_ids, filter_logits, find_stop,
    make_config, sample_next, vocab_limit, with_eos, with_vocab_limit,
)
from glasslm.generation.speculative import SpeculativeStats, speculative_tokens
from glasslm.generation.streaming import (
    REPLACEMENT_CHAR, TextStreamer, encode_prompt, generate_text, settled_length, stream_text,
)

__all__ = [
    "REPLACEMENT_CHAR", "SMALLEST_TEMPERATURE", "DecodeWindow", "Engine", "Generation", "GenerationConfig", "Job",
    "Overloaded", "Sampling",
    "ShuttingDown", "SpeculativeStats", "StaticDecodeWindow", "Step", "TextStreamer", "Tokenizer", "apply_repetition_penalty",
    "decode_steps", "encode_prompt", "eos_ids", "filter_logits", "find_stop", "generate", "generate_text",
    "generate_tokens", "make_config", "onednn_disabled", "optimize_for_decoding", "sample_next", "settled_length",
    "speculative_tokens", "stream_text", "vocab_limit", "with_eos", "with_vocab_limit",
]
