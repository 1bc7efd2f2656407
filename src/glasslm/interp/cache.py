"""The activation cache: a mapping hook name -> tensor with TransformerLens's analysis methods.

`run_with_cache` returns an `ActivationCache`. It is a `dict` (so `cache["blocks.0.hook_resid_post"]`,
`in`, `.items()` all work), indexable by TransformerLens's short keys too (`cache["resid_pre", 0]`,
`cache["pattern", 1]`, `cache["result", 0, "attn"]`), and it has the methods a TransformerLens user
reaches for, with the same names, arguments and semantics: `accumulated_resid`, `decompose_resid`,
`stack_head_results`, `stack_neuron_results`, `apply_ln_to_stack`, `logit_attrs`,
`get_full_resid_decomposition`. Stacks are (components, batch, seq, d_model), components first.

`apply_ln=True` does what TransformerLens does: centre (LayerNorm only) and divide by the
cached `hook_scale` of the norm that reads the stream, *without* the norm's gain and bias — exact
after `glasslm.interp.weights.fold_ln`, which moves them into the next weights.

Example:
    >>> import torch
    >>> from glasslm.presets import get_preset
    >>> from glasslm.core.model import TransformerLM
    >>> from glasslm.interp.hooks import run_with_cache
    >>> torch.manual_seed(0) and None
    >>> model = TransformerLM(get_preset("shakespeare-char-cpu", n_layers=2)).eval()
    >>> logits, cache = run_with_cache(model, torch.tensor([[1, 2, 3, 4]]))
    >>> resid, labels = cache.accumulated_resid(return_labels=True)
    >>> labels
    ['0_pre', '1_pre', 'final_post']
    >>> heads = cache.stack_head_results(layer=-1)  # (layers * heads, batch, seq, d_model)
    >>> heads.shape
    torch.Size([8, 1, 4, 128])
    >>> cache["resid_pre", 1].shape
    torch.Size([1, 4, 128])
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from jaxtyping import Float, Int
from torch import Tensor, nn

PosSlice = None | int | tuple | slice | Sequence[int] | Tensor

# TransformerLens's short names -> where the hook point sits inside block i.
_BLOCK_KEYS = {"resid_pre", "resid_mid", "resid_post", "attn_out", "mlp_out", "attn_in", "q_input", "k_input",
               "v_input", "mlp_in"}
_ATTN_KEYS = {"q", "k", "v", "z", "rot_q", "rot_k", "attn_scores", "pattern", "result"}
_MLP_KEYS = {"pre", "post", "pre_linear"}


def act_name(name: str, layer: int | None = None, sublayer: str | None = None) -> str:
    """The full hook name for TransformerLens's short form (`utils.get_act_name`).

    Example:
        >>> act_name("pattern", 3), act_name("scale", 0, "ln1"), act_name("resid_post", 1)
        ('blocks.3.attn.hook_pattern', 'blocks.0.ln1.hook_scale', 'blocks.1.hook_resid_post')
    """
    if layer is None:
        return name if name.startswith(("hook_", "ln_final")) else f"hook_{name}"
    if sublayer is not None and sublayer.startswith("ln"):
        return f"blocks.{layer}.{sublayer}.hook_{name}"
    if name in _ATTN_KEYS:
        return f"blocks.{layer}.attn.hook_{name}"
    if name in _MLP_KEYS:
        return f"blocks.{layer}.mlp.hook_{name}"
    if name in _BLOCK_KEYS:
        return f"blocks.{layer}.hook_{name}"
    raise KeyError(f"unknown short hook name {name!r}")


def slice_positions(tensor: Tensor, pos_slice: PosSlice, dim: int = -2) -> Tensor:
    """TransformerLens's `Slice`: None keeps all, an int picks one (dropping the axis), a tuple is
    `slice(*tuple)`, a slice is itself, a list or tensor of indices selects those."""
    if pos_slice is None:
        return tensor
    if isinstance(pos_slice, int):
        return tensor.select(dim, pos_slice)
    if isinstance(pos_slice, tuple):
        pos_slice = slice(*pos_slice)
    if isinstance(pos_slice, slice):
        index = [slice(None)] * tensor.dim()
        index[dim] = pos_slice
        return tensor[tuple(index)]
    return tensor.index_select(dim, torch.as_tensor(pos_slice, device=tensor.device))


class ActivationCache(dict):
    """{hook name: activation} from one forward pass, plus the model that made it (for its weights)."""

    def __init__(self, activations: dict[str, Tensor], model: nn.Module, has_batch_dim: bool = True):
        super().__init__(activations)
        self.model, self.has_batch_dim = model, has_batch_dim

    def remove_batch_dim(self) -> "ActivationCache":
        """Drop the batch axis of a one-example cache from every activation, in place (TransformerLens's)."""
        if self.has_batch_dim:
            sizes = {name: value.shape[0] for name, value in self.items() if value.shape[0] != 1}
            if sizes:
                raise ValueError(f"remove_batch_dim needs a batch of one; {next(iter(sizes))} has {next(iter(sizes.values()))}")
            for name, value in self.items():
                self[name] = value[0]
            self.has_batch_dim = False
        return self

    def to(self, device: torch.device | str) -> "ActivationCache":
        """Move every activation to `device`, in place; returns the cache (TransformerLens's `to`)."""
        for name, value in self.items():
            self[name] = value.to(device)
        return self

    def stack_activation(self, activation_name: str, layer: int = -1, sublayer_type: str | None = None,
                         ) -> Float[Tensor, "layers ..."]:
        """One activation of every layer before `layer` (-1: all), stacked: `stack_activation("pattern")`
        is (layers, batch, heads, query, key). Short names as `cache["pattern", 0]` takes them."""
        return torch.stack([self[activation_name, index, sublayer_type] for index in range(self._layer(layer))])

    def compute_head_results(self) -> None:
        """Fill in `blocks.{l}.attn.hook_result` (each head's z @ W_O, (batch, seq, heads, d_model)) where the
        run did not cache it, as TransformerLens's; `head_results` and `stack_head_results` then read it."""
        for layer in range(self.n_layers):
            self[f"blocks.{layer}.attn.hook_result"] = self._z_times_w_o(layer).detach()

    def __getitem__(self, key: str | tuple) -> Tensor:
        if isinstance(key, tuple):
            key = act_name(*key)
        return super().__getitem__(key)

    @property
    def n_layers(self) -> int:
        return len(self.model.blocks)

    def _layer(self, layer: int | None) -> int:
        return self.n_layers if layer is None or layer == -1 else layer

    def _embeddings(self) -> list[tuple[str, Tensor]]:
        """(label, stream contribution) of the token and position embeddings that are cached."""
        parts = []
        if "hook_embed" in self:
            embed = self["hook_embed"]  # after any sqrt(d_model) scaling: what the stream gets
            parts.append(("embed", embed))
            if "hook_pos_embed" in self:  # (seq, d_model) or (batch, seq, d_model): as wide as embed
                parts.append(("pos_embed", self["hook_pos_embed"].expand_as(embed)))
        return parts

    def accumulated_resid(self, layer: int | None = None, incl_mid: bool = False, apply_ln: bool = False,
                          pos_slice: PosSlice = None, mlp_input: bool = False, return_labels: bool = False):
        """The residual stream before each of layers 0..layer-1 and at `layer` ((components, ..., d_model)).

        `layer` None or -1 means the end ("final_post", the last resid_post); `incl_mid` adds each
        resid_mid; `mlp_input` adds layer's resid_mid (the MLP's input). With `apply_ln` at the end,
        the final norm is applied in full (as TransformerLens recomputes it); elsewhere the cached scale.
        """
        layer = self._layer(layer)
        parts: list[tuple[str, Tensor]] = []
        for index in range(layer + 1):
            if index == self.n_layers:
                parts.append(("final_post", self["resid_post", self.n_layers - 1]))
                continue
            parts.append((f"{index}_pre", self["resid_pre", index]))
            if (incl_mid and index < layer) or (mlp_input and index == layer):
                parts.append((f"{index}_mid", self["resid_mid", index]))
        stack = torch.stack([slice_positions(t, pos_slice) for _, t in parts])
        if apply_ln:
            stack = self.apply_ln_to_stack(stack, layer, mlp_input, pos_slice, recompute_ln=layer == self.n_layers)
        return (stack, [label for label, _ in parts]) if return_labels else stack

    def decompose_resid(self, layer: int | None = None, mlp_input: bool = False, mode: str = "all",
                        apply_ln: bool = False, pos_slice: PosSlice = None, incl_embeds: bool = True,
                        return_labels: bool = False):
        """The residual stream at `layer` split into the outputs that add up to it: embeddings, then
        each earlier layer's attn_out and mlp_out (`mode` "attn" or "mlp" keeps one kind)."""
        layer = self._layer(layer)
        parts = self._embeddings() if incl_embeds else []
        for index in range(layer):
            if mode != "mlp":
                parts.append((f"{index}_attn_out", self["attn_out", index]))
            if mode != "attn" and self.model.blocks[index].mlp is not None:  # attention-only blocks have none
                parts.append((f"{index}_mlp_out", self["mlp_out", index]))
        if mlp_input and mode != "mlp":
            parts.append((f"{layer}_attn_out", self["attn_out", layer]))
        stack = torch.stack([slice_positions(t, pos_slice) for _, t in parts])
        if apply_ln:
            stack = self.apply_ln_to_stack(stack, layer, mlp_input, pos_slice)
        return (stack, [label for label, _ in parts]) if return_labels else stack

    def through_post_norm(self, layer: int, sublayer: str, part: Float[Tensor, "*batch seq parts d_model"],
                          pos_slice: PosSlice = None) -> Float[Tensor, "*batch seq parts d_model"]:
        """What `part`s of a sublayer's output ("attn" or "mlp") add to the stream through its post-norm
        (Gemma 3's sandwich): centred (LayerNorm), divided by the norm's *cached* hook_scale, times its gain.
        Linear in the parts, so they still add up to hook_attn_out / hook_mlp_out. Without a post-norm: `part`.
        `pos_slice` is the one `part` was already sliced with."""
        norm = getattr(self.model.blocks[layer], "ln1_post" if sublayer == "attn" else "ln2_post", None)
        if norm is None:
            return part
        name = f"blocks.{layer}.{'ln1_post' if sublayer == 'attn' else 'ln2_post'}.hook_scale"
        if name not in self:
            raise KeyError(f"a sublayer's parts pass its post-norm: run_with_cache with {name!r} in names_filter")
        if hasattr(norm, "bias"):  # LayerNorm
            part = part - part.mean(dim=-1, keepdim=True)
        scale = slice_positions(self[name], pos_slice).unsqueeze(-1)  # (*batch, seq, 1, 1): one divisor per position
        gain = 1.0 + norm.weight.float() if getattr(norm, "unit_offset", False) else norm.weight.float()
        return (part.float() / scale.float() * gain).to(part.dtype)

    def head_results(self, layer: int) -> Float[Tensor, "*batch seq heads d_model"]:
        """Each head's output written to the stream (no out bias): hook_result, or hook_z @ W_O, then
        through the post-norm's cached scale where the block has one (`through_post_norm`)."""
        return self.through_post_norm(layer, "attn", self._z_times_w_o(layer))

    def _z_times_w_o(self, layer: int) -> Float[Tensor, "*batch seq heads d_model"]:
        """Each head's z_h @ W_O[h]: the cached hook_result, or computed from the cached hook_z."""
        name = f"blocks.{layer}.attn.hook_result"
        if name in self:
            return self[name]
        attn, z = self.model.blocks[layer].attn, self["z", layer]
        w_o = attn.out.weight.view(-1, attn.n_heads, attn.d_head)  # (d_model, heads, d_head)
        return torch.einsum("...she,dhe->...shd", z, w_o.to(z.dtype))

    def stack_head_results(self, layer: int = -1, return_labels: bool = False, incl_remainder: bool = False,
                           pos_slice: PosSlice = None, apply_ln: bool = False):
        """Every head of layers 0..layer-1 as its own component: (layer * heads, batch, seq, d_model),
        labels "L{l}H{h}"; `incl_remainder` adds what the heads leave of resid_post[layer - 1]."""
        layer = self._layer(layer)
        heads = [slice_positions(self.head_results(index), pos_slice, dim=-3) for index in range(layer)]
        labels = [f"L{index}H{h}" for index in range(layer) for h in range(self.model.blocks[index].attn.n_heads)]
        if heads:
            stack = torch.cat(heads, dim=-2).movedim(-2, 0)  # (components, ..., d_model)
        else:
            stack = slice_positions(self["hook_embed"], pos_slice).new_zeros(0, *slice_positions(
                self["hook_embed"], pos_slice).shape)
        if incl_remainder:
            remainder = slice_positions(self["resid_post", layer - 1], pos_slice) - stack.sum(dim=0)
            stack, labels = torch.cat([stack, remainder[None]]), [*labels, "remainder"]
        if apply_ln:
            stack = self.apply_ln_to_stack(stack, layer, pos_slice=pos_slice)
        return (stack, labels) if return_labels else stack

    def neuron_results(self, layer: int, pos_slice: PosSlice = None) -> Float[Tensor, "*batch seq d_mlp d_model"]:
        """Each MLP neuron's write to the stream: activation x its row of W_out (no out bias), through
        the post-norm's cached scale where the block has one."""
        post = slice_positions(self["post", layer, "mlp"], pos_slice)  # (batch, seq, d_mlp)
        w_out = self.model.blocks[layer].mlp.down.weight.T  # (d_mlp, d_model)
        return self.through_post_norm(layer, "mlp", post[..., None] * w_out.to(post.dtype), pos_slice)

    def stack_neuron_results(self, layer: int, pos_slice: PosSlice = None, return_labels: bool = False,
                             incl_remainder: bool = False, apply_ln: bool = False, mlp_input: bool = False):
        """Every MLP neuron of layers 0..layer-1 as its own component: (layer * d_mlp, ..., d_model), "L{l}N{n}"."""
        layer = self._layer(layer)
        stack = torch.cat([self.neuron_results(index, pos_slice) for index in range(layer)], dim=-2).movedim(-2, 0)
        labels = [f"L{index}N{n}" for index in range(layer) for n in range(self.model.config.d_mlp)]
        if incl_remainder:
            target = self["resid_mid", layer] if mlp_input else self["resid_post", layer - 1]
            remainder = slice_positions(target, pos_slice) - stack.sum(dim=0)
            stack, labels = torch.cat([stack, remainder[None]]), [*labels, "remainder"]
        if apply_ln:
            stack = self.apply_ln_to_stack(stack, layer, mlp_input, pos_slice)
        return (stack, labels) if return_labels else stack

    def apply_ln_to_stack(self, residual_stack: Float[Tensor, "components *batch_pos d_model"],
                          layer: int | None = None, mlp_input: bool = False, pos_slice: PosSlice = None,
                          batch_slice: PosSlice = None, has_batch_dim: bool | None = None, recompute_ln: bool = False):
        """Normalise each component by the norm that reads the stream at `layer` (ln1, ln2 with
        `mlp_input`, ln_final at the end): centre (LayerNorm) and divide by the *cached* hook_scale,
        so the components still add up to the normalised stream. No gain or bias (fold_ln them)."""
        layer = self._layer(layer)
        has_batch_dim = self.has_batch_dim if has_batch_dim is None else has_batch_dim
        if has_batch_dim and batch_slice is not None:
            residual_stack = slice_positions(residual_stack, batch_slice, dim=1)
        norm = self.model.ln_final if layer == self.n_layers else getattr(self.model.blocks[layer],
                                                                          "ln2" if mlp_input else "ln1")
        if norm is None:
            return residual_stack
        if recompute_ln and layer == self.n_layers:
            return torch.stack([norm(component) for component in residual_stack])
        if not hasattr(norm, "bias"):  # RMSNorm: no centring
            centred = residual_stack
        else:
            centred = residual_stack - residual_stack.mean(dim=-1, keepdim=True)
        name = "ln_final.hook_scale" if layer == self.n_layers else act_name("scale", layer, "ln2" if mlp_input else "ln1")
        if name not in self:
            raise KeyError(f"apply_ln needs {name!r} in the cache: run_with_cache with it in names_filter")
        scale = slice_positions(self[name], pos_slice)
        if has_batch_dim and batch_slice is not None:
            scale = slice_positions(scale, batch_slice, dim=0)
        return centred / scale

    def unembed_directions(self, tokens: int | Int[Tensor, "..."]) -> Float[Tensor, "... d_model"]:
        """The unembedding column of each token, i.e. W_U[:, tokens].T (TL's tokens_to_residual_directions)."""
        model = self.model
        w_u = model.embed.weight if model.unembed is None else model.unembed.weight  # (vocab, d_model)
        return w_u[torch.as_tensor(tokens, device=w_u.device)]

    def logit_attrs(self, residual_stack: Float[Tensor, "components *batch_pos d_model"], tokens: int | Tensor,
                    incorrect_tokens: int | Tensor | None = None, pos_slice: PosSlice = None,
                    batch_slice: PosSlice = None, has_batch_dim: bool | None = None) -> Float[Tensor, "components *batch_pos"]:
        """Each component's direct contribution to the logit of `tokens` (minus `incorrect_tokens`'),
        after the final norm's cached scale: (apply_ln_to_stack(stack, -1) * W_U[:, tokens]).sum(-1)."""
        directions = self.unembed_directions(tokens)
        if incorrect_tokens is not None:
            if torch.as_tensor(tokens).shape != torch.as_tensor(incorrect_tokens).shape:
                raise ValueError("tokens and incorrect_tokens must have the same shape")
            directions = directions - self.unembed_directions(incorrect_tokens)
        scaled = self.apply_ln_to_stack(residual_stack, -1, pos_slice=pos_slice, batch_slice=batch_slice,
                                        has_batch_dim=has_batch_dim)
        if scaled.dim() == 4 and directions.dim() == 2 and directions.shape[0] == scaled.shape[1]:
            directions = directions.unsqueeze(-2)  # one token per example: broadcast over positions
        return (scaled * directions.to(scaled.dtype)).sum(dim=-1)

    def accumulated_bias(self, layer: int, mlp_input: bool = False, include_mlp_biases: bool = True) -> Tensor:
        """The sum of the out biases written to the stream before `layer` (and layer's attention's with
        `mlp_input`): (d_model,), or per position (*batch, seq, d_model) where post-norms rescale them."""
        total = torch.zeros(self.model.config.d_model, device=self.model.embed.device)
        for index in range(layer + (1 if mlp_input else 0)):
            block = self.model.blocks[index]
            total = total + self._written_bias(index, "attn", block.attn.out.bias)
            if include_mlp_biases and index < layer and block.mlp is not None:
                total = total + self._written_bias(index, "mlp", block.mlp.down.bias)
        return total

    def _written_bias(self, layer: int, sublayer: str, bias: Tensor | None) -> Tensor:
        """A sublayer's out bias as the stream gets it: through its post-norm (whose own shift it adds)."""
        block = self.model.blocks[layer]
        norm = getattr(block, "ln1_post" if sublayer == "attn" else "ln2_post", None)
        bias = torch.zeros(self.model.config.d_model, device=self.model.embed.device) if bias is None else bias
        if norm is None:
            return bias
        written = self.through_post_norm(layer, sublayer, bias[None, :].detach())[..., 0, :]  # (*batch, seq, d_model)
        return written if getattr(norm, "bias", None) is None else written + norm.bias

    def get_full_resid_decomposition(self, layer: int | None = None, mlp_input: bool = False,
                                     expand_neurons: bool = True, apply_ln: bool = False,
                                     pos_slice: PosSlice = None, return_labels: bool = False):
        """The stream at `layer` as every head, every neuron (or each mlp_out), the embeddings and the
        biases: components that add up exactly to the stream, labelled as TransformerLens labels them."""
        layer = self._layer(layer)
        stack, labels = self.stack_head_results(layer + (1 if mlp_input else 0), pos_slice=pos_slice,
                                                return_labels=True)
        parts = [stack]
        if layer > 0 and any(self.model.blocks[index].mlp is not None for index in range(layer)):
            if expand_neurons:
                mlp, mlp_labels = self.stack_neuron_results(layer, pos_slice=pos_slice, return_labels=True)
            else:
                mlp, mlp_labels = self.decompose_resid(layer, pos_slice=pos_slice, incl_embeds=False,
                                                       mode="mlp", return_labels=True)
            parts.append(mlp)
            labels = [*labels, *mlp_labels]
        for label, embedding in self._embeddings():
            parts.append(slice_positions(embedding, pos_slice)[None])
            labels = [*labels, label]
        bias = self.accumulated_bias(layer, mlp_input, include_mlp_biases=expand_neurons)
        if bias.dim() > 1:  # per position (post-norms)
            bias = slice_positions(bias, pos_slice)
        parts.append(bias.to(stack.dtype).expand(stack.shape[1:])[None])
        stack = torch.cat(parts)
        if apply_ln:
            stack = self.apply_ln_to_stack(stack, layer, mlp_input, pos_slice)
        return (stack, [*labels, "bias"]) if return_labels else stack
