"""GET /api/run: the metrics of the training run the served checkpoint comes from, for the explorer's
"Training run" panel (the numbers `glasslm plot` draws).

The file is the one `glasslm serve` found beside the checkpoint when it started (`run_metrics_file`);
a request names no path. It is read again on every request, so a run still training shows its new
steps; a torn last line (a step being written) is skipped, and a non-finite number reads as null.

Answers, always 200:
    {"run": "NAME", "records": [...metrics.jsonl records...], "signals": [[key, title], ...]}
    {"run": null, "records": [], "signals": [], "reason": "why there is nothing to show"}

`signals` are the post-training series the records hold (GRPO's reward, KL, completion length;
DPO's margin and accuracy), with the titles `glasslm plot` gives them.

Example:
    >>> from fastapi import FastAPI
    >>> from fastapi.testclient import TestClient
    >>> from glasslm.presets import get_preset
    >>> from glasslm.core.model import TransformerLM
    >>> from glasslm.serving.context import Served
    >>> from glasslm.tokenizers import CharTokenizer
    >>> app = FastAPI()
    >>> app.include_router(router)
    >>> model = TransformerLM(get_preset("llama-tiny", n_layers=1))
    >>> app.state.served = Served.build(model, CharTokenizer.from_text("ab"))
    >>> TestClient(app).get("/api/run").json()["run"] is None
    True
"""

from __future__ import annotations

import math
from typing import Any

from fastapi import APIRouter

from glasslm.serving.context import ServedDep
from glasslm.training.loggers import read_metrics
from glasslm.training.plot import signals_logged

router = APIRouter()


def _finite(record: dict[str, Any]) -> dict[str, Any]:
    """The record with NaN and infinities as None: JSON has no such numbers (a hand-written file may)."""
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}


@router.get("/api/run")
def training_run(served: ServedDep) -> dict[str, Any]:
    path = served.metrics_file
    if path is None:
        return {"run": None, "records": [], "signals": [],
                "reason": "the served checkpoint is not in a training run directory (no metrics.jsonl beside it)"}
    try:
        records = [_finite(r) for r in read_metrics(path) if isinstance(r, dict)]
    except (OSError, UnicodeDecodeError) as err:  # removed (a run restarted with --overwrite) or unreadable
        reason = getattr(err, "strerror", None) or err
        return {"run": None, "records": [], "signals": [], "reason": f"cannot read the run's metrics.jsonl: {reason}"}
    training = [r for r in records if r.get("train_loss") is not None]
    return {"run": path.parent.name, "records": records,
            "signals": [list(signal) for signal in signals_logged(training)]}
