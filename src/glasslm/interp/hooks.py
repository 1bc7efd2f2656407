"""Read and edit activations inside a model, TransformerLens-style.

Every interesting activation passes through a `HookPoint` (an identity module), and its name is
its module path: `hook_embed`, `blocks.3.hook_resid_post`, `blocks.0.attn.hook_pattern`,
`ln_final.hook_normalized`, ... (`hook_names(model)` lists them all).

`run_with_cache` runs the model once and returns the activations you asked for; `run_with_hooks`
runs it with functions that may replace activations (ablations, patching). Hooks exist only
during the call, so an unhooked model pays nothing: no copies are made and attention keeps its
fused kernel unless you ask for the attention scores or pattern.

Example:
    >>> import torch
    >>> from glasslm.presets import get_preset
    >>> from glasslm.core.model import TransformerLM
    >>> model = TransformerLM(get_preset("llama-tiny")).eval()
    >>> tokens = torch.tensor([[1, 2, 3, 4]])
    >>> logits, cache = run_with_cache(model, tokens, names_filter=["blocks.0.attn.hook_pattern"])
    >>> cache["blocks.0.attn.hook_pattern"].shape  # (batch, heads, query, key)
    torch.Size([1, 8, 4, 4])
    >>> def zero_head_0(z, hook_name):
    ...     z = z.clone()
    ...     z[:, :, 0] = 0.0
    ...     return z
    >>> ablated = run_with_hooks(model, tokens, fwd_hooks=[("blocks.0.attn.hook_z", zero_head_0)])
    >>> bool((ablated != logits).any())
    True
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from jaxtyping import Float, Int
from torch import Tensor, nn

from glasslm.core.layers import HookPoint
from glasslm.interp.cache import ActivationCache
from glasslm.interp.tokens import to_tokens

HookFn = Callable[[Tensor, str], Tensor | None]
NamesFilter = None | str | Sequence[str] | Callable[[str], bool]
RETURN_TYPES = ("logits", "loss", "both", None)


def hook_points(model: nn.Module) -> dict[str, HookPoint]:
    """Every HookPoint in the model by name (its module path)."""
    return {name: module for name, module in model.named_modules() if isinstance(module, HookPoint)}


def hook_names(model: nn.Module) -> list[str]:
    """The names that `run_with_cache` and `run_with_hooks` accept, in forward order."""
    return list(hook_points(model))


def _select(points: dict[str, HookPoint], names_filter: NamesFilter) -> list[str]:
    if names_filter is None:
        return list(points)
    if callable(names_filter):
        return [name for name in points if names_filter(name)]
    wanted = [names_filter] if isinstance(names_filter, str) else list(names_filter)
    unknown = [name for name in wanted if name not in points]
    if unknown:
        raise KeyError(f"no hook point named {unknown}; see glasslm.interp.hooks.hook_names(model)")
    return wanted


@contextmanager
def hooks(model: nn.Module, fwd_hooks: Sequence[tuple[str | Callable[[str], bool], HookFn]]) -> Iterator[None]:
    """Attach `(name or name-predicate, fn)` forward hooks for the duration of a `with` block.

    `fn(activation, hook_name)` may return a tensor to replace the activation, or None to keep it.
    Hooks are removed on leaving the block, also when the forward pass raised.
    """
    points = hook_points(model)
    handles = []
    try:
        for name_or_filter, fn in fwd_hooks:
            for name in _select(points, name_or_filter):
                # Bind name now: a closure over the loop variable would see only the last name.
                def forward_hook(module, inputs, output, fn=fn, name=name):
                    return fn(output, name)
                handles.append(points[name].register_forward_hook(forward_hook))
        yield
    finally:
        for handle in handles:
            handle.remove()


class _StopForward(Exception):
    """Raised by the `stop_at_layer` hook to leave the forward pass with the residual stream."""

    def __init__(self, resid: Tensor):
        super().__init__()
        self.resid = resid


def _as_tokens(model: nn.Module, tokens: Tensor | str | Sequence[str], tokenizer: Any,
               prepend_bos: bool | None) -> Int[Tensor, "batch seq"]:
    """Token ids as they are, or a text (or texts) tokenized as TransformerLens's `to_tokens` does."""
    if isinstance(tokens, Tensor):
        return tokens
    tokenizer = tokenizer if tokenizer is not None else getattr(model, "tokenizer", None)
    if tokenizer is None:
        raise ValueError("a text input needs the model's tokenizer: pass tokenizer=..., or set model.tokenizer "
                         "once (glasslm.interp.hooked.HookedModel(model, tokenizer) carries it)")
    ids = to_tokens(tokenizer, tokens, prepend_bos, model.config.context_length)
    return ids.to(model.embed.device)


