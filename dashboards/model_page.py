"""One model's page: S (Fig. 1), decay (Fig. 2), clusters, pruned-block maps (Fig. 4),
Tables 2-3 with the dense row, size and speed (Appendix A), the quality/cost trade-off."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np

from dashboards.components import (
    PM,
    SMALL_MARK,
    UNKNOWN_MARK,
    budget_td,
    degraded_badge,
    figure,
    interval_td,
    jobs_section,
    link,
    num,
    page,
    row_class,
    sortable,
    speed_tds,
    td,
    th,
    value_td,
    variant_td,
    version_link,
)
from dashboards.figures import (
    cluster_strip_svg,
    distance_svg,
    heatmap_svg,
    layer_map_svg,
    tradeoff_svg,
)
from dashboards.intervals import MIN_COMPARABLE_ITEMS
from dashboards.markup import Markup, el, frag
from dashboards.shapes import View


def header(mv: View) -> Markup:
    return frag(
        el("p", el("a", "\u2190 fleet", href="index.html")),
        el("h1", mv["model"]),
        el(
            "p",
            f"{mv['family']}, N = {mv['n_blocks']} blocks, RLS = ",
            "-" if mv["rls"] is None else f"{mv['rls']:.3f}",
            f", K = {mv['k'] or '-'}; fingerprint ",
            el("code", mv["fingerprint"]),
        ),
        el(
            "p",
            "Evaluation protocol ",
            el("code", mv["protocol"], data_protocol=mv["protocol"]),
            " (every figure on this page was measured under it); calibration ",
            el("code", mv["calibration_id"] or "-"),
            ".",
        ),
    )


def memory(mv: View) -> Markup | None:
    """The memory plan's line: held whole or streamed, per stage; why speed is absent."""
    m = mv.get("memory")
    if not m:
        return None
    parts = [el("span", s["text"], data_stage=s["stage"], data_mode=s["mode"]) for s in m["stages"]]
    joined = [x for i, p in enumerate(parts) for x in ([p] if i == 0 else ["; ", p])]
    skipped = [" Speed: ", m["speed_skipped"], "."] if m["speed_skipped"] else []
    return el("p", "Memory plan: ", *joined, ".", *skipped, class_="memory-plan")


S_CAPTION = (
    "Inter-layer similarity S of {model} (the paper's Fig. 1): mean per-token cosine "
    "similarity between the residual-stream states entering blocks i and j, over the "
    "calibration set."
)
DECAY_CAPTION = (
    "Mean similarity against normalised layer distance (Fig. 2); this model in bold, the "
    "rest of the fleet faint."
)


def s_figures(model: str, S: np.ndarray | None, profiles: Mapping[str, np.ndarray]) -> Markup:
    if S is None:
        return el("p", "No cached S for this model: no similarity figures.", class_="muted")
    return frag(
        figure(heatmap_svg(S, model), S_CAPTION.format(model=model)),
        figure(distance_svg(profiles, highlight=model), DECAY_CAPTION),
    )


def clusters(mv: View) -> Markup | None:
    labels = mv["labels"]
    if not labels:
        return None
    source = (
        "from the catalog"
        if mv["labels_source"] == "catalog"
        else "recomputed from S (the catalog has no labels)"
    )
    caption = (
        f"Spectral clustering of the {mv['n_blocks']} blocks on A = (S + 1) / 2 with "
        f"K = {max(labels) + 1}, labels numbered by first occurrence in depth, {source}; "
        "colour = cluster."
    )
    return frag(el("h2", "Clusters along depth"), figure(cluster_strip_svg(labels), caption))


