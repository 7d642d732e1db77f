"""Figures for the fleet pages, after the paper's own, as inline SVG (no network at view time).

matplotlib renders the plots to SVG text; the layer maps are small hand-written SVGs so a
page holds one element per (method, budget) that a browser test can count.
"""

from __future__ import annotations

import html
import io
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from dashboards.markup import Markup, el

PALETTE = ["#1b6ca8", "#d1495b", "#2e933c", "#edae49", "#6a4c93", "#00798c", "#8c564b"]


def _plt():  # type: ignore[no-untyped-def]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({"svg.fonttype": "none", "font.size": 9})
    return plt


def _svg(fig) -> str:  # type: ignore[no-untyped-def]
    buf = io.StringIO()
    fig.savefig(buf, format="svg", bbox_inches="tight")
    _plt().close(fig)
    text = buf.getvalue()
    return text[text.index("<svg") :]  # drop the XML prolog: the SVG is inlined in HTML


def heatmap_svg(S: np.ndarray, title: str) -> str:
    """Fig. 1: the inter-layer similarity matrix S."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(4.0, 3.4))
    im = ax.imshow(S, cmap="viridis", vmin=min(0.0, float(S.min())), vmax=1.0)
    ax.set_xlabel("block j (input)")
    ax.set_ylabel("block i (input)")
    ax.set_title(title)
    fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04, label="mean token cosine")
    return _svg(fig)


def distance_profile(S: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Mean S over all pairs at each layer distance, against distance / (N - 1) (Fig. 2)."""
    n = S.shape[0]
    d = np.arange(1, n)
    return d / (n - 1), np.array([np.diagonal(S, offset=k).mean() for k in d])


def distance_svg(profiles: Mapping[str, np.ndarray], highlight: str | None = None) -> str:
    """Fig. 2: mean similarity against normalised layer distance, models overlaid."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(4.6, 3.2))
    for i, (name, S) in enumerate(profiles.items()):
        x, y = distance_profile(S)
        bold = highlight is None or name == highlight
        ax.plot(
            x,
            y,
            color=PALETTE[i % len(PALETTE)],
            lw=2.2 if bold else 1.0,
            alpha=1.0 if bold else 0.45,
            label=name,
        )
    ax.set_xlabel("normalised layer distance |i - j| / (N - 1)")
    ax.set_ylabel("mean cosine similarity")
    ax.set_ylim(top=1.0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, frameon=False)
    return _svg(fig)


# One point of a trade-off line: (cost, quality, error half-width or None, degraded).
TradeoffPoint = tuple[float, float, float | None, bool]


def _tradeoff_line(ax: Any, pts: Sequence[TradeoffPoint], color: str, label: str) -> None:
    pts = sorted(p for p in pts if np.isfinite(p[1]))
    if not pts:
        return
    x, y = [p[0] for p in pts], [p[1] for p in pts]
    err = [p[2] or 0.0 for p in pts]
    if any(p[2] is not None for p in pts):
        ax.errorbar(x, y, yerr=err, marker="o", color=color, capsize=3, label=label)
    else:
        ax.plot(x, y, marker="o", color=color, label=label)
    bad = [p for p in pts if p[3]]
    if bad:  # degraded variants: crossed out, so a figure never hides the quality gate
        ax.scatter(
            [p[0] for p in bad], [p[1] for p in bad], marker="x", s=80, color="black", zorder=3
        )


def tradeoff_svg(
    lines: Mapping[str, Sequence[TradeoffPoint]],
    xlabel: str,
    ylabel: str,
    dense: float | None,
    front: Sequence[Mapping[str, Any]] = (),
) -> str:
    """Quality against cost, one line per method (points sorted by cost); `front` (the
    Pareto front's points) drawn as grey steps with rings."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(4.6, 3.2))
    if front:
        fx, fy = [p["x"] for p in front], [p["y"] for p in front]
        ax.step(fx, fy, where="post", color="#888888", lw=3, alpha=0.5, label="Pareto front")
        ax.scatter(fx, fy, s=140, facecolors="none", edgecolors="#555555", zorder=4)
    for i, (method, pts) in enumerate(sorted(lines.items())):
        _tradeoff_line(ax, pts, PALETTE[i % len(PALETTE)], method)
    if dense is not None and np.isfinite(dense):
        ax.axhline(dense, color="black", ls="--", lw=1, label="dense")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if ylabel.startswith("perplexity"):
        ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, frameon=False)
    return _svg(fig)


