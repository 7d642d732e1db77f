"""Figures for the fleet pages, after the paper's own, as inline SVG (no network at view time).

matplotlib renders the plots to SVG text; the layer maps are small hand-written SVGs so a
page holds one element per (method, budget) that a browser test can count.
"""

from __future__ import annotations

import html
import io
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

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
        ax.plot(x, y, color=PALETTE[i % len(PALETTE)], lw=2.2 if bold else 1.0,
                alpha=1.0 if bold else 0.45, label=name)  # fmt: skip
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
        ax.scatter([p[0] for p in bad], [p[1] for p in bad], marker="x", s=80, color="black",
                   zorder=3)  # fmt: skip


def tradeoff_svg(
    lines: Mapping[str, Sequence[TradeoffPoint]],
    xlabel: str,
    ylabel: str,
    dense: float | None,
) -> str:
    """Quality against cost, one line per method (points sorted by cost)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(4.6, 3.2))
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
