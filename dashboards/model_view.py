"""One model's page, as data: its catalog rows (and its S) in, dicts out.

Pure functions, no HTML and no file IO; `model_page.py` renders what they return. Older
catalogs degrade gracefully: no `labels` = recomputed from S, no `tracking_uri` /
`experiment_id` = the caller's fallback (`links.py`). Degraded variants are drawn but
never on a trade-off's Pareto front.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from dashboards.catalog_rows import (
    is_degraded,
    judged_metric,
    ppl_metric,
    protocol_of,
    split_dense,
)
from dashboards.intervals import accuracy_interval, accuracy_tasks, average_interval
from dashboards.links import NO_TRACKING, model_version_url, run_url, tracking_view
from dashboards.shapes import Row, View
from dashboards.speed import speed_resolved, speed_view
from pipeline.catalog.ranking import finite

# -- clusters ----------------------------------------------------------------------------


def catalog_labels(rows: Iterable[Row]) -> list[int] | None:
    """The `labels` column (the same on every row of a model), or None when absent/null."""
    for r in rows:
        if r.get("labels") is not None:
            return [int(x) for x in r["labels"]]
    return None


def cluster_labels(rows: Sequence[Row], S: np.ndarray | None) -> list[int] | None:
    """The model's clusters at its RLS-chosen K: the catalog's `labels` when a row has
    them, else spectral clustering of S at the row's K (older catalogs)."""
    labels = catalog_labels(rows)
    if labels is not None:
        return labels
    k = rows[0].get("k") if rows else None
    if S is None or not k:
        return None
    from lorp import cluster_layers

    return [int(x) for x in cluster_layers(S, int(k))]


# -- model page --------------------------------------------------------------------------


def variant_view(row: Row, tracking: Mapping[str, View], mlflow_ui: str) -> View:
    """What every table says about one row besides its metrics."""
    return {
        "label": row["method_label"],
        "dense": row["method"] == "dense",
        "budget": row["budget"],
        "n_blocks": row["n_blocks"],
        "pruned": [int(x) for x in row.get("pruned_layers") or []],
        "degraded": is_degraded(row),
        "ppl_ratio": finite(row.get("ppl_ratio")),
        "judged_on": row.get("judged_on") or None,
        "fits_calibration_only": row.get("fits_calibration_only") is True,
        "run_url": run_url(row, tracking, mlflow_ui),
        "model_url": model_version_url(row, tracking, mlflow_ui),
        "model_uri": row.get("model_uri") or "",
        "checkpoint": row.get("checkpoint") or "",
    }


SIZE_COLUMNS = (
    "params",
    "active_params",
    "experts",
    "weight_bytes",
    "kv_bytes_per_token",
    "decode_bytes_per_token",
    "decode_bytes_per_token_4k",
    "predicted_prefill_speedup",
    "predicted_decode_speedup",
    "latency_ms",
    "peak_mem_gib",
    "serve_output_tps",
    "serve_ttft_ms",
    "serve_tpot_ms",
    "serve_speedup",
)
"""The size-and-speed table's columns, where some row has them: counted from the config
(`lorp.serving_cost`, the predictions named so), then measured."""


def _present(rows: Sequence[Row], cols: Iterable[str]) -> list[str]:
    return [c for c in cols if any(finite(r.get(c)) is not None for r in rows)]


def metric_tables(rows: Sequence[Row], tracking: Mapping[str, View], mlflow_ui: str) -> View:
    """Tables 2-3 and Appendix A, dense row first: plain values, intervals, speed views."""
    ppl = sorted(k for k in {k for r in rows for k in r} if k.startswith("ppl_"))
    ppl = _present(rows, [c for c in ppl if c != "ppl_ratio"])
    ratios = _present(rows, ["ratio_" + c.removeprefix("ppl_") for c in ppl])
    tasks = [t for t in accuracy_tasks(rows) if _present(rows, [f"acc_{t}"])]
    with_avg = bool(_present(rows, ["acc_avg"]))
    out: View = {
        "ppl_cols": ppl,
        "ppl_ratio": bool(_present(rows, ["ppl_ratio"])),
        "ratio_cols": ratios,
        "judged_on": sorted({str(r["judged_on"]) for r in rows if r.get("judged_on")}),
        "acc_cols": tasks + (["avg"] if with_avg else []),
        "size_cols": _present(rows, SIZE_COLUMNS),
        "speed": bool(_present(rows, ["speedup", "speedup_measured"])),
        "rows": [],
    }
    for r in rows:
        acc = [accuracy_interval(r.get(f"acc_{t}"), r.get(f"n_{t}")) for t in tasks]
        if with_avg:
            acc.append(average_interval(r, tasks))
        out["rows"].append(
            {
                **variant_view(r, tracking, mlflow_ui),
                "ppl": [finite(r.get(c)) for c in ppl],
                "ratios": [finite(r.get(c)) for c in ratios],
                "acc": acc,
                "size": [finite(r.get(c)) for c in out["size_cols"]],
                "speed": speed_view(r),
            }
        )
    return out


