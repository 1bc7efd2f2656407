"""The README.md model card an HF export carries.

Example:
    >>> from glasslm.core.model import TransformerLM
    >>> from glasslm.presets import get_preset
    >>> card = model_card(TransformerLM(get_preset("llama-tiny")), None, {"step": 100}, "llama")
    >>> "LlamaForCausalLM (llama)" in card, "| training steps | 100 |" in card
    (True, True)
"""

from __future__ import annotations

import re
from pathlib import PurePosixPath, PureWindowsPath
from typing import Any

from glasslm.core.model import TransformerLM
from glasslm.hf.families import FAMILIES

# meta.json / checkpoint_summary keys -> the card's labels, in the card's order.
_HISTORY = (("data", "training data"), ("converted_from", "converted from"), ("init_from", "fine-tuned from"),
            ("step", "training steps"), ("val_loss", "validation loss"))


def shareable(value: str) -> str:
    """A recorded source as a card may publish it: no absolute local path. A cached hub snapshot
    becomes its hub name; another absolute path, its last component; a "format:path" keeps its format.

    >>> shareable("/root/.cache/huggingface/hub/models--org--name/snapshots/0a1b")
    'org/name'
    >>> shareable("nanogpt:/home/me/out/ckpt.pt"), shareable("tinyshakespeare")
    ('nanogpt:ckpt.pt', 'tinyshakespeare')
    """
    prefix, _, rest = value.partition(":")
    if rest and not PurePosixPath(value).is_absolute() and re.fullmatch(r"[a-z0-9]+", prefix):
        return f"{prefix}:{shareable(rest)}"
    hub = re.search(r"/models--([^/]+)/snapshots/", value)
    if hub:
        return hub.group(1).replace("--", "/")
    if PurePosixPath(value).is_absolute() or PureWindowsPath(value).is_absolute():
        return PurePosixPath(value.replace("\\", "/")).name
    return value


def model_card(model: TransformerLM, tokenizer: Any | None, meta: dict[str, Any] | None, family: str) -> str:
    """A short README.md: architecture, size, tokenizer, training data, steps and val loss when known."""
    c, meta = model.config, meta or {}
    rows = [
        ("architecture", f"{FAMILIES[family].architecture} ({family}): {c.n_layers} layers, d_model {c.d_model}, "
                         f"{c.n_heads} heads ({c.n_kv_heads} key/value) of size {c.d_head}, d_mlp {c.d_mlp}"),
        ("parameters", f"{model.num_parameters():,}"),
        ("context length", f"{c.context_length}"),
        ("tokenizer", "none saved" if tokenizer is None
         else f"{getattr(tokenizer, 'kind', '?')}, {tokenizer.vocab_size:,} tokens"),
    ]
    for key, label in _HISTORY:
        if meta.get(key) is not None:
            value = meta[key]
            rows.append((label, f"{value:.4f}" if isinstance(value, float) else shareable(str(value))))
    table = "\n".join(f"| {k} | {v} |" for k, v in rows)
    return (f"---\nlibrary_name: transformers\ntags: [glasslm]\n---\n\n# glasslm model\n\n"
            f"Exported by glasslm. Load it with transformers:\n\n```python\n"
            f"from transformers import AutoModelForCausalLM, AutoTokenizer\n"
            f"model = AutoModelForCausalLM.from_pretrained(\"PATH\")\n"
            f"tokenizer = AutoTokenizer.from_pretrained(\"PATH\")\n```\n\n| | |\n|---|---|\n{table}\n")