def _stop_hook(model: nn.Module, stop_at_layer: int) -> tuple[str, HookFn] | None:
    """(hook name, hook that ends the pass there), or None where the pass runs to the end (k = n_layers,
    as TransformerLens 4's bridge: no block k exists, so the usual output comes back)."""
    n_layers = len(model.blocks)
    layer = stop_at_layer + n_layers if stop_at_layer < 0 else stop_at_layer
    if not 0 <= layer <= n_layers:
        raise ValueError(f"stop_at_layer must be in [-{n_layers}, {n_layers}], got {stop_at_layer}")

    def stop(resid: Tensor, name: str) -> None:
        raise _StopForward(resid)

    # Block `layer` never starts: its stop hook runs before any other hook there, so none of them fire.
    return None if layer == n_layers else (f"blocks.{layer}.hook_resid_pre", stop)


def lm_loss(logits: Float[Tensor, "batch seq vocab"], tokens: Int[Tensor, "batch seq"],
            per_token: bool = False) -> Float[Tensor, ""] | Float[Tensor, "batch seq_minus_1"]:
    """Next-token cross-entropy of `tokens` under `logits` (TransformerLens's return_type="loss"):
    the mean over every position that has a next token, or each one's with `per_token`."""
    if tokens.shape[1] < 2:
        raise ValueError("the loss needs at least two tokens (a position and its next token)")
    log_probs = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    losses = -log_probs.gather(-1, tokens[:, 1:, None])[..., 0]  # (batch, seq - 1)
    return losses if per_token else losses.mean()


def _output(logits: Tensor, tokens: Tensor, return_type: str | None, loss_per_token: bool) -> Any:
    if return_type not in RETURN_TYPES:
        raise ValueError(f"return_type must be one of {RETURN_TYPES}, got {return_type!r}")
    if return_type == "logits":
        return logits
    if return_type is None:
        return None
    loss = lm_loss(logits, tokens, loss_per_token)
    return loss if return_type == "loss" else (logits, loss)


def _forward(model: nn.Module, tokens: Tensor, fwd_hooks: Sequence[tuple], return_type: str | None,
             stop_at_layer: int | None, loss_per_token: bool, forward_kwargs: dict) -> Any:
    """One forward pass with `fwd_hooks`; the output `return_type` asks for, or the stream at `stop_at_layer`."""
    stop = None if stop_at_layer is None else _stop_hook(model, stop_at_layer)
    fwd_hooks = [stop, *fwd_hooks] if stop is not None else list(fwd_hooks)
    with hooks(model, fwd_hooks):
        try:
            logits = model(tokens, **forward_kwargs)
        except _StopForward as stopped:
            return stopped.resid
    return _output(logits, tokens, return_type, loss_per_token)


def run_with_hooks(
    model: nn.Module, tokens: Int[Tensor, "batch seq"] | str | Sequence[str],
    fwd_hooks: Sequence[tuple[str | Callable[[str], bool], HookFn]] = (), return_type: str | None = "logits",
    stop_at_layer: int | None = None, tokenizer: Any = None, prepend_bos: bool | None = None,
    loss_per_token: bool = False, **forward_kwargs,
) -> Any:
    """`model(tokens)` with `fwd_hooks` attached for this one call, as TransformerLens's `run_with_hooks`.

    `tokens` may be a text or a list of texts, tokenized as `glasslm.interp.tokens.to_tokens` does (the
    bos first by default) with `tokenizer` (or `model.tokenizer`). `return_type`: "logits" (batch, seq,
    vocab), "loss" (the mean next-token cross-entropy; per position with `loss_per_token`), "both"
    (logits, loss) or None. `stop_at_layer` k runs the embeddings and blocks 0..k-1 only and returns the
    residual stream there (batch, seq, d_model); negative k counts from the end, and k = n_layers runs
    the whole model, as in TransformerLens 4.
    """
    ids = _as_tokens(model, tokens, tokenizer, prepend_bos)
    return _forward(model, ids, fwd_hooks, return_type, stop_at_layer, loss_per_token, forward_kwargs)