def _quality_error(row: Row, quality: str, tasks: Sequence[str]) -> float | None:
    if quality == "acc_avg":
        return average_interval(row, tasks)["half"]
    if quality.startswith("acc_"):
        return accuracy_interval(row.get(quality), row.get(f"n_{quality[4:]}"))["half"]
    return None


def tradeoff_lines(points: Sequence[Row], quality: str, cost: str) -> dict[str, list[tuple]]:
    """method -> [(cost, quality, error half-width or None, degraded)], one figure's lines."""
    tasks = accuracy_tasks(points)
    lines: dict[str, list[tuple]] = defaultdict(list)
    for r in points:
        if cost in SPEED_COSTS and not speed_resolved(r):
            continue  # an unresolved timing is no latency to plot
        x, y = finite(r.get(cost)), finite(r.get(quality))
        if x is not None and y is not None:
            lines[r["method_label"]].append(
                (x, y, _quality_error(r, quality, tasks), is_degraded(r))
            )
    return dict(lines)


COSTS = (
    ("params", "parameters"),
    ("active_params", "active parameters per token"),
    ("latency_ms", "prefill latency (ms)"),
    ("decode_bytes_per_token", "predicted decode bytes per token at the evaluation's context"),
    ("decode_bytes_per_token_4k", "predicted decode bytes per token at 4k context"),
)
"""A figure's costs: a sub-layer variant's line (its label names its granularity,
`shortgpt-attention`) meets the block lines on the decode cost at 4k, where the KV cache
an attention removal saves weighs. A mixture's expert cuts meet its depth cuts on
parameters (what the cut frees) and on active parameters and decode bytes (what a token
still runs through and reads); those two axes are drawn for a mixture only (a dense
model's active parameters are its parameters, and its decode bytes at its own context
follow them)."""
MOE_COSTS = {"active_params", "decode_bytes_per_token"}
SPEED_COSTS = {"latency_ms"}


def tradeoffs(dense: Row | None, points: Sequence[Row]) -> list[View]:
    """Quality/cost figures: PTB perplexity and mean accuracy (else the first perplexity)
    against parameters and against latency, one line per method over its budgets."""
    qualities = _present(points, ["ppl_ptb", "acc_avg"]) or [
        q for q in [ppl_metric(points)] if q is not None
    ]
    out = []
    moe = any(r.get("experts") not in (None, 0) and finite(r.get("experts")) for r in points)
    for quality in qualities:
        kind = "perplexity" if quality.startswith("ppl") else "accuracy %"
        for cost, xlabel in COSTS:
            if cost in MOE_COSTS and not moe:
                continue
            lines = tradeoff_lines(points, quality, cost)
            if lines:
                higher = not quality.startswith("ppl")
                out.append(
                    {
                        "front": _front_of(lines, higher),
                        "quality": quality,
                        "cost": cost,
                        "xlabel": xlabel,
                        "ylabel": f"{kind} ({quality})",
                        "lines": lines,
                        "dense": finite(dense.get(quality)) if dense else None,
                    }
                )
    return out


def pareto_front(pts: Sequence[tuple], higher_is_better: bool = False) -> list[tuple]:
    """The points no other point beats on both cost (x, lower is better) and quality (y):
    the trade-off's efficient frontier, by cost. Degraded points (p[3]) never count."""
    sign = -1.0 if higher_is_better else 1.0
    ok = sorted((p for p in pts if not p[3]), key=lambda p: (p[0], sign * p[1]))
    front: list[tuple] = []
    for p in ok:
        if not front or sign * p[1] < sign * front[-1][1]:
            front.append(p)
    return front


def _front_of(lines: Mapping[str, Sequence[tuple]], higher: bool) -> list[View]:
    """The Pareto front of every method's points together, each with its method."""
    tagged = [(*p[:4], method) for method, pts in lines.items() for p in pts]
    return [
        {"x": p[0], "y": p[1], "label": p[4]} for p in pareto_front(tagged, higher_is_better=higher)
    ]


def repair_of(row: Row) -> str:
    """none or linear (`repair` column; catalogs older than the repair have none)."""
    return str(row.get("repair") or "none")


def repair_pairs(points: Sequence[Row], metric: str | None) -> list[View]:
    """Every repaired variant beside its unrepaired twin (same method, budget and blocks):
    the figure both have on `metric`, the gain (pruned / repaired), each one's gate
    verdict, the fit's worst residual on calibration tokens and what the held-out
    calibration windows kept of it (`repair_kept`). Empty without repairs."""
    plain = {(r["method_label"], r["budget"]): r for r in points if repair_of(r) == "none"}
    out = []
    for r in points:
        kind = repair_of(r)
        if kind == "none":
            continue
        base = r["method_label"].removesuffix(f"+{kind}")
        twin = plain.get((base, r["budget"]))
        before = finite(twin.get(metric)) if twin and metric else None
        after = finite(r.get(metric)) if metric else None
        out.append(
            {
                "label": base,
                "repair": kind,
                "budget": r["budget"],
                "n_blocks": r["n_blocks"],
                "pruned": before,
                "repaired": after,
                "gain": before / after if before is not None and after else None,
                "pruned_degraded": is_degraded(twin) if twin else None,
                "repaired_degraded": is_degraded(r),
                "residual": finite(r.get("repair_residual")),
                "kept": r.get("repair_kept") or None,
            }
        )
    return sorted(out, key=lambda v: (v["label"], v["budget"]))


