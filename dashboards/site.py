"""The fleet catalog as a static, self-contained site: `lorp dashboard RUN_DIR`.

Pages: an overview of every model (N, RLS, K, best variant per budget; sortable and
filterable; links to model pages and MLflow runs) with the paper's Table 1 and Fig. 2, and
one page per model with Fig. 1 (S), Fig. 2, the cluster labels along depth, Fig. 4 (the
pruned-layer map of every method and budget), Tables 2-3 (perplexity, accuracy, with the
dense row) and the quality/speed trade-off. Everything is inline: no network at view time.
"""

from __future__ import annotations

import html
import math
import os
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from dashboards.figures import (
    cluster_strip_svg,
    distance_svg,
    heatmap_svg,
    layer_map_svg,
    tradeoff_svg,
)

Row = Mapping[str, Any]
MLFLOW_UI = "http://127.0.0.1:5000"

CSS = """
body{font:14px/1.45 system-ui,sans-serif;margin:24px auto;max-width:1180px;color:#222;
padding:0 16px}
h1{font-size:22px}h2{font-size:17px;margin-top:28px;border-bottom:1px solid #ddd}
table{border-collapse:collapse;margin:8px 0;font-variant-numeric:tabular-nums}
th,td{border:1px solid #ddd;padding:3px 8px;text-align:right}th{background:#f4f4f4;cursor:pointer}
td.l,th.l{text-align:left}tr.dense td{font-style:italic;background:#fafafa}
figure{display:inline-block;margin:8px 16px 8px 0;vertical-align:top;max-width:560px}
figcaption{font-size:12px;color:#555;margin-top:4px}
.maps td{text-align:left}.filters{margin:8px 0}.filters label{margin-right:12px}
.muted{color:#777}a{color:#1b6ca8}
"""

# Sorting (click a header) and filtering (selects over data-* attributes), inline.
SCRIPT = """
document.querySelectorAll('table.sortable th').forEach((th, col) => {
  th.addEventListener('click', () => {
    const body = th.closest('table').tBodies[0];
    const rows = Array.from(body.rows);
    const asc = th.dataset.dir !== 'asc';
    th.dataset.dir = asc ? 'asc' : 'desc';
    const key = r => { const t = r.cells[col].dataset.v ?? r.cells[col].textContent;
                       const n = parseFloat(t); return isNaN(n) ? t : n; };
    rows.sort((a, b) => (key(a) > key(b) ? 1 : key(a) < key(b) ? -1 : 0) * (asc ? 1 : -1));
    rows.forEach(r => body.appendChild(r));
  });
});
function applyFilters() {
  const sel = {};
  const selects = document.querySelectorAll('select[data-filter]');
  selects.forEach(s => { sel[s.dataset.filter] = s.value; });
  document.querySelectorAll('tr[data-row]').forEach(tr => {
    const show = Object.entries(sel).every(
      ([k, v]) => v === '' || (tr.dataset[k] || '').split(' ').includes(v));
    tr.style.display = show ? '' : 'none';
  });
}
document.querySelectorAll('select[data-filter]').forEach(
  s => s.addEventListener('change', applyFilters));
"""


def _e(x: Any) -> str:
    return html.escape(str(x))


def _num(x: Any, digits: int = 2) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return '<span class="muted">-</span>'
    if isinstance(x, float):
        return f"{x:,.{digits}f}" if abs(x) < 1e5 else f"{x:.3g}"
    return _e(x)


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)


def _page(title: str, body: str) -> str:
    return (
        f"<!doctype html><html lang=en><head><meta charset=utf-8><title>{_e(title)}</title>"
        f"<style>{CSS}</style></head><body>{body}<script>{SCRIPT}</script></body></html>"
    )


def _figure(svg: str, caption: str) -> str:
    return f"<figure>{svg}<figcaption>{caption}</figcaption></figure>"


def load_S(row: Row) -> np.ndarray | None:
    from lorp import SimilarityStats

    path = row.get("stats_file")
    if path and Path(path).is_file():
        return SimilarityStats.from_file(path).matrix()
    return None


def ppl_metric(rows: Iterable[Row]) -> str | None:
    names = sorted({k for r in rows for k in r if k.startswith("ppl_") and r[k] is not None})
    return names[0] if names else None


# -- pages -------------------------------------------------------------------------------