def layer_maps(mv: View) -> Markup:
    n = mv["n_blocks"]
    rows = [
        el(
            "tr",
            variant_td(v),
            td(v["budget"]),
            td(Markup(layer_map_svg(n, v["pruned"], f"{v['label']}@{v['budget']}", v["degraded"]))),
            td(", ".join(map(str, v["pruned"])), left=True),
            class_=row_class(v),
        )
        for v in mv["variants"]
    ]
    head = [
        th("method", left=True),
        th("budget"),
        th(f"blocks 0..{n - 1} (red = removed)", left=True),
        th("pruned", left=True),
    ]
    table = el("table", el("thead", el("tr", head)), el("tbody", rows), class_="maps")
    note = "Each row is one grid point: the blocks its method removed at that budget."
    if any(v["degraded"] for v in mv["variants"]):
        note += " Degraded = failed the quality gate (dashed outline)."
    return frag(el("h2", "Pruned blocks (Fig. 4)"), table, el("p", note, class_="muted"))


def _variant_table(
    title: str,
    t: View,
    cells: Callable[[View], list[Markup]],
    extra_head: Sequence[Markup],
    caption: str,
) -> Markup:
    """One row per variant (dense first): method, L_p/L_t, then `cells` of that row."""
    head = [th("method", left=True), th("L", el("sub", "p"), "/L", el("sub", "t")), *extra_head]
    rows = [el("tr", variant_td(r), budget_td(r), cells(r), class_=row_class(r)) for r in t["rows"]]
    return frag(el("h2", title), sortable(head, rows), el("p", caption, class_="muted"))


def perplexity_table(t: View) -> Markup | None:
    if not t["ppl_cols"]:
        return None
    judged = t["judged_on"]
    gate = "judged" if judged else "ratio to dense"
    head = [th(c) for c in t["ppl_cols"]] + [th(c) for c in t["ratio_cols"]]
    head += [th(gate)] if t["ppl_ratio"] else []

    def cells(r: View) -> list[Markup]:
        ratio = [value_td(r["ppl_ratio"], 3)] if t["ppl_ratio"] else []
        return [value_td(x) for x in r["ppl"]] + [value_td(x, 3) for x in r["ratios"]] + ratio

    caption = (
        "Perplexity (lower is better) on each corpus's test split, non-overlapping windows; "
        "the dense row is the unpruned model."
    )
    if judged:
        caption += (
            " ratio_<corpus> = variant / dense perplexity there; judged = the ratio on the "
            "worst domain of the variant (each domain judged on text the variants were not "
            f"calibrated on where it has some: {'; '.join(judged)}), what the quality gate "
            "and best rank by."
        )
    elif t["ppl_ratio"]:
        caption += " Ratio = variant / dense perplexity on the first corpus."
    if any(r["degraded"] for r in t["rows"]):
        caption += " Rows marked degraded failed the quality gate."
    if any(r["fits_calibration_only"] for r in t["rows"]):
        caption += (
            " Rows marked fits calibration only are over 1.5x worse, relative to dense, on "
            "held-out text than on their calibration text: good only in-distribution."
        )
    return _variant_table("Perplexity (Table 2 layout)", t, cells, head, caption)


def repair_caption(metric: str, dense: float | None) -> str:
    """What the repair table's columns mean, on `metric` (dense's figure when known)."""
    caption = (
        "Each repaired variant beside its unrepaired twin (same blocks removed): one linear "
        "map per run of removed blocks (and per follower block), fitted in closed form on the "
        "calibration tokens, trained towards the dense model's next-token distribution where "
        "the job distils, and folded into the weights, so both have the same architecture "
        f"and size. Perplexity on {metric.removeprefix('ppl_')}; gain = pruned / repaired "
        "perplexity; residual = the worst run's share of its gap the map leaves on "
        "calibration tokens (0: closed, 1: as pruned); kept = the maps that beat the "
        "unrepaired ones on held-out calibration windows, and the distillation epoch kept."
    )
    if dense is not None:
        caption += f" Dense: {dense:,.2f}."
    return caption