def cluster_strip_svg(labels: Sequence[int], cell: int = 16) -> str:
    """Cluster label of every block along depth (one coloured cell per block)."""
    n = len(labels)
    cells = "".join(
        f'<rect x="{i * cell}" y="0" width="{cell - 1}" height="{cell}" '
        f'fill="{PALETTE[int(lab) % len(PALETTE)]}"><title>block {i}: cluster {lab}</title></rect>'
        f'<text x="{i * cell + cell / 2}" y="{cell + 11}" font-size="8" '
        f'text-anchor="middle">{i}</text>'
        for i, lab in enumerate(labels)
    )
    return f'<svg class="cluster-strip" width="{n * cell}" height="{cell + 14}">{cells}</svg>'


def layer_map_svg(
    n_blocks: int, pruned: Sequence[int], label: str, degraded: bool = False, cell: int = 14
) -> str:
    """Fig. 4: which blocks a (method, budget) removed, coloured cells on the depth axis.

    A degraded variant (failed the quality gate) gets a dashed outline and data-degraded.
    """
    drop = set(pruned)
    cells = "".join(
        f'<rect x="{i * cell}" y="0" width="{cell - 1}" height="{cell}" '
        f'fill="{"#d1495b" if i in drop else "#e6e6e6"}"><title>block {i}'
        f"{' (pruned)' if i in drop else ''}</title></rect>"
        for i in range(n_blocks)
    )
    if degraded:
        cells += (
            f'<rect x="0.5" y="0.5" width="{n_blocks * cell - 2}" height="{cell - 1}" '
            'fill="none" stroke="#b3263a" stroke-dasharray="3 2"><title>degraded</title></rect>'
        )
    return (
        f'<svg class="layer-map" data-label="{html.escape(label)}" data-pruned="{len(drop)}" '
        f'data-degraded="{str(degraded).lower()}" width="{n_blocks * cell}" height="{cell}">'
        f"{cells}</svg>"
    )


# -- the job's timeline (Gantt chart) ------------------------------------------------------

STAGE_COLOURS = {
    "load": "#8c8c8c",
    "capture": "#1b6ca8",
    "repair_sums": "#6a4c93",
    "losses": "#edae49",
    "point": "#2e933c",
    "speed": "#00798c",
    "prepare": "#8c564b",
    "gate": "#d1495b",
}
OTHER_STAGE = "#c7c7c7"
FAILED = "#b3263a"


@dataclass(frozen=True)
class Gantt:
    """Where a timeline's bars go: a label column, then `plot` px for the makespan; one
    row per worker, of as many lanes (`row_h` each) as its overlapping spans need."""

    makespan: float
    lanes: tuple[int, ...]
    """Lanes of each row."""
    label: float = 170.0
    plot: float = 880.0
    row_h: float = 18.0
    bar_h: float = 13.0
    axis_h: float = 28.0

    @property
    def scale(self) -> float:
        """px per second (a zero makespan is drawn as one second)."""
        return self.plot / (self.makespan if self.makespan > 0 else 1.0)

    def x(self, t: float) -> float:
        return self.label + t * self.scale

    def top(self, row: int) -> float:
        return sum(self.lanes[:row]) * self.row_h

    def y(self, row: int, lane: int = 0) -> float:
        return self.top(row) + lane * self.row_h + (self.row_h - self.bar_h) / 2

    @property
    def bottom(self) -> float:
        return sum(self.lanes) * self.row_h

    @property
    def width(self) -> float:
        return self.label + self.plot + 20.0

    @property
    def height(self) -> float:
        return self.bottom + self.axis_h


def stage_colour(stage: str) -> str:
    return STAGE_COLOURS.get(stage, OTHER_STAGE)


NICE_STEPS = (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 14400, 28800, 86400)


