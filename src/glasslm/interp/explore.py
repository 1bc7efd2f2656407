"""The numbers behind the explorer page, as plain JSON-able dicts: next-token tables, per-token
loss, attention patterns, the logit lens, the experts each token chose (mixtures of experts), direct
logit attribution, head scores and activation patching for one short text.

Each function takes token ids (a list, at most the model's context length) and returns lists and
floats, so the server only has to encode the request and send the result. The work is done by
glasslm's own tools: `inspection.attention_pattern` and `inspection.logit_lens_top` (both on
`hooks.run_with_cache`), `generate.filter_logits`, the activation cache's `logit_attrs`, the head
scores of `interp.attribution` and `interp.patching`, so the page shows exactly what the library
computes.

Example:
    >>> from glasslm.presets import get_preset
    >>> from glasslm.core.model import TransformerLM
    >>> from glasslm.tokenizers import CharTokenizer
    >>> tok = CharTokenizer.from_text("abc")
    >>> model = TransformerLM(get_preset("shakespeare-char-cpu", vocab_size=3, n_layers=2)).eval()
    >>> table = next_token(model, tok, tok.encode("abca"), temperature=0.0, k=3)
    >>> [round(sum(row["prob"] for row in table["top"]), 4), sum(row["adjusted"] for row in table["top"])]
    [1.0, 1.0]
    >>> len(logit_lens(model, tok, tok.encode("ab"))["layers"])  # one row per layer
    2
    >>> len(logit_attribution(model, tok, tok.encode("abca"))["heads"])  # (layers, heads)
    2
    >>> grid = activation_patching(model, tok, tok.encode("abca"), tok.encode("cbca"), answer=1, wrong_answer=2)
    >>> [round(v, 4) + 0.0 for v in grid["patched"][0]]  # layer 0: the changed token carries it all (+ 0.0: no -0.0)
    [1.0, 0.0, 0.0, 0.0]
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from glasslm.evaluation.perplexity import sliding_windows
from glasslm.generation import filter_logits
from glasslm.interp.attribution import (duplicate_token_score, duplicate_token_targets, induction_score,
                                        induction_targets, previous_token_score, previous_token_targets,
                                        repeated_random_tokens)
from glasslm.interp.hooks import run_with_cache
from glasslm.interp.inspection import attention_pattern, logit_lens_top
from glasslm.interp.patching import patch_attn_out, patch_mlp_out, patch_residual_stream
from glasslm.interp.weights import process_weights
from glasslm.core.model import TransformerLM
from glasslm.core.moe import MoE, route


def token_texts(tokenizer: Any, ids: Sequence[int]) -> list[str]:
    """Each token's own text (a byte-level piece of a character decodes to U+FFFD)."""
    return [tokenizer.decode([int(i)]) for i in ids]


def _tensor(model: TransformerLM, ids: Sequence[int], limit: int | None = None) -> Tensor:
    if not ids:
        raise ValueError("the text encodes to no tokens")
    if limit is None and len(ids) > model.config.context_length:
        raise ValueError(f"{len(ids)} tokens is more than the context length {model.config.context_length}")
    return torch.tensor([list(ids)], dtype=torch.long, device=model.embed.device)


def adjusted_probs(
    logits: Float[Tensor, "vocab"], temperature: float = 1.0, top_k: int | None = None,
    top_p: float | None = None, min_p: float | None = None,
) -> Float[Tensor, "vocab"]:
    """The distribution a token is drawn from under these controls (as `generate.sample_next` draws).

    Temperature 0 is greedy: all the mass on the argmax.

    >>> adjusted_probs(torch.tensor([0.0, 1.0, 0.0]), temperature=0.0)
    tensor([0., 1., 0.])
    """
    logits = logits.float()
    if temperature == 0.0:
        return torch.nn.functional.one_hot(logits.argmax(), logits.shape[-1]).float()
    filtered = filter_logits(logits[None] / temperature, top_k, top_p, min_p)[0]
    return torch.softmax(filtered, dim=-1)


