"""Text generation: sampling controls, the KV-cache decoding loop, streaming text.

Three modules, one job each; this one gathers their public names so `glasslm.generation` stays the
place to import them from:

- `glasslm.generation.sampling`: `GenerationConfig` and picking a token (penalty, temperature, top-k/p, min-p);
- `glasslm.generation.decoding`: prefill + one token per step with a KV cache, ragged batches (`generate`,
  `generate_tokens`, `decode_steps`, `optimize_for_decoding`);
- `glasslm.generation.streaming`: UTF-8-safe text streaming and stop strings (`TextStreamer`, `stream_text`,
  `generate_text`).

Example:
    >>> from glasslm.presets import get_preset
    >>> from glasslm.core.model import TransformerLM
    >>> model = TransformerLM(get_preset("llama-tiny")).eval()
    >>> out = list(generate_tokens(model, [1, 2, 3], max_new_tokens=4, temperature=0.0))
    >>> len(out)
    4
    >>> [g.finish_reason for g in generate(model, [[1, 2, 3], [4]], GenerationConfig(max_new_tokens=2))]
    ['length', 'length']
"""

from glasslm.generation.decoding import (
    Generation, Step, decode_steps, generate, generate_tokens, onednn_disabled, optimize_for_decoding,
)
from glasslm.generation.sampling import (
    GenerationConfig, Tokenizer, apply_repetition_penalty, filter_logits, find_stop, make_config, sample_next,
)
from glasslm.generation.streaming import REPLACEMENT_CHAR, TextStreamer, generate_text, settled_length, stream_text

__all__ = [
    "REPLACEMENT_CHAR", "Generation", "GenerationConfig", "Step", "TextStreamer", "Tokenizer",
    "apply_repetition_penalty", "decode_steps", "filter_logits", "find_stop", "generate", "generate_text",
    "generate_tokens", "make_config", "onednn_disabled", "optimize_for_decoding", "sample_next",
    "settled_length", "stream_text",
]