def repair_table(mv: View) -> Markup | None:
    """Pruned vs repaired, side by side: what the linear repair bought each variant."""
    pairs, metric = mv["repairs"], mv["repair_metric"]
    if not pairs or not metric:
        return None
    head = [
        th("method", left=True),
        th("L", el("sub", "p"), "/L", el("sub", "t")),
        th(f"pruned {metric}"),
        th(f"repaired {metric}"),
        th("gain"),
        th("residual"),
        th("kept", left=True),
    ]

    def verdict(value: float | None, degraded: bool | None) -> Markup:
        if not degraded:
            return value_td(value)
        badge = el("span", "degraded", class_="badge degraded", title="failed the quality gate")
        return td(num(value), " ", badge, data_v="" if value is None else value)

    rows = [
        el(
            "tr",
            td(f"{v['label']} +{v['repair']}", left=True),
            td(f"{v['budget']}/{v['n_blocks']}"),
            verdict(v["pruned"], v["pruned_degraded"]),
            verdict(v["repaired"], v["repaired_degraded"]),
            value_td(v["gain"], 2),
            value_td(v["residual"], 3),
            td(v["kept"] or "-", left=True, cls="kept"),
            class_="repair-pair",
        )
        for v in pairs
    ]
    caption = repair_caption(metric, mv["dense_metric"])
    return frag(
        el("h2", "Pruned vs repaired"), sortable(head, rows), el("p", caption, class_="muted")
    )


def domain_table(mv: View) -> Markup | None:
    """Each variant's ratio to dense on every domain, pruned and repaired side by side."""
    dv = mv.get("domains")
    if not dv:
        return None
    head = [th("method", left=True), th("L", el("sub", "p"), "/L", el("sub", "t"))]
    for d in dv["domains"]:
        head += [th(f"{d} pruned"), th(f"{d} repaired")]
    head += [th("worst", left=True), th("repair gate", left=True)]
    rows = []
    for v in dv["rows"]:
        cells = [td(v["label"], left=True), td(f"{v['budget']}/{v['n_blocks']}")]
        for before, after in zip(v["pruned"], v["repaired"], strict=True):
            cells += [value_td(before, 3), value_td(after, 3)]
        cells += [td(v["worst"] or "-", left=True), td(v["gate"] or "-", left=True)]
        rows.append(el("tr", *cells, class_="domain-row"))
    caption = (
        "Perplexity over dense's on each domain the job judged (prose: held-out text "
        "where there is some; code: the code corpus's test files), each variant beside its "
        "repaired twin. worst = the domain the quality gate judged the variant by; repair "
        "gate = the maps kept after checking the repaired variant's held-out loss on every "
        "calibration domain against its unrepaired twin's (unrepaired: none were kept)."
    )
    return frag(
        el("h2", "Quality per domain"), sortable(head, rows), el("p", caption, class_="muted")
    )


def accuracy_table(t: View) -> Markup | None:
    if not t["acc_cols"]:
        return None
    head = [th(f"acc_{c}") for c in t["acc_cols"]]
    caption = (
        f"Accuracy (%) through lm-evaluation-harness (acc_norm where the task defines it, "
        f"else acc), {PM} 1.96 binomial standard errors, SE = sqrt(p (1 - p) / n); acc_avg "
        f"combines the tasks' errors as independent. {SMALL_MARK} under "
        f"{MIN_COMPARABLE_ITEMS} items: not comparable to the paper. {UNKNOWN_MARK} items "
        "unknown (no n_<task> in the catalog): no interval. The dense row is the unpruned model."
    )

    def cells(r: View) -> list[Markup]:
        return [interval_td(iv) for iv in r["acc"]]

    return _variant_table("Zero-shot accuracy (Table 3 layout)", t, cells, head, caption)


