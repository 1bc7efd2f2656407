"""The induction-head study, shortened: the heads appear and the patching isolates them."""

from __future__ import annotations

import pytest
import torch

from glasslm.interp.explore import head_scores
from glasslm.interp.induction import run_induction_study, save_study_model
from glasslm.io.checkpoint import load_checkpoint


@pytest.mark.slow
def test_induction_heads_appear_in_a_short_run(tmp_path):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the tiny model trains fastest on one thread
    try:
        study = run_induction_study(steps=1200, record_every=600)
    finally:
        torch.set_num_threads(threads)
    first, last = study["history"][0], study["history"][-1]
    scores = torch.tensor(last["induction_scores"])  # (layers, heads)
    assert float(scores.max()) > 0.9
    assert int(scores.max(dim=1).values.argmax()) == 1  # induction needs a layer before it: it is a layer-1 head
    assert first["repeated_half_loss"] > 4.0  # at the start, the copy is as unpredictable as the original
    assert last["repeated_half_loss"] < 0.25 * last["first_half_loss"]
    previous = torch.tensor(study["previous_token_scores"])
    assert float(previous[0].max()) > 0.3  # the layer-0 half of the circuit: a previous-token head
    patching = torch.tensor(study["head_patching"])  # fraction of the clean log-prob each head restores
    assert float(patching[1].max()) > 0.3 and float(patching[1].max()) > float(patching[0].max())
    # Saved with its 64-character tokenizer, the model shows the heads on a text typed as in the explorer.
    save_study_model(study["model"], str(tmp_path / "model"), study["history"])
    model, tokenizer, meta = load_checkpoint(tmp_path / "model")
    assert tokenizer.vocab_size == model.config.vocab_size == 64 and meta["step"] == 1200
    typed = head_scores(model, tokenizer, tokenizer.encode("Qx7kLm2PzR9a" * 2))
    assert float(torch.tensor(typed["prompt"]["induction"]["scores"])[1].max()) > 0.9


def test_saving_the_study_model_keeps_a_users_directory(tmp_path):
    from glasslm.core.model import TransformerLM
    from glasslm.presets import get_preset

    (tmp_path / "notes.txt").write_text("mine")
    model = TransformerLM(get_preset("induction-attn-only"))
    with pytest.raises(ValueError, match="not empty .*notes.txt.*--overwrite"):
        save_study_model(model, str(tmp_path))
    assert (tmp_path / "notes.txt").read_text() == "mine" and not (tmp_path / "model.safetensors").exists()
    save_study_model(model, str(tmp_path), overwrite=True)
    assert load_checkpoint(tmp_path)[1].vocab_size == 64


def test_the_study_script_leaves_the_tracked_figures_alone(tmp_path):
    """A run writes its figures to runs/induction-figures/ unless --figures names docs/figures."""
    import hashlib
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    tracked = sorted((root / "docs" / "figures").glob("induction*"))
    before = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in tracked}
    proc = subprocess.run([sys.executable, str(root / "scripts" / "induction_study.py"), "--steps", "4",
                           "--record-every", "2"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in tracked} == before and len(before) == 4
    assert sorted(p.name for p in (tmp_path / "runs" / "induction-figures").iterdir()) == sorted(before)