def run_with_cache(
    model: nn.Module, tokens: Int[Tensor, "batch seq"] | str | Sequence[str], names_filter: NamesFilter = None,
    fwd_hooks: Sequence[tuple[str | Callable[[str], bool], HookFn]] = (), return_type: str | None = "logits",
    stop_at_layer: int | None = None, remove_batch_dim: bool = False, tokenizer: Any = None,
    prepend_bos: bool | None = None, loss_per_token: bool = False, **forward_kwargs,
) -> tuple[Any, ActivationCache]:
    """(output, {hook name: activation}) for the activations chosen by `names_filter`.

    The cache is an `ActivationCache`: a dict with TransformerLens's analysis methods. The output and
    the inputs are `run_with_hooks`'s (`return_type`, `stop_at_layer`: then the cache holds what ran
    before the stop). `remove_batch_dim` drops the batch axis of a one-text run from every activation.

    `names_filter` is None (every hook point — note this includes the attention pattern, so the
    readable attention path runs), a name, a list of names, or a predicate on names. Cached
    tensors are detached views, not copies. `fwd_hooks` run first, so the cache sees their edits.

    Ask only for what you need: naming `hook_attn_scores` or `hook_pattern` makes that layer use
    the step-by-step attention (the fused kernel never forms the pattern).
    """
    ids = _as_tokens(model, tokens, tokenizer, prepend_bos)
    if remove_batch_dim and ids.shape[0] != 1:
        raise ValueError(f"remove_batch_dim needs a batch of one, got {ids.shape[0]}")
    cache: dict[str, Tensor] = {}

    def store(activation: Tensor, name: str) -> None:
        cache[name] = activation.detach()

    names = _select(hook_points(model), names_filter)
    output = _forward(model, ids, [*fwd_hooks, *((name, store) for name in names)], return_type, stop_at_layer,
                      loss_per_token, forward_kwargs)
    activations = ActivationCache(cache, model)
    return output, activations.remove_batch_dim() if remove_batch_dim else activations


def set_use_attn_result(model: nn.Module, on: bool) -> None:
    """Make each attention layer's per-head output pass through `attn.hook_result` (batch, seq, heads, d_model).

    Off by default (TransformerLens's `use_attn_result`): the per-head product is heads times wider.

    Example:
        >>> from glasslm.presets import get_preset
        >>> from glasslm.core.model import TransformerLM
        >>> model = TransformerLM(get_preset("llama-tiny", n_layers=1)).eval()
        >>> set_use_attn_result(model, True)
        >>> _, cache = run_with_cache(model, torch.tensor([[1, 2, 3]]), names_filter="blocks.0.attn.hook_result")
        >>> cache["blocks.0.attn.hook_result"].shape
        torch.Size([1, 3, 8, 128])
    """
    for block in model.blocks:
        block.attn.use_attn_result = on


def set_use_split_qkv_input(model: nn.Module, on: bool) -> None:
    """Give each head its own copy of the stream for q, k and v: `hook_q_input` / `hook_k_input` / `hook_v_input`
    (batch, seq, heads, d_model), for patching one head's query or key input alone. Pre-norm models only."""
    for block in model.blocks:
        block.use_split_qkv_input = on


def set_use_attn_in(model: nn.Module, on: bool) -> None:
    """One per-head copy of the stream for q, k and v together: `hook_attn_in` (batch, seq, heads, d_model)."""
    for block in model.blocks:
        block.use_attn_in = on


def set_use_hook_mlp_in(model: nn.Module, on: bool) -> None:
    """Route each MLP's input (the stream before ln2) through `hook_mlp_in`."""
    for block in model.blocks:
        block.use_hook_mlp_in = on


@torch.no_grad()
def logit_lens(
    model: nn.Module, tokens: Int[Tensor, "batch seq"]
) -> Float[Tensor, "layers batch seq vocab"]:
    """Log-probabilities from decoding each block's output directly: unembed(ln_final(resid_post)).

    The last layer's row equals the model's own log-softmax(logits).
    """
    names = [f"blocks.{i}.hook_resid_post" for i in range(len(model.blocks))]
    _, cache = run_with_cache(model, tokens, names_filter=names)
    resid = torch.stack([cache[name] for name in names])  # (layers, batch, seq, d_model)
    logits = unembed(model, resid)
    return torch.log_softmax(logits.float(), dim=-1)


def unembed(model: nn.Module, resid: Float[Tensor, "... d_model"]) -> Float[Tensor, "... vocab"]:
    """Apply the model's final norm (if any) and unembedding to residual-stream vectors."""
    return model.logits(resid)
