"""What the dashboard shows, as plain data: catalog rows (and each model's S) in, dicts out.

Pure functions, no HTML and no file IO; `overview.py` and `model_page.py` render what
they return. The honesty rules live here:

- zero-shot accuracy carries a 95% binomial interval, +-1.96 * sqrt(p (1 - p) / n) in
  percent, from the `n_<task>` item count; fewer than 100 items is flagged as not
  comparable to the paper, an unknown count is flagged and gets no interval;
- a variant marked `degraded` by the quality gate is never a "best" variant;
- a speed-up is shown with its spread and the physical bound N / (N - k) (k of N equal
  blocks removed), and one above the bound by more than 5% is flagged, not hidden;
- a timing that was not resolved (`speed_resolved` 0, or a `speedup_measured` with no
  `speedup`) shows as "not resolved" with the measured ratio beside it, and is never
  ranked, sorted by or plotted as a speed.

Missing columns (older catalogs) degrade gracefully: no `degraded` = not degraded, no
`n_<task>` = items unknown, no `speedup_std` = no spread, no `speed_resolved` = resolved,
no `labels` = recomputed from S, no `tracking_uri`/`experiment_id` = the caller's
fallback (`links.py`).
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from dashboards.links import NO_TRACKING, model_version_url, run_url, tracking_view
from dashboards.shapes import Row, View
from pipeline.records.protocol import rank_column, row_protocol
from pipeline.records.ranking import finite, order_key

Z95 = 1.96
MIN_COMPARABLE_ITEMS = 100
BOUND_TOLERANCE = 0.05
SMALL = "small"  # fewer than MIN_COMPARABLE_ITEMS items
UNKNOWN = "unknown"  # no item count in the catalog


def slug(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)


def group_by_model(rows: Iterable[Row]) -> dict[str, list[Row]]:
    """model -> its rows, models in name order."""
    out: dict[str, list[Row]] = defaultdict(list)
    for r in rows:
        out[r["model"]].append(r)
    return dict(sorted(out.items()))


def protocol_of(row: Row) -> str:
    """The row's evaluation protocol (`pipeline.records.protocol`): what its figures may
    be compared with."""
    return row_protocol(row)


def group_pages(rows: Iterable[Row]) -> dict[tuple[str, str], list[Row]]:
    """(model, protocol) -> its rows, in name order: one page each, since figures are
    compared only within one protocol."""
    out: dict[tuple[str, str], list[Row]] = defaultdict(list)
    for r in rows:
        out[(r["model"], protocol_of(r))].append(r)
    return dict(sorted(out.items()))


def page_names(keys: Iterable[tuple[str, str]]) -> dict[tuple[str, str], str]:
    """(model, protocol) -> its page: `model-<model>.html` for a model measured under one
    protocol, `model-<model>-<protocol>.html` for each of several."""
    keys = list(keys)
    count = defaultdict(int)
    for model, _ in keys:
        count[model] += 1
    return {
        (m, p): f"model-{slug(m)}.html" if count[m] == 1 else f"model-{slug(m)}-{slug(p)}.html"
        for m, p in keys
    }


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


def split_dense(rows: Iterable[Row]) -> tuple[Row | None, list[Row]]:
    """(the dense row or None, the pruned variants by method label then budget)."""
    rows = list(rows)
    dense = next((r for r in rows if r["method"] == "dense"), None)
    points = sorted(
        (r for r in rows if r["method"] != "dense"), key=lambda r: (r["method_label"], r["budget"])
    )
    return dense, points


def ppl_metric(rows: Iterable[Row]) -> str | None:
    """The first perplexity column (by name) that has a value: what "best" ranks by."""
    names = sorted({k for r in rows for k in r if k.startswith("ppl_") and r[k] is not None})
    names = [n for n in names if n != "ppl_ratio"]
    return names[0] if names else None


def judged_metric(rows: Iterable[Row]) -> str | None:
    """The perplexity column of the held-out corpus the gate judged the rows on (the first
    of `judged_on`'s corpora); rows judged on calibration text, or from before the
    judgement: the first perplexity column by name."""
    from pipeline.evaluation.metrics import metric_name  # imports torch: only here

    rows = list(rows)
    held = [str(r["judged_on"]) for r in rows if r.get("judged_on")]
    held = [j for j in held if not j.endswith("(calibration text)")]
    column = metric_name(held[0].split(",")[0]) if held else None
    if column and any(finite(r.get(column)) is not None for r in rows):
        return column
    return ppl_metric(rows)


def rank_metric(rows: Sequence[Row]) -> str | None:
    """The column "best" ranks by, as the registry's aliases do: the protocol's first
    perplexity (`pipeline.records.protocol.rank_column`); catalogs without an
    `evaluation` column: the first perplexity column by name."""
    column = rank_column(rows[0]) if rows else None
    if column and any(finite(r.get(column)) is not None for r in rows):
        return column
    return ppl_metric(rows)


def is_degraded(row: Row) -> bool:
    """The quality gate's verdict; a catalog without the column has no degraded rows."""
    return bool(row.get("degraded") or False)


# -- zero-shot intervals -----------------------------------------------------------------


def accuracy_tasks(rows: Iterable[Row]) -> list[str]:
    """Task names with an `acc_<task>` column (not the average)."""
    return sorted({k[4:] for r in rows for k in r if k.startswith("acc_") and k != "acc_avg"})


def _flag(counts: Sequence[float | None]) -> str | None:
    if any(n is None or n <= 0 for n in counts):
        return UNKNOWN
    return SMALL if any(n < MIN_COMPARABLE_ITEMS for n in counts) else None


def _interval(value: float | None, se: float | None, n: float | None, flag: str | None) -> View:
    half = None if value is None or se is None else Z95 * se
    return {
        "value": value,
        "half": half,
        "lo": None if half is None else max(0.0, value - half),
        "hi": None if half is None else min(100.0, value + half),
        "n": n,
        "flag": flag if value is not None else None,
    }


def standard_error(acc_percent: float, n: float) -> float:
    """Binomial SE of an accuracy in percent: 100 * sqrt(p (1 - p) / n)."""
    p = min(max(acc_percent / 100.0, 0.0), 1.0)
    return 100.0 * math.sqrt(p * (1.0 - p) / n)


def accuracy_interval(acc_percent: Any, n: Any) -> View:
    """{value, half, lo, hi, n, flag} for one accuracy; half = 1.96 SE, flag small/unknown."""
    value, count = finite(acc_percent), finite(n)
    flag = _flag([count])
    se = standard_error(value, count) if value is not None and flag != UNKNOWN else None
    return _interval(value, se, count, flag)


def average_interval(row: Row, tasks: Sequence[str]) -> View:
    """acc_avg with the tasks' SEs combined as independent: sqrt(sum SE_t^2) / T."""
    value = finite(row.get("acc_avg"))
    present = [t for t in tasks if finite(row.get(f"acc_{t}")) is not None]
    counts = [finite(row.get(f"n_{t}")) for t in present]
    flag = _flag(counts) if present else UNKNOWN
    se = None
    if value is not None and flag != UNKNOWN:
        ses = [standard_error(float(row[f"acc_{t}"]), float(row[f"n_{t}"])) for t in present]
        se = math.sqrt(sum(s * s for s in ses)) / len(ses)
    n = sum(counts) if flag != UNKNOWN else None  # type: ignore[arg-type]
    return _interval(value, se, n, flag)


# -- speed -------------------------------------------------------------------------------


def speed_bound(n_blocks: Any, budget: Any) -> float | None:
    """N / (N - k): the most that removing k of N equal blocks can speed a forward up."""
    n, k = finite(n_blocks), finite(budget) or 0.0
    if n is None or n - k <= 0:
        return None
    return n / (n - k)


def speed_resolved(row: Row) -> bool:
    """Whether the row's timing was resolved: false when `speed_resolved` is 0, or when
    there is a measured ratio (`speedup_measured`) but no published speed-up. Catalogs
    older than those columns have only resolved rows."""
    flag = finite(row.get("speed_resolved"))
    if flag is not None:
        return flag != 0.0
    return finite(row.get("speedup")) is not None or finite(row.get("speedup_measured")) is None


def speed_view(row: Row) -> View:
    """{speedup, std, bound, exceeds, resolved, measured, measured_exceeds}: exceeds =
    speed-up above the bound by more than 5%. An unresolved timing has no speed-up (None:
    never ranked or plotted), only the measured ratio, to be shown as such;
    measured_exceeds says whether that ratio is above the bound by more than 5%."""
    resolved = speed_resolved(row)
    speedup = finite(row.get("speedup")) if resolved else None
    measured = finite(row.get("speedup_measured"))
    bound = speed_bound(row.get("n_blocks"), row["budget"])
    return {
        "speedup": speedup,
        "std": finite(row.get("speedup_std")) if resolved else None,
        "bound": bound,
        "exceeds": _above(speedup, bound),
        "resolved": resolved,
        "measured": measured,
        "measured_exceeds": _above(measured, bound),
    }


def _above(speedup: float | None, bound: float | None) -> bool:
    return speedup is not None and bound is not None and speedup > bound * (1 + BOUND_TOLERANCE)


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


# -- overview ----------------------------------------------------------------------------


def best_per_budget(rows: Sequence[Row], metric: str | None, budget: int) -> View:
    """The lowest-`metric` variant at `budget` that the quality gate passed.

    status: "ok" (label, value), "all-degraded" (every variant failed the gate), or
    "none" (no variant at that budget, or no metric); `skipped` counts degraded variants.
    """
    cands = [r for r in rows if r["budget"] == budget and r["method"] != "dense"]
    passed = [r for r in cands if not is_degraded(r)]
    view: View = {
        "budget": budget,
        "status": "none",
        "label": None,
        "value": None,
        "skipped": len(cands) - len(passed),
    }
    if cands and not passed:
        view["status"] = "all-degraded"
    elif passed and metric:
        best = min(passed, key=lambda r: order_key(r, metric))  # the aliases' order
        view.update(status="ok", label=best["method_label"], value=finite(best.get(metric)))
    return view


def overview_row(
    key: tuple[str, str], rows: Sequence[Row], budgets: Sequence[int], links: View, page: str
) -> View:
    """One (model, protocol)'s line of the overview table (links: tracking and
    mlflow_ui); "best" ranks by the protocol's first perplexity."""
    model, protocol = key
    first = rows[0]
    dense, _ = split_dense(rows)
    metric = rank_metric(rows)
    return {
        "model": model,
        "protocol": protocol,
        "metric": metric,
        "page": page,
        "family": first["family"],
        "n_blocks": first["n_blocks"],
        "rls": finite(first.get("rls")),
        "k": first.get("k"),
        "dense_value": finite(dense.get(metric)) if dense and metric else None,
        "best": [best_per_budget(rows, metric, b) for b in budgets],
        "methods": sorted({r["method_label"] for r in rows}),
        "budgets": sorted({r["budget"] for r in rows}),
        "degraded": sum(is_degraded(r) for r in rows),
        "run_url": run_url(dense or first, links["tracking"], links["mlflow_ui"]),
    }


def overview(
    by_page: Mapping[tuple[str, str], Sequence[Row]],
    tracking: Mapping[str, View],
    mlflow_ui: str,
) -> View:
    """Everything the fleet page shows, by (model, protocol) (`group_pages`)."""
    all_rows = [r for rs in by_page.values() for r in rs]
    pages = page_names(by_page)
    metric = ppl_metric(all_rows)
    budgets = sorted({r["budget"] for r in all_rows if r["budget"]})
    links = {"tracking": tracking, "mlflow_ui": mlflow_ui}
    return {
        "metric": metric,
        "budgets": budgets,
        "families": sorted({r["family"] for r in all_rows}),
        "methods": sorted({r["method_label"] for r in all_rows if r["method"] != "dense"}),
        "n_points": sum(1 for r in all_rows if r["method"] != "dense"),
        "n_degraded": sum(is_degraded(r) for r in all_rows),
        "protocols": sorted({k[1] for k in by_page}),
        "n_models": len({k[0] for k in by_page}),
        "rows": [overview_row(k, rs, budgets, links, pages[k]) for k, rs in by_page.items()],
        "jobs": tracking_view(tracking, mlflow_ui),
    }


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
    "weight_bytes",
    "kv_bytes_per_token",
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


COSTS = (("params", "parameters"), ("latency_ms", "prefill latency (ms)"))
SPEED_COSTS = {"latency_ms"}


def tradeoffs(dense: Row | None, points: Sequence[Row]) -> list[View]:
    """Quality/cost figures: PTB perplexity and mean accuracy (else the first perplexity)
    against parameters and against latency, one line per method over its budgets."""
    qualities = _present(points, ["ppl_ptb", "acc_avg"]) or [
        q for q in [ppl_metric(points)] if q is not None
    ]
    out = []
    for quality in qualities:
        kind = "perplexity" if quality.startswith("ppl") else "accuracy %"
        for cost, xlabel in COSTS:
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
        "repair_metric": judged,
        "dense_metric": finite(dense.get(judged or "")) if dense else None,
        "jobs": tracking_view({j: tracking.get(j, NO_TRACKING) for j in jobs}, mlflow_ui),
        "memory": memory_view(rows),
    }