def build_site(
    rows: Sequence[Row],
    out_dir: str | os.PathLike[str],
    *,
    mlflow_ui: str = MLFLOW_UI,
    experiment_ids: Mapping[str, str] | None = None,
) -> Path:
    """Write index.html and one page per model into `out_dir`; returns index.html."""
    if not rows:
        raise ValueError("the catalog is empty: nothing to show")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    by_model: dict[str, list[Row]] = defaultdict(list)
    for r in rows:
        by_model[r["model"]].append(r)
    S_of = {m: load_S(rs[0]) for m, rs in by_model.items()}
    profiles = {m: S for m, S in S_of.items() if S is not None}
    exp_ids = experiment_ids or {}
    for model, model_rows in by_model.items():
        page = model_page(model, model_rows, S_of[model], profiles, mlflow_ui, exp_ids)
        (out / f"model-{_slug(model)}.html").write_text(page)
    index = out / "index.html"
    index.write_text(overview_page(by_model, profiles, mlflow_ui, exp_ids))
    return index


def _mlflow_link(row: Row, mlflow_ui: str, exp_ids: Mapping[str, str]) -> str:
    run = row.get("mlflow_run_id")
    exp = exp_ids.get(row.get("job", ""))
    if not run or not exp:
        return ""
    return f'<a href="{mlflow_ui}/#/experiments/{exp}/runs/{run}">run</a>'


def overview_page(
    by_model: Mapping[str, list[Row]],
    profiles: Mapping[str, np.ndarray],
    mlflow_ui: str,
    exp_ids: Mapping[str, str],
) -> str:
    all_rows = [r for rs in by_model.values() for r in rs]
    metric = ppl_metric(all_rows)
    budgets = sorted({r["budget"] for r in all_rows if r["budget"]})
    families = sorted({r["family"] for r in all_rows})
    methods = sorted({r["method_label"] for r in all_rows if r["method"] != "dense"})
    head = "".join(f"<th>best @ {b} ({_e(metric or 'n/a')})</th>" for b in budgets)
    body = []
    for model, rs in sorted(by_model.items()):
        first = rs[0]
        cells = []
        for b in budgets:
            cands = [r for r in rs if r["budget"] == b]
            best = min(cands, key=lambda r: r.get(metric) or math.inf) if cands and metric else None
            cells.append(
                f'<td class=l data-v="{best.get(metric) if best else ""}">'
                + (f"{_e(best['method_label'])}: {_num(best.get(metric))}" if best else "-")
                + "</td>"
            )
        row_methods = " ".join(sorted({r["method_label"] for r in rs}))
        row_budgets = " ".join(str(r["budget"]) for r in rs)
        dense = next((r for r in rs if r["method"] == "dense"), None)
        body.append(
            f'<tr data-row data-family="{_e(first["family"])}" data-method="{_e(row_methods)}" '
            f'data-budget="{_e(row_budgets)}"><td class=l><a href="model-{_slug(model)}.html">'
            f"{_e(model)}</a></td><td class=l>{_e(first['family'])}</td>"
            f"<td>{first['n_blocks']}</td>"
            f"<td>{_num(first.get('rls'), 3)}</td><td>{_num(first.get('k'))}</td>"
            f'<td data-v="{dense.get(metric) if dense and metric else ""}">'
            f"{_num(dense.get(metric)) if dense and metric else '-'}</td>"
            + "".join(cells)
            + f"<td class=l>{_mlflow_link(dense or first, mlflow_ui, exp_ids)}</td></tr>"
        )

    def select(name: str, values: Iterable[Any]) -> str:
        opts = "".join(f'<option value="{_e(v)}">{_e(v)}</option>' for v in values)
        return (
            f'<label>{name} <select data-filter="{name}"><option value="">all</option>'
            f"{opts}</select></label>"
        )

    filters = select("family", families) + select("method", methods) + select("budget", budgets)
    table = (
        f'<table id="overview" class="sortable"><thead><tr><th class=l>model</th><th class=l>family'
        f"</th><th>N</th><th>RLS</th><th>K</th><th>dense {_e(metric or '')}</th>{head}"
        f"<th class=l>MLflow</th></tr></thead><tbody>{''.join(body)}</tbody></table>"
    )
    rls_rows = "".join(
        f"<tr><td class=l>{_e(m)}</td><td>{rs[0]['n_blocks']}</td>"
        f"<td>{_num(rs[0].get('rls'), 3)}</td><td>{_num(rs[0].get('k'))}</td></tr>"
        for m, rs in sorted(by_model.items())
    )
    figs = ""
    if profiles:
        figs = _figure(
            distance_svg(profiles),
            "Mean inter-layer cosine similarity against normalised layer distance (the paper's "
            "Fig. 2), from each model's calibration statistics S. Faster decay = more local "
            "redundancy = higher RLS.",
        )
    n_points = sum(1 for r in all_rows if r["method"] != "dense")
    return _page(
        "lorp fleet",
        f"<h1>lorp fleet: {len(by_model)} models, {n_points} pruned variants</h1>"
        f'<div class="filters">{filters}</div>{table}'
        f'<p class="muted">Best = lowest {_e(metric or "metric")} among the methods at that '
        "budget. Click a header to sort; MLflow links need "
        "<code>mlflow ui --host 127.0.0.1</code>.</p>"
        f"<h2>Representation Locality Score (Table 1)</h2><table class=sortable><thead><tr>"
        f"<th class=l>model</th><th>N</th><th>RLS</th><th>K</th></tr></thead><tbody>{rls_rows}"
        f"</tbody></table>{figs}",
    )