@torch.no_grad()
def next_token(
    model: TransformerLM, tokenizer: Any, ids: Sequence[int], temperature: float = 1.0,
    top_k: int | None = None, top_p: float | None = None, min_p: float | None = None, k: int = 10,
) -> dict[str, Any]:
    """The k most likely next tokens after `ids`: the model's own probability (`prob`) and the
    probability under the sampling controls (`adjusted`), sorted by `prob`."""
    logits = model(_tensor(model, ids), last_logits_only=True)[0, -1].float()
    probs = torch.softmax(logits, dim=-1)
    adjusted = adjusted_probs(logits, temperature, top_k, top_p, min_p)
    top = probs.topk(min(k, probs.shape[-1]))
    entropy = float(-(probs * probs.clamp_min(1e-30).log()).sum())
    return {
        "tokens": list(map(int, ids)), "texts": token_texts(tokenizer, ids), "entropy": entropy,
        "kept": int((adjusted > 0).sum()),  # how many tokens the controls leave in play
        "top": [{"id": int(i), "text": tokenizer.decode([int(i)]), "prob": float(p), "adjusted": float(adjusted[i])}
                for p, i in zip(top.values, top.indices)],
    }


@torch.no_grad()
def token_loss(model: TransformerLM, tokenizer: Any, ids: Sequence[int]) -> dict[str, Any]:
    """-log p(token | the tokens before it) for every token after the first (the first has none).

    A text longer than the context is scored in windows that overlap by half a context
    (`evaluate.sliding_windows`), so every token keeps at least half a context of history.
    """
    tokens = _tensor(model, ids, limit=len(ids))[0]
    context = model.config.context_length
    losses = torch.empty(len(ids) - 1)
    for start, end, first in sliding_windows(len(ids), context, max(1, context // 2)):
        log_probs = torch.log_softmax(model(tokens[None, start:end])[0].float(), dim=-1)  # (end - start, vocab)
        targets = tokens[first:end + 1]
        rows = log_probs[first - start - 1:end - start]  # the positions that predict those targets
        losses[first - 1:end] = -rows.gather(-1, targets[:, None])[:, 0].cpu()
    loss_list: list[float | None] = [None, *map(float, losses)]
    mean = float(losses.mean()) if len(losses) else math.nan
    return {"tokens": list(map(int, ids)), "texts": token_texts(tokenizer, ids), "loss": loss_list,
            "mean_loss": None if math.isnan(mean) else mean}


def attention(model: TransformerLM, tokenizer: Any, ids: Sequence[int], layer: int,
              head: int | None = None) -> dict[str, Any]:
    """Attention probabilities of `layer` (rows: queries, columns: keys), for one head or all."""
    patterns = attention_pattern(model, _tensor(model, ids), layer).cpu()  # (heads, seq, seq)
    n_heads = patterns.shape[0]
    if head is not None and not 0 <= head < n_heads:
        raise ValueError(f"head {head} does not exist; layer {layer} has heads 0..{n_heads - 1}")
    chosen = patterns if head is None else patterns[head:head + 1]
    return {"tokens": list(map(int, ids)), "texts": token_texts(tokenizer, ids), "layer": layer,
            "head": head, "n_heads": n_heads, "patterns": chosen.tolist()}


def logit_lens(model: TransformerLM, tokenizer: Any, ids: Sequence[int]) -> dict[str, Any]:
    """For each layer and position, the top next token read from that layer's residual stream."""
    top_ids, top_probs = logit_lens_top(model, _tensor(model, ids))  # (layers, seq) each
    layers = [[{"id": int(i), "text": tokenizer.decode([int(i)]), "prob": float(p)}
               for i, p in zip(row_ids, row_probs)] for row_ids, row_probs in zip(top_ids, top_probs)]
    return {"tokens": list(map(int, ids)), "texts": token_texts(tokenizer, ids), "layers": layers}


@torch.no_grad()
def expert_choices(model: TransformerLM, tokenizer: Any, ids: Sequence[int]) -> dict[str, Any]:
    """For each mixture-of-experts layer and position, the experts its router chose (best first) and their
    weights: the layer's router logits (its `hook_router_logits`) routed as the layer routes them
    (`core.moe.route`: top-k of the softmax, renormalised if the layer does). A dense model has no layers here.
    """
    layers = [(i, m) for i, block in enumerate(model.blocks) for m in block.modules() if isinstance(m, MoE)]
    seen: dict[int, Tensor] = {}
    handles = [m.hook_router_logits.register_forward_hook(
        lambda module, args, out, i=i: seen.__setitem__(i, out.detach())) for i, m in layers]
    try:
        model(_tensor(model, ids))
    finally:
        for handle in handles:
            handle.remove()
    rows = []
    for i, m in layers:
        weights, experts = route(seen[i][0], m.k, m.renormalize)  # (seq, k) each
        rows.append({"layer": i, "experts": experts.tolist(), "weights": weights.tolist()})
    n_experts = layers[0][1].n_experts if layers else 0
    return {"tokens": list(map(int, ids)), "texts": token_texts(tokenizer, ids), "n_experts": n_experts,
            "layers": rows}


def processed_copy(model: TransformerLM) -> TransformerLM:
    """A copy of `model` with TransformerLens's default weight processing (`weights.process_weights`):
    same log-probs, and the final norm's gain and bias folded into the unembedding, so direct logit
    attributions add up to the logit (minus its mean over the vocabulary, minus the unembed bias)."""
    processed = copy.deepcopy(model)
    try:
        process_weights(processed)
    except (ValueError, AttributeError) as err:
        raise ValueError(f"logit attribution processes the weights as TransformerLens does (fold_ln, "
                         f"center_writing_weights, center_unembed, fold_value_biases); this model cannot be: {err}") from None
    return processed.eval()


def _attribution_hook(name: str) -> bool:
    return (name in ("hook_embed", "hook_pos_embed", "ln_final.hook_scale")
            or name.endswith(("attn.hook_z", "hook_mlp_out", "_post.hook_scale")))  # post-norms' divisors: Gemma 3


@torch.no_grad()
def logit_attribution(model: TransformerLM, tokenizer: Any, ids: Sequence[int], token: int | None = None,
                      k: int = 10) -> dict[str, Any]:
    """Direct logit attribution of the next token after `ids` (`token`, default the top prediction):
    each head's, MLP's, embedding's and the biases' direct share of its logit at the last position.

    Computed on `processed_copy(model)` as TransformerLens computes it on its default (processed)
    weights: `cache.get_full_resid_decomposition(expand_neurons=False)` then `cache.logit_attrs`. The
    `heads` (layers x heads), the `components` and `unembed_bias` add up to `logit_minus_mean`.
    """
    processed = processed_copy(model)
    logits, cache = run_with_cache(processed, _tensor(model, ids), names_filter=_attribution_hook)
    last = logits[0, -1].float()  # the processed unembedding is centred: these are logit - mean logit
    probs = torch.softmax(last, dim=-1)
    token = int(last.argmax()) if token is None else int(token)
    if not 0 <= token < last.shape[-1]:
        raise ValueError(f"token id {token} is outside [0, {last.shape[-1]})")
    stack, labels = cache.get_full_resid_decomposition(expand_neurons=False, pos_slice=-1, return_labels=True)
    attrs = cache.logit_attrs(stack, token, pos_slice=-1)[:, 0].float().cpu()  # (components,)
    n_layers, n_heads = len(processed.blocks), processed.config.n_heads
    bias = processed.unembed_bias
    top = probs.topk(min(k, probs.shape[-1]))

    def row(i: int) -> dict[str, Any]:
        return {"id": i, "text": tokenizer.decode([i]), "prob": float(probs[i]), "logit_minus_mean": float(last[i])}

    return {"tokens": list(map(int, ids)), "texts": token_texts(tokenizer, ids), "position": len(ids) - 1,
            "token": {**row(token), "rank": int((last > last[token]).sum())},
            "top": [row(int(i)) for i in top.indices],
            "heads": attrs[:n_layers * n_heads].view(n_layers, n_heads).tolist(),
            "components": [{"label": label, "value": float(value)}
                           for label, value in zip(labels[n_layers * n_heads:], attrs[n_layers * n_heads:])],
            "unembed_bias": 0.0 if bias is None else float(bias[token]),
            "logit_minus_mean": float(last[token])}


# The page's example texts; a tokenizer that cannot encode them gets texts made from its own vocabulary.
STANDARD_TEXTS = {"prompt": "ROMEO:\n", "loss_text": "First Citizen:\nBefore we proceed any further, hear me speak.",
                  "inspect_text": "To be, or not to be", "corrupted_text": "To be, or not to go",
                  "answer": ",", "wrong_answer": "!"}
VOCABULARY_PIECES = 8  # the repeated sequence of the vocabulary-made texts, in tokens


def _encoded(tokenizer: Any, text: str) -> list[int] | None:
    try:
        return list(tokenizer.encode(text))
    except (ValueError, KeyError):  # a character (or byte) the vocabulary lacks
        return None


def _texts_fit(tokenizer: Any, texts: dict[str, str], context_length: int) -> bool:
    """Whether every example encodes as the page uses it: the prompt leaves room to generate, the clean
    and corrupted texts pair up position by position, the answers are one token each, and different."""
    ids = {name: _encoded(tokenizer, text) for name, text in texts.items()}
    if not all(ids.values()):
        return False
    clean, corrupted = ids["inspect_text"], ids["corrupted_text"]
    return (len(ids["prompt"]) < context_length and len(clean) == len(corrupted) <= context_length
            and clean != corrupted and len(ids["answer"]) == len(ids["wrong_answer"]) == 1
            and ids["answer"] != ids["wrong_answer"])


def _vocabulary_pieces(tokenizer: Any, count: int, seed: int = 0) -> list[str]:
    """Texts of `count` tokens that each encode back to themselves alone: printable, no spaces, drawn in
    a seeded random order so the sequence they make looks like the study's repeated random tokens."""
    order = torch.randperm(tokenizer.vocab_size, generator=torch.Generator().manual_seed(seed)).tolist()
    pieces = []
    for i in order:
        text = tokenizer.decode([i])
        if text and text.isprintable() and not any(c.isspace() for c in text) and _encoded(tokenizer, text) == [i]:
            pieces.append(text)
            if len(pieces) == count:
                break
    return pieces


def page_defaults(tokenizer: Any, context_length: int) -> dict[str, Any]:
    """The explorer's example texts for this model: `STANDARD_TEXTS` where its tokenizer encodes them,
    else a repeated sequence of its own tokens (what an induction head completes): the inspected text
    is the sequence then all but its last token, whose next token (`answer`) is the one to copy, and
    the corrupted text replaces the first copy of the token before it, so nothing points at the answer.

    >>> from glasslm.tokenizers import CharTokenizer
    >>> page_defaults(CharTokenizer.from_text("".join(STANDARD_TEXTS.values())), 64)["from_vocabulary"]
    False
    >>> made = page_defaults(CharTokenizer(list("ABCDEFGHIJKLMNOP")), 48)
    >>> made["texts"]["inspect_text"], made["texts"]["corrupted_text"], made["texts"]["answer"]
    ('MKJGLINFMKJGLIN', 'MKJGLICFMKJGLIN', 'F')
    """
    if _texts_fit(tokenizer, STANDARD_TEXTS, context_length):
        return {"texts": dict(STANDARD_TEXTS), "from_vocabulary": False}
    n = min(VOCABULARY_PIECES, context_length // 2 - 1)
    pieces = _vocabulary_pieces(tokenizer, n + 1) if n >= 3 else []
    if len(pieces) == n + 1:
        sequence, spare = pieces[:n], pieces[n]
        texts = {"prompt": "".join(sequence + sequence[:2]), "loss_text": "".join(sequence * 3),
                 "inspect_text": "".join(sequence + sequence[:-1]),
                 "corrupted_text": "".join(sequence[:-2] + [spare] + sequence[-1:] + sequence[:-1]),
                 "answer": sequence[-1], "wrong_answer": spare}
        if _texts_fit(tokenizer, texts, context_length):
            return {"texts": texts, "from_vocabulary": True}
    return {"texts": dict(STANDARD_TEXTS), "from_vocabulary": False}  # the page then names what fails


HEAD_SCORES = {"previous_token": (previous_token_score, previous_token_targets),
               "duplicate_token": (duplicate_token_score, duplicate_token_targets),
               "induction": (induction_score, induction_targets)}
RANDOM_HALF, RANDOM_BATCH = 50, 10  # as ARENA's induction exercises: 50 random tokens repeated, 10 sequences


def _scores(model: TransformerLM, tokens: Tensor) -> dict[str, Any]:
    """Each head score (layers x heads), and how many queries it averages over (None when none has a target)."""
    result = {}
    for name, (score, targets) in HEAD_SCORES.items():
        queries = int(targets(tokens).any(dim=-1).sum())
        result[name] = {"scores": score(model, tokens).tolist() if queries else None, "queries": queries}
    return result


@torch.no_grad()
def head_scores(model: TransformerLM, tokenizer: Any, ids: Sequence[int], seed: int = 0) -> dict[str, Any]:
    """Previous-token, duplicate-token and induction score of every head (`interp.attribution`), on
    the text itself and on repeated random tokens (`repeated_random_tokens`, seeded), as TransformerLens
    and ARENA measure induction: min(50, context // 2) random tokens then the same again, 10 sequences."""
    tokens = _tensor(model, ids)
    half = min(RANDOM_HALF, model.config.context_length // 2)
    if half < 2:
        raise ValueError(f"a context of {model.config.context_length} tokens is too short for repeated random tokens")
    generator = torch.Generator().manual_seed(seed)
    repeated = repeated_random_tokens(model.config.vocab_size, half, RANDOM_BATCH, generator=generator)
    return {"tokens": list(map(int, ids)), "texts": token_texts(tokenizer, ids), "prompt": _scores(model, tokens),
            "repeated_random": {"half": half, "batch": RANDOM_BATCH, "seed": seed,
                                **_scores(model, repeated.to(tokens.device))}}


PATCHED_HOOKS = {"resid_pre": patch_residual_stream, "attn_out": patch_attn_out, "mlp_out": patch_mlp_out}


@torch.no_grad()
def activation_patching(model: TransformerLM, tokenizer: Any, clean_ids: Sequence[int], corrupted_ids: Sequence[int],
                        answer: int, wrong_answer: int, hook: str = "resid_pre") -> dict[str, Any]:
    """Patch `blocks.{layer}.hook_{hook}` at each (layer, position) from the clean run into the corrupted one.

    The metric is the logit difference answer - wrong_answer at the last position; `patched` is it
    normalised as TransformerLens and ARENA do, (patched - corrupted) / (clean - corrupted): 1 where
    the patch restores the clean run, 0 where it changes nothing (None when clean equals corrupted).
    """
    if len(clean_ids) != len(corrupted_ids):
        raise ValueError(f"the clean text is {len(clean_ids)} tokens and the corrupted {len(corrupted_ids)}; "
                         "patching pairs positions, so they must be as long")
    if hook not in PATCHED_HOOKS:
        raise ValueError(f"hook must be one of {sorted(PATCHED_HOOKS)}")
    clean, corrupted = _tensor(model, clean_ids), _tensor(model, corrupted_ids)

    def metric(logits: Float[Tensor, "1 seq vocab"]) -> Tensor:
        return logits[0, -1, answer].float() - logits[0, -1, wrong_answer].float()

    clean_value, corrupted_value = float(metric(model(clean))), float(metric(model(corrupted)))
    grid = PATCHED_HOOKS[hook](model, clean, corrupted, metric)  # (layers, seq)
    spread = clean_value - corrupted_value
    return {"tokens": list(map(int, clean_ids)), "texts": token_texts(tokenizer, clean_ids),
            "corrupted_tokens": list(map(int, corrupted_ids)), "corrupted_texts": token_texts(tokenizer, corrupted_ids),
            "answer": {"id": answer, "text": tokenizer.decode([answer])},
            "wrong_answer": {"id": wrong_answer, "text": tokenizer.decode([wrong_answer])}, "hook": hook,
            "clean_logit_diff": clean_value, "corrupted_logit_diff": corrupted_value, "logit_diff": grid.tolist(),
            "patched": ((grid - corrupted_value) / spread).tolist() if spread != 0 else None}
