"""A small catalog for the peers report's tests (`benchmarks/peers.py`): one model, one
budget, two of lorp's variants and two peers', each a real `CatalogRow` with the
per-window losses and per-item answers the paired tests read."""

from __future__ import annotations

import json
from typing import Any

from pipeline.catalog.row import CatalogRow

EVALUATION = json.dumps({"perplexity": ["ptb", "lee"], "seq_len": 64, "max_windows": 4})
PROTOCOL = "ptb64-test"
NOISE = ([0.0, 0.02, -0.01, 0.0], [0.01, 0.0, 0.0, -0.02])


def row(label: str, budget: int, ratio: float, nll: float, **extra: Any) -> dict[str, Any]:
    """A variant (or `dense` at budget 0) whose worst-domain ratio is `ratio`, its
    per-window mean NLL `nll` on the four windows of both corpora, plus `NOISE` (so two
    variants' differences are not all equal)."""
    method = label.split("+")[0]
    losses = [nll + e for e in NOISE[label.startswith("replaceme")]]
    fields: dict[str, Any] = {
        "grid_key": f"key-{label}-{budget}",
        "job": "peers",
        "model": "m",
        "n_blocks": 12,
        "method": method,
        "method_label": label,
        "budget": budget,
        "pruned_layers": list(range(4, 4 + budget)),
        "repair": "linear" if label.endswith("+linear") else extra.pop("repair", None),
        "evaluation": EVALUATION,
        "protocol": PROTOCOL,
        "judged_on": "lee",
        "worst_domain": "prose",
        "worst_domain_ratio": ratio,
        "window_nll": json.dumps({"ptb": losses, "lee": losses}),
        "created_at": "2026-12-01T00:00:00.000+00:00",
    }
    figures = {"ppl_ptb": 20.0 * ratio, "ppl_lee": 30.0 * ratio, "ppl_ratio": ratio}
    return CatalogRow(**(fields | extra), figures=figures).record()


def zero_shot(label: str, correct: str) -> dict[str, Any]:
    """The zero-shot job's row of `label` at budget 4: `correct` on arc_easy."""
    scored = {"arc_easy": {"split": "validation", "n": len(correct), "correct": correct}}
    return row(label, 4, 1.0, 1.0, zero_shot=json.dumps(scored), grid_key=f"zs-{label}")


def catalog() -> list[dict[str, Any]]:
    """Dense; lorp's window+linear (1.2x) and shortgpt (1.5x); replaceme (1.1x, lower NLL
    on every window than lorp's) and prune-comp (2.0x, degraded) at 4 blocks."""
    return [
        row("dense", 0, 1.0, 3.0, method="dense", pruned_layers=[]),
        row("window+linear", 4, 1.2, 3.2, repair_fits=json.dumps([{"follower": 9}])),
        row("shortgpt", 4, 1.5, 3.5, repair="none"),
        row("replaceme+cosine-map", 4, 1.1, 3.1, repair="cosine-map"),
        row("prune-comp+magnitude-comp", 4, 2.0, 3.7, repair="magnitude-comp", degraded=True),
    ]
