"""The induction-head study: a 2-layer attention-only model learns to copy repeated random tokens.

Each training sequence is random tokens followed by the same tokens again (the length varies from
step to step, so position alone cannot find the copy). The first half
cannot be predicted (loss stays near log(vocab)); the second half can, once a layer-0
previous-token head and a layer-1 induction head form the circuit (Olsson et al. 2022). The
study records, every `record_every` steps, the loss on each half and every head's induction score,
and at the end patches each head from a clean repeated sequence into a corrupted one.

Example:
    >>> study = run_induction_study(steps=4, record_every=2, batch=4)
    >>> sorted(study["history"][0])
    ['first_half_loss', 'induction_scores', 'repeated_half_loss', 'step']
"""

from __future__ import annotations

import torch
from jaxtyping import Float, Int
from torch import Tensor, nn

from glasslm.core.layers import cross_entropy
from glasslm.core.model import TransformerLM
from glasslm.interp.attribution import induction_score, previous_token_score, repeated_random_tokens
from glasslm.interp.patching import patch_heads
from glasslm.io.checkpoint import save_checkpoint
from glasslm.locations import check_output_dir
from glasslm.presets import get_preset, lookup_preset
from glasslm.tokenizers import CharTokenizer

PRESET = "induction-attn-only"
# One printable character per token id (the preset's vocabulary is 64), so the trained model can be
# saved with a tokenizer and typed at in the explorer: "Qx7kQx7k" is a repeated random sequence.
TOKEN_CHARS = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"


def half_losses(model: nn.Module, tokens: Int[Tensor, "batch seq"]) -> tuple[float, float]:
    """Mean next-token loss on the first half's predictions and on the repeated half's."""
    half = tokens.shape[1] // 2
    with torch.no_grad():
        logits = model(tokens[:, :-1])  # (batch, seq - 1, vocab): position i predicts token i + 1
    losses = torch.nn.functional.cross_entropy(logits.transpose(1, 2), tokens[:, 1:], reduction="none")
    return float(losses[:, : half - 1].mean()), float(losses[:, half:].mean())


def head_patching(model: nn.Module, half: int, generator: torch.Generator) -> Float[Tensor, "layers heads"]:
    """Fraction of the repeated half's log-prob recovered by patching each head from clean into corrupted.

    Corrupted: the second half is fresh random tokens, so no copy exists; the metric is the clean
    run's targets' mean log-prob on the second half. 1 = the head alone restores the clean value.
    """
    vocab = model.config.vocab_size
    clean = repeated_random_tokens(vocab, half, batch=8, generator=generator)
    corrupted = clean.clone()
    corrupted[:, :half] = torch.randint(0, vocab, (8, half), generator=generator)  # the copy has no original

    def metric(logits: Tensor) -> Tensor:
        log_probs = logits[:, half:-1].log_softmax(-1)
        return log_probs.gather(-1, clean[:, half + 1:, None]).mean()

    with torch.no_grad():
        clean_value, corrupted_value = metric(model(clean)), metric(model(corrupted))
    grid = patch_heads(model, clean, corrupted, metric)
    return (grid - corrupted_value) / (clean_value - corrupted_value)


def _record(model: nn.Module, step: int, probe: Tensor) -> dict:
    first, repeated = half_losses(model, probe)
    return {"step": step, "first_half_loss": first, "repeated_half_loss": repeated,
            "induction_scores": induction_score(model, probe).tolist()}


def run_induction_study(steps: int | None = None, record_every: int = 50, batch: int | None = None,
                        seed: int = 0, on_record=None) -> dict:
    """Train the preset's model on repeated random tokens; return the history and the final analysis.

    `on_record(entry)` is called with each history entry as it is taken (e.g. to print progress).
    """
    recipe = dict(lookup_preset(PRESET).recipe)
    steps = recipe["max_steps"] if steps is None else steps
    batch = recipe["batch_size"] if batch is None else batch
    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed)
    config = get_preset(PRESET)
    half = config.context_length // 2
    model = TransformerLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=recipe["lr"], weight_decay=recipe["weight_decay"])
    probe = repeated_random_tokens(config.vocab_size, half, batch=32, generator=torch.Generator().manual_seed(99))
    history = []
    for step in range(steps + 1):
        if step % record_every == 0 or step == steps:
            model.eval()
            history.append(_record(model, step, probe))
            if on_record is not None:
                on_record(history[-1])
            model.train()
        if step == steps:
            break
        # The repeat length varies per step: with a fixed one, a layer-0 head can attend a fixed offset back
        # through the position embeddings and copy, with no induction circuit at all.
        length = int(torch.randint(half // 4, half + 1, (), generator=generator))
        tokens = repeated_random_tokens(config.vocab_size, length, batch, generator=generator)
        loss = cross_entropy(model(tokens[:, :-1]), tokens[:, 1:])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    model.eval()
    return {"model": model, "history": history, "previous_token_scores": previous_token_score(model, probe).tolist(),
            "head_patching": head_patching(model, half, generator).tolist()}


def save_study_model(model: TransformerLM, directory: str, history: list[dict] | None = None,
                     overwrite: bool = False) -> None:
    """Save the study's model as a checkpoint with a character tokenizer of its 64 ids
    (`TOKEN_CHARS`), so `glasslm serve --checkpoint DIRECTORY` shows its heads in the explorer.
    A non-empty `directory` is refused (its files kept) unless `overwrite`, which replaces it.

    Example:
        >>> import tempfile
        >>> from glasslm.io.checkpoint import load_checkpoint
        >>> d = tempfile.mkdtemp()
        >>> save_study_model(TransformerLM(get_preset(PRESET)), d)
        >>> load_checkpoint(d)[1].encode("AB+/")
        [0, 1, 62, 63]
    """
    if model.config.vocab_size != len(TOKEN_CHARS):
        raise ValueError(f"the study's tokenizer has {len(TOKEN_CHARS)} ids, the model {model.config.vocab_size}")
    check_output_dir(directory, overwrite, what="study model")
    last = (history or [{}])[-1]
    save_checkpoint(directory, model, CharTokenizer(list(TOKEN_CHARS)),
                    {"preset": PRESET, "data": "repeated random tokens (glasslm.interp.induction)", "step": last.get("step")})
