"""Hand-made dashboard inputs: catalog rows with the core columns the dashboard reads, a
model's S from residual-like states, and a job's events with spans of worker slots."""

from __future__ import annotations

from typing import Any

import torch

from tests.helpers.states import make_states

UI = "http://127.0.0.1:5000"


def row(model: str = "m", method: str = "lorp", budget: int = 1, **extra: Any) -> dict:
    """One catalog row with the core columns the dashboard reads."""
    return {
        "grid_key": f"{model}-{method}-{budget}",
        "job": "job-a",
        "model": model,
        "family": "Llama",
        "fingerprint": "f" * 8,
        "n_blocks": 8,
        "method": method,
        "method_label": method,
        "budget": budget,
        "pruned_layers": list(range(1, 1 + budget)),
        "rls": 0.9,
        "k": 3,
        "stats_file": None,
        "checkpoint": f"/ckpt/{method}-{budget}",
        "mlflow_run_id": f"run-{method}-{budget}",
        **extra,
    }


def similarity_stats(n_blocks: int, seed: int = 0):  # type: ignore[no-untyped-def]
    """A `SimilarityStats` over `n_blocks` blocks of residual-like states."""
    from lorp import SimilarityStats

    states = make_states(n_states=n_blocks + 1, tokens=40, d=32, seed=seed)
    stats = SimilarityStats(n_blocks=n_blocks, model_fingerprint="m", calibration_fingerprint="c")
    stats.update(torch.tensor(states[:, None]))  # [L, batch 1, tokens, d]
    return stats


def _span(stage: str, model: str, start: float, end: float, node: str, worker: str, **kw: Any):  # type: ignore[no-untyped-def]
    slots = {} if worker == "driver" else {"CPU": 1.0}
    return dict(
        event="span",
        stage=stage,
        model=model,
        start=start,
        end=end,
        node=node,
        worker=worker,
        slots=slots,
        **kw,
    )


def timeline_events() -> list[dict]:
    """An earlier attempt (ignored), then 4 CPU slots: workers n1/pid 1 and n1/pid 2, one
    on n2, the driver (preparing a and b at once); b's point failed; one unit running."""
    t = 1000.0
    return [
        {"event": "start", "job": "old"},
        _span("load", "a", 900.0, 950.0, "old", "pid 9"),
        {"event": "start", "job": "tl<job>"},
        {"event": "cluster", "kind": "CPU", "slots": {"CPU": 4.0, "GPU": 0.0}, "models": 2},
        {"event": "begin", "unit": "u1", "stage": "point", "model": "b", "point": "p2"},
        {"event": "begin", "unit": "u0", "stage": "point", "model": "b", "point": "p1"},
        {"event": "finish", "unit": "u0"},
        _span("prepare", "a", t, t + 1, "driver", "driver"),
        _span("prepare", "b", t + 0.5, t + 3, "driver", "driver"),  # overlaps: a 2nd lane
        _span("load", "a", t, t + 10, "n1", "pid 1", of="capture"),
        _span("capture", "a", t + 10, t + 30, "n1", "pid 1", shard="shard-0000.parquet"),
        _span("load", "b", t + 2, t + 12, "n1", "pid 2", of="point"),
        _span("point", "b", t + 12, t + 40, "n1", "pid 2", point="p1", failed=True),
        _span("losses", "a", t + 30, t + 40, "n2", "pid 7", selection="lorp", step=2),
        _span("gate", "a", t + 40, t + 42, "driver", "driver"),
        {"event": "span", "stage": "load", "model": "c", "start": None, "end": t},  # cut
    ]
