"""A glasslm model and its tokenizer behind TransformerLens's model interface: what a TransformerLens
user types after `HookedTransformer.from_pretrained(...)` works on `HookedModel.load(path)`.

* calling it: `model("text", return_type="loss")`, `model(tokens, stop_at_layer=2)`
  (`return_type` "logits", "loss", "both", None; `loss_per_token`; `prepend_bos`);
* `run_with_cache`, `run_with_hooks`, `hooks` (`glasslm.interp.hooks`), a text input included;
* `to_tokens`, `to_str_tokens`, `to_string`, `to_single_token` (`glasslm.interp.tokens`);
* the stacked weights `W_E`, `W_pos`, `W_Q`, `W_K`, `W_V`, `W_O`, `W_in`, `W_gate`, `W_out`, `W_U` and
  biases `b_Q` ... `b_U`, and the circuits `OV`, `QK` as `FactoredMatrix`es (`glasslm.interp.params`);
* everything else (`blocks`, `config`, `embed`, `named_modules`, `eval`, ...) is the wrapped
  `TransformerLM`'s, so the hook names are its own (`blocks.0.attn.hook_pattern`) and the functions
  of `glasslm.interp` take a HookedModel wherever they take a model.

Example:
    >>> import torch
    >>> from glasslm.core.model import TransformerLM
    >>> from glasslm.presets import get_preset
    >>> from glasslm.tokenizers import CharTokenizer
    >>> tok = CharTokenizer.from_text("to be or not")
    >>> torch.manual_seed(0) and None
    >>> model = HookedModel(TransformerLM(get_preset("shakespeare-char-cpu", vocab_size=tok.vocab_size, n_layers=2)).eval(), tok)
    >>> model.to_str_tokens("to be")  # a Qwen3-shaped model: no bos first, as TransformerLens's Qwen3 adapter
    ['t', 'o', ' ', 'b', 'e']
    >>> model.to_str_tokens("to be", prepend_bos=True)  # the tokenizer's bos
    ['<|endoftext|>', 't', 'o', ' ', 'b', 'e']
    >>> logits, cache = model.run_with_cache("to be", remove_batch_dim=True)
    >>> cache["resid_post", 1].shape  # (seq, d_model): the batch axis removed
    torch.Size([5, 128])
    >>> bool(model("to be or not", return_type="loss") > 0)
    True
    >>> model.OV[1, 0].S.shape  # layer 1, head 0: d_head singular values
    torch.Size([32])
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch
from jaxtyping import Int
from torch import Tensor, nn

from glasslm.hf import load_model
from glasslm.interp import hooks as _hooks
from glasslm.interp import params
from glasslm.interp.tokens import to_str_tokens, to_string, to_tokens

# TransformerLens's per-family `cfg.default_prepend_bos` (its model_bridge/supported_architectures adapters):
# Qwen2, Qwen3 and GPT-NeoX set it False, the other families glasslm converts (GPT-2, Llama, Mistral,
# Gemma 3) keep TransformerLens's default, True. A model of no Hugging Face family gets True as well.
NO_BOS_FAMILIES = frozenset({"qwen2", "qwen3", "gpt_neox"})

_STACKED = ("W_E", "W_pos", "W_Q", "W_K", "W_V", "W_O", "W_in", "W_gate", "W_out", "W_U",
            "b_Q", "b_K", "b_V", "b_O", "b_in", "b_out", "b_U", "OV", "QK")


class HookedModel:
    """`model` (a TransformerLM) with `tokenizer`, answering TransformerLens's names."""

    def __init__(self, model: nn.Module, tokenizer: Any = None):
        self.model, self.tokenizer = model, tokenizer
        self.default_prepend_bos = default_prepend_bos(model)  # TransformerLens's cfg.default_prepend_bos

    @classmethod
    def load(cls, path: str | os.PathLike, device: torch.device | str = "cpu",
             dtype: torch.dtype | None = None) -> "HookedModel":
        """A glasslm checkpoint, run directory or HF model directory, with its tokenizer (`glasslm.load_model`)."""
        model, tokenizer = load_model(path, device, dtype)
        return cls(model, tokenizer)

    def __getattr__(self, name: str) -> Any:
        if name in ("model", "tokenizer"):  # not set yet (copying, unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.model, name)

    def __call__(self, tokens: Int[Tensor, "batch seq"] | str | Sequence[str], return_type: str | None = "logits",
                 stop_at_layer: int | None = None, prepend_bos: bool | None = None, loss_per_token: bool = False,
                 **forward_kwargs) -> Any:
        return _hooks.run_with_hooks(self.model, tokens, (), return_type, stop_at_layer, self.tokenizer,
                                     self._bos(prepend_bos), loss_per_token, **forward_kwargs)

    def run_with_cache(self, tokens: Int[Tensor, "batch seq"] | str | Sequence[str], *args, **kwargs) -> Any:
        kwargs["prepend_bos"] = self._bos(kwargs.get("prepend_bos"))
        return _hooks.run_with_cache(self.model, tokens, *args, **{"tokenizer": self.tokenizer, **kwargs})

    def run_with_hooks(self, tokens: Int[Tensor, "batch seq"] | str | Sequence[str], *args, **kwargs) -> Any:
        kwargs["prepend_bos"] = self._bos(kwargs.get("prepend_bos"))
        return _hooks.run_with_hooks(self.model, tokens, *args, **{"tokenizer": self.tokenizer, **kwargs})

    def hooks(self, fwd_hooks: Sequence[tuple]) -> Any:
        return _hooks.hooks(self.model, fwd_hooks)

    def to_tokens(self, text: str | Sequence[str], prepend_bos: bool | None = None,
                  truncate: bool = True) -> Int[Tensor, "batch seq"]:
        context = self.model.config.context_length if truncate else None
        return to_tokens(self._tokenizer(), text, self._bos(prepend_bos), context).to(self.model.embed.device)

    def to_str_tokens(self, tokens: str | Sequence[str] | Tensor, prepend_bos: bool | None = None) -> list:
        return to_str_tokens(self._tokenizer(), tokens, self._bos(prepend_bos))

    def _bos(self, prepend_bos: bool | None) -> bool:
        return self.default_prepend_bos if prepend_bos is None else prepend_bos

    def to_string(self, tokens: Tensor | Sequence[int]) -> str | list[str]:
        return to_string(self._tokenizer(), tokens)

    def to_single_token(self, text: str) -> int:
        """The id of a text that is exactly one token."""
        ids = self._tokenizer().encode(text)
        if len(ids) != 1:
            raise ValueError(f"{text!r} is {len(ids)} tokens, not one")
        return ids[0]

    def _tokenizer(self) -> Any:
        if self.tokenizer is None:
            raise ValueError("this HookedModel has no tokenizer: HookedModel(model, tokenizer)")
        return self.tokenizer

    def __repr__(self) -> str:
        return f"HookedModel({self.model.__class__.__name__}, tokenizer={type(self.tokenizer).__name__})"


def default_prepend_bos(model: nn.Module) -> bool:
    """Whether TransformerLens puts the bos before a text for a model of this one's family by default:
    False for Qwen2, Qwen3 and GPT-NeoX (their adapters say so), else True. The family is the one
    `glasslm convert --to-hf` writes for the config, the adapter TransformerLens would load it with."""
    from glasslm.hf.families import family_of

    try:
        return family_of(model.config) not in NO_BOS_FAMILIES
    except ValueError:  # no Hugging Face form (the post-norm Vaswani decoder): TransformerLens's default
        return True


# The stacked weights and circuits, each a read-only property computed from the model when read.
for _name in _STACKED:
    setattr(HookedModel, _name, property(lambda self, f=getattr(params, _name): f(self.model),
                                         doc=getattr(params, _name).__doc__))
del _name