def time_ticks(makespan: float, most: int = 10) -> list[tuple[float, str]]:
    """Ticks 0, step, 2 step... over the makespan (at most `most`+1 of them), labelled in
    s, or in min from a 2-minute makespan on, or in h from 3 hours on."""
    span = makespan if makespan > 0 else 1.0
    unit, div = ("h", 3600.0) if span >= 3 * 3600 else ("min", 60.0) if span >= 120 else ("s", 1.0)
    floor = 0.0 if unit == "s" else div / 2  # ticks of at least 0.5 min, 0.5 h
    steps = [s for s in (0.01, 0.02, 0.05, 0.1, 0.2, 0.5, *NICE_STEPS) if s >= floor]
    step = next((s for s in steps if span / s <= most), span / most)
    count = int(span / step + 1e-9)
    return [(i * step, f"{i * step / div:.4g} {unit}") for i in range(count + 1)]


def _gantt_axis(g: Gantt) -> list[Markup]:
    top, bottom = 0.0, g.bottom
    out = [
        el("line", x1=g.label, x2=g.label + g.plot, y1=bottom, y2=bottom, stroke="#999"),
    ]
    for t, text in time_ticks(g.makespan):
        x = round(g.x(t), 2)
        out.append(el("line", x1=x, x2=x, y1=top, y2=bottom + 4, stroke="#e4e4e4"))
        out.append(
            el("text", text, x=x, y=bottom + 16, font_size=10, text_anchor="middle", class_="tick")
        )
    return out


def _gantt_rows(g: Gantt, rows: Sequence[Mapping[str, Any]]) -> list[Markup]:
    out = []
    for i, r in enumerate(rows):
        y, h = g.top(i), g.lanes[i] * g.row_h
        if i % 2:
            out.append(el("rect", x=0, y=y, width=g.label + g.plot, height=h, fill="#f7f7f7"))
        out.append(
            el(
                "text",
                el("title", f"{r['key']}: busy {r['busy']:.1f} s"),
                r["key"],
                x=g.label - 6,
                y=y + g.row_h - 5,
                font_size=11,
                text_anchor="end",
                class_="worker",
            )
        )
    return out


def gantt_bar(g: Gantt, bar: Mapping[str, Any]) -> list[Markup]:
    """One span: a rect where its times say (data-stage, data-row, data-start, data-end);
    a failed one outlined in red and hatched."""
    x, y = round(g.x(bar["start"]), 2), round(g.y(bar["row"], bar.get("lane", 0)), 2)
    w = round(max((bar["end"] - bar["start"]) * g.scale, 1.0), 2)
    failed = bar["failed"]
    rect = el(
        "rect",
        el("title", bar["tip"]),
        x=x,
        y=y,
        width=w,
        height=g.bar_h,
        fill=stage_colour(bar["stage"]),
        stroke=FAILED if failed else None,
        stroke_width=2 if failed else None,
        data_stage=bar["stage"],
        data_row=bar["row"],
        data_lane=bar.get("lane", 0),
        data_start=round(bar["start"], 3),
        data_end=round(bar["end"], 3),
        data_failed="true" if failed else None,
    )
    if not failed:
        return [rect]
    hatch = el(
        "rect", x=x, y=y, width=w, height=g.bar_h, fill="url(#gantt-failed)", pointer_events="none"
    )
    return [rect, hatch]


HATCH = el(
    "defs",
    el(
        "pattern",
        el("path", d="M0 6 L6 0", stroke=FAILED, stroke_width=1.5),
        id="gantt-failed",
        width=6,
        height=6,
        patternUnits="userSpaceOnUse",
    ),
)


def gantt_svg(tv: Mapping[str, Any]) -> Markup:
    """The timeline (`timeline_view`): one row per worker, one bar per span, time axis."""
    g = Gantt(tv["makespan"], tuple(r.get("lanes", 1) for r in tv["rows"]))
    bars = [part for b in tv["bars"] for part in gantt_bar(g, b)]
    return el(
        "svg",
        HATCH,
        _gantt_rows(g, tv["rows"]),
        _gantt_axis(g),
        bars,
        class_="gantt",
        width=round(g.width),
        height=round(g.height),
        viewBox=f"0 0 {round(g.width)} {round(g.height)}",
        data_bars=len(tv["bars"]),
        data_rows=len(tv["rows"]),
    )