DOMAIN_PREFIX = "ratio_domain_"


def domain_view(points: Sequence[Row]) -> View | None:
    """Quality per domain (`ratio_domain_<domain>` columns: each domain's perplexity over
    dense's) for every variant, its repaired twin's beside it, the worst domain and what
    the repair gate kept. None for rows from before domains."""
    domains = sorted(
        {
            c.removeprefix(DOMAIN_PREFIX)
            for r in points
            for c in r
            if c.startswith(DOMAIN_PREFIX) and r.get(c) is not None
        }
    )
    if not domains:
        return None
    repaired = {
        (r["method_label"].removesuffix(f"+{repair_of(r)}"), r["budget"]): r
        for r in points
        if repair_of(r) != "none"
    }
    rows = []
    for r in points:
        if repair_of(r) != "none":
            continue
        twin = repaired.pop((r["method_label"], r["budget"]), None)
        rows.append(_domain_row(r["method_label"], r, twin, domains))
    rows += [_domain_row(label, None, twin, domains) for (label, _), twin in repaired.items()]
    return {"domains": domains, "rows": sorted(rows, key=lambda v: (v["budget"], v["label"]))}


def _domain_row(label: str, plain: Row | None, twin: Row | None, domains: list[str]) -> View:
    def of(r: Row | None, d: str) -> float | None:
        return finite(r.get(DOMAIN_PREFIX + d)) if r is not None else None

    any_row = plain if plain is not None else twin
    assert any_row is not None
    return {
        "label": label,
        "budget": any_row["budget"],
        "n_blocks": any_row["n_blocks"],
        "pruned": [of(plain, d) for d in domains],
        "repaired": [of(twin, d) for d in domains],
        "worst": (twin or plain or {}).get("worst_domain"),
        "gate": twin.get("repair_gate") if twin is not None else None,
    }


def memory_view(rows: Sequence[Row]) -> View | None:
    """How the model's stages held it (`memory_plan`: the latest row's that has one) and
    why its speed was not timed (`speed_skipped`), None for rows from before either."""
    plans = [r for r in rows if r.get("memory_plan")]
    if not plans:
        return None
    latest = max(plans, key=lambda r: str(r.get("created_at") or ""))
    try:
        plan = json.loads(latest["memory_plan"])
    except (TypeError, ValueError):
        return None
    stages = [
        {
            "stage": stage,
            "mode": d.get("mode"),
            "text": f"{stage} {d.get('mode')} ({d.get('batch')} windows per pass, plans "
            f"{d.get('need_gib', 0):.3g} GiB of a worker's {d.get('worker_gib', 0):.3g} GiB; "
            f"held whole it needs {d.get('memory_gib', 0):.3g} GiB)",
        }
        for stage, d in sorted(plan.items())
        if isinstance(d, Mapping)
    ]
    skipped = next((r["speed_skipped"] for r in rows if r.get("speed_skipped")), None)
    return {"stages": stages, "speed_skipped": skipped}


def model_view(
    model: str,
    rows: Sequence[Row],
    S: np.ndarray | None,
    tracking: Mapping[str, View],
    mlflow_ui: str,
) -> View:
    """Everything one model's page shows except the S figures."""
    first = rows[0]
    dense, points = split_dense(rows)
    ordered = ([dense] if dense else []) + points
    jobs = sorted({r["job"] for r in rows})
    judged = judged_metric(rows)
    return {
        "model": model,
        "protocol": protocol_of(first),
        "calibration_id": first.get("calibration_id") or "",
        "family": first["family"],
        "n_blocks": int(first["n_blocks"]),
        "rls": finite(first.get("rls")),
        "k": first.get("k"),
        "fingerprint": first.get("fingerprint") or "",
        "labels": cluster_labels(rows, S),
        "labels_source": "catalog" if catalog_labels(rows) is not None else "S",
        "variants": [variant_view(r, tracking, mlflow_ui) for r in points],
        "tables": metric_tables(ordered, tracking, mlflow_ui),
        "tradeoffs": tradeoffs(dense, points),
        "repairs": repair_pairs(points, judged),
        "domains": domain_view(points),
        "repair_metric": judged,
        "dense_metric": finite(dense.get(judged or "")) if dense else None,
        "jobs": tracking_view({j: tracking.get(j, NO_TRACKING) for j in jobs}, mlflow_ui),
        "memory": memory_view(rows),
    }
