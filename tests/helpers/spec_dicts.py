"""Job specs the spec tests start from: `GOOD`, a valid job over a packaged model (as a
dict), and `calibration_job`, a parsed job whose calibration reads the given dataset."""

from __future__ import annotations

from typing import Any

GOOD = {
    "name": "t",
    "models": [{"ref": "smollm2-135m"}],
    "budgets": [4, 0.25],
    "methods": [{"name": "lorp", "options": {"variant": "released"}}, {"name": "shortgpt"}],
}


def calibration_job(dataset: Any):  # type: ignore[no-untyped-def]
    """A one-model job whose `calibration.dataset` is `dataset` (a corpus or a mix)."""
    from pipeline.spec.parse import parse_spec

    return parse_spec(
        {
            "name": "mix",
            "models": [{"ref": "x"}],
            "budgets": [1],
            "methods": [{"name": "lorp"}],
            "calibration": {"dataset": dataset, "samples": 10, "seq_len": 16, "loss_samples": 4},
        }
    )