def model_page(
    model: str,
    rows: list[Row],
    S: np.ndarray | None,
    profiles: Mapping[str, np.ndarray],
    mlflow_ui: str,
    exp_ids: Mapping[str, str],
) -> str:
    first = rows[0]
    n = int(first["n_blocks"])
    dense = next((r for r in rows if r["method"] == "dense"), None)
    points = sorted(
        (r for r in rows if r["method"] != "dense"), key=lambda r: (r["method_label"], r["budget"])
    )
    parts = [
        '<p><a href="index.html">&larr; fleet</a></p>',
        f"<h1>{_e(model)}</h1><p>{_e(first['family'])}, N = {n} blocks, RLS = "
        f"{_num(first.get('rls'), 3)}, K = {_num(first.get('k'))}; fingerprint "
        f"<code>{_e(first['fingerprint'])}</code></p>",
    ]
    figs = []
    if S is not None:
        figs.append(_figure(heatmap_svg(S, model), (
            f"Inter-layer similarity S of {_e(model)} (the paper's Fig. 1): mean per-token cosine "
            "similarity between the residual-stream states entering blocks i and j, over the "
            "calibration set.")))  # fmt: skip
        figs.append(_figure(distance_svg(profiles, highlight=model), (
            "Mean similarity against normalised layer distance (Fig. 2); this model in bold, "
            "the rest of the fleet faint.")))  # fmt: skip
    parts.append("".join(figs))
    labels = _labels(rows, S)
    if labels:
        parts.append(
            "<h2>Clusters along depth</h2>"
            + _figure(
                cluster_strip_svg(labels),
                f"Spectral clustering of the {n} blocks on A = (S + 1) / 2 with "
                f"K = {max(labels) + 1}, labels numbered by first occurrence in depth; "
                "colour = cluster.",
            )
        )
    maps = "".join(
        f"<tr><td class=l>{_e(r['method_label'])}</td><td>{r['budget']}</td><td>"
        + layer_map_svg(n, r["pruned_layers"], "{}@{}".format(r["method_label"], r["budget"]))
        + f"</td><td class=l>{_e(', '.join(map(str, r['pruned_layers'])))}</td></tr>"
        for r in points
    )
    parts.append(
        "<h2>Pruned blocks (Fig. 4)</h2><table class=maps><thead><tr><th class=l>method</th>"
        f"<th>budget</th><th class=l>blocks 0..{n - 1} (red = removed)</th><th class=l>pruned</th>"
        f'</tr></thead><tbody>{maps}</tbody></table><p class="muted">Each row is one grid point: '
        "the blocks its method removed at that budget.</p>"
    )
    parts.append(_metric_tables(dense, points))
    parts.append(_tradeoffs(dense, points))
    links = "".join(
        f"<li>{_e(r['method_label'])} @ {r['budget']}: {_mlflow_link(r, mlflow_ui, exp_ids) or '-'}"
        f" <code>{_e(r.get('checkpoint') or '')}</code></li>"
        for r in points
    )
    parts.append(f"<h2>Runs and checkpoints</h2><ul>{links}</ul>")
    return _page(model, "".join(parts))