def speed_table(t: View) -> Markup | None:
    if not t["size_cols"] and not t["speed"]:
        return None
    head = [th(c) for c in t["size_cols"]]
    if t["speed"]:
        head += [th(f"speedup {PM} 95% half-width"), th("bound N/(N-k)")]

    def cells(r: View) -> list[Markup]:
        return [value_td(x) for x in r["size"]] + (speed_tds(r["speed"]) if t["speed"] else [])

    caption = (
        "Parameters; weight bytes at the serving dtype and KV-cache bytes per token, counted "
        "from the config; predicted speed-ups (predicted_*: dense over variant of the "
        "prefill FLOPs per token, compute-bound, and of the bytes one decoded token reads, "
        "memory-bound, at the job's sequence length): predictions from the config, not "
        "timings. Prefill latency at batch 1 with the cache off (the median of rounds "
        "that time dense and every variant alternately in one process on a whole node, "
        "after the grid); speed-up = the median of each round's dense / variant ratio, "
        f"{PM} the half-width of its distribution-free 95% interval; bound = N/(N-k), the "
        "most that removing k of N equal blocks can give (embedding and head make the real "
        "bound lower). A speed-up is published only once that interval's half-width is "
        "within the job's speed_half_width (2% unless set) and "
        "the ratio between 0.97 and 5% above the bound; otherwise it reads "
        "\u2018not resolved\u2019, the measured ratio in small text, and it is not sorted by "
        "or plotted. A published speed-up more than 5% above the bound (older catalogs) is "
        "flagged \u2018above bound\u2019: timing noise or a fault, not a result. Serving "
        "(serve_*, vLLM only): output tokens/s, median time to first token and per output "
        "token at the job's concurrency, and the speed-up in output tokens/s over dense "
        "(blank where not resolved). Peak memory: "
        "the variant's own peak, measured in a fresh process (CUDA peak on GPU, resident "
        "high-water mark on CPU)."
    )
    return _variant_table("Size and speed (Appendix A)", t, cells, head, caption)


def tradeoff_figures(mv: View) -> Markup | None:
    figs = []
    for f in mv["tradeoffs"]:
        pts = [p for line in f["lines"].values() for p in line]
        caption = (
            f"Quality/cost trade-off: {f['quality']} against {f['xlabel']}, one line per "
            "method over its budgets (a sub-layer method's label names its granularity: "
            "shortgpt-attention); dashed = dense model."
        )
        if any(p[2] is not None for p in pts):
            caption += " Error bars: 95% intervals."
        if any(p[3] for p in pts):
            caption += " Crossed = degraded (failed the quality gate)."
        caption += " Grey steps and rings = the Pareto front (nothing is both cheaper and better)."
        svg = tradeoff_svg(f["lines"], f["xlabel"], f["ylabel"], f["dense"], f["front"])
        front = ", ".join(f"{p['label']} ({p['x']:.6g}, {p['y']:.4f})" for p in f["front"])
        figs.append(figure(svg, caption))
        figs.append(
            el(
                "p",
                f"Pareto front ({f['quality']} vs {f['cost']}): {front or 'none'}",
                class_="front",
                data_front=f"{f['quality']}:{f['cost']}",
            )
        )
    return frag(el("h2", "Trade-off"), figs) if figs else None


def runs(mv: View) -> Markup:
    items = [
        el(
            "li",
            f"{v['label']} @ {v['budget']}: ",
            link(v["run_url"], "run"),
            version_link(v),
            " ",
            el("code", v["checkpoint"]),
            degraded_badge(v),
        )
        for v in mv["variants"]
    ]
    return frag(el("h2", "Runs and checkpoints"), el("ul", items))


def model_page(mv: View, S: np.ndarray | None, profiles: Mapping[str, np.ndarray]) -> str:
    """The whole page of one model from `model_view.model_view` and its S."""
    t = mv["tables"]
    return page(
        mv["model"],
        header(mv),
        memory(mv),
        s_figures(mv["model"], S, profiles),
        clusters(mv),
        layer_maps(mv),
        perplexity_table(t),
        repair_table(mv),
        domain_table(mv),
        accuracy_table(t),
        speed_table(t),
        tradeoff_figures(mv),
        runs(mv),
        jobs_section(mv["jobs"]),
    )