def _labels(rows: list[Row], S: np.ndarray | None) -> list[int] | None:
    """The model's clusters at its RLS-chosen K (what LoRP starts from)."""
    k = rows[0].get("k")
    if S is None or not k:
        return None
    from lorp import cluster_layers

    return cluster_layers(S, int(k)).tolist()


def _metric_tables(dense: Row | None, points: list[Row]) -> str:
    all_rows = ([dense] if dense else []) + points
    ppl = sorted({k for r in all_rows for k in r if k.startswith("ppl_")})
    acc = sorted({k for r in all_rows for k in r if k.startswith("acc_") and k != "acc_avg"})
    speed = [
        c
        for c in ("params", "latency_ms", "speedup", "peak_mem_gib")
        if any(r.get(c) is not None for r in all_rows)
    ]
    out = []

    def table(title: str, cols: list[str], caption: str) -> str:
        head = "".join(f"<th>{_e(c)}</th>" for c in cols)
        body = "".join(
            f'<tr class="{"dense" if r["method"] == "dense" else ""}">'
            f"<td class=l>{_e(r['method_label'])}</td><td>{r['budget']}/{r['n_blocks']}</td>"
            + "".join(f"<td>{_num(r.get(c))}</td>" for c in cols)
            + "</tr>"
            for r in all_rows
        )
        return (
            f"<h2>{title}</h2><table class=sortable><thead><tr><th class=l>method</th>"
            f"<th>L<sub>p</sub>/L<sub>t</sub></th>{head}</tr></thead><tbody>{body}</tbody></table>"
            f'<p class="muted">{caption}</p>'
        )

    if ppl:
        caption = (
            "Perplexity (lower is better) on each corpus's test split, non-overlapping "
            "windows; the dense row is the unpruned model."
        )
        out.append(table("Perplexity (Table 2 layout)", ppl, caption))
    if acc:
        cols = [*acc, "acc_avg"] if any("acc_avg" in r for r in all_rows) else acc
        caption = (
            "Accuracy (%) through lm-evaluation-harness: acc_norm where the task defines "
            "it, else acc; the dense row is the unpruned model."
        )
        out.append(table("Zero-shot accuracy (Table 3 layout)", cols, caption))
    if speed:
        caption = (
            "Parameters; prefill latency at batch 1 with the cache off (mean of timed runs "
            "after warm-ups); speed-up against the dense model measured back to back in one "
            "process; peak memory (CUDA peak, or process peak RSS on CPU)."
        )
        out.append(table("Size and speed (Appendix A)", speed, caption))
    return "".join(out)


def _tradeoffs(dense: Row | None, points: list[Row]) -> str:
    figs = []
    for quality in [
        k for k in ("ppl_ptb", "acc_avg") if any(r.get(k) is not None for r in points)
    ] or [ppl_metric(points)]:
        if quality is None:
            continue
        for cost, label in (("params", "parameters"), ("latency_ms", "prefill latency (ms)")):
            lines: dict[str, list[tuple[float, float]]] = defaultdict(list)
            for r in points:
                if r.get(cost) is not None and r.get(quality) is not None:
                    lines[r["method_label"]].append((float(r[cost]), float(r[quality])))
            if not lines:
                continue
            ylabel = (
                "perplexity " if quality.startswith("ppl") else "accuracy % "
            ) + f"({quality})"
            svg = tradeoff_svg(lines, label, ylabel, dense.get(quality) if dense else None)
            figs.append(_figure(svg, (
                f"Quality/cost trade-off: {_e(quality)} against {label}, one line per method over "
                "its budgets; dashed = dense model.")))  # fmt: skip
    return ("<h2>Trade-off</h2>" + "".join(figs)) if figs else ""


def experiment_ids(tracking_uri: str, rows: Sequence[Row]) -> dict[str, str]:
    """job -> MLflow experiment id, for run links (empty when the store is unreachable)."""
    try:
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri)
        out = {}
        for job in sorted({r["job"] for r in rows}):
            run_id = next(
                r["mlflow_run_id"] for r in rows if r["job"] == job and r.get("mlflow_run_id")
            )
            out[job] = client.get_run(run_id).info.experiment_id
        return out
    except Exception:  # links are a convenience: the site builds without them
        return {}
