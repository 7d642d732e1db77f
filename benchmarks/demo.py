"""What `make demo` measured, as the results page `docs/results/demo.md`: per model, every
variant's held-out and PTB perplexity against dense, pruned and repaired, its prefill
speed-up with its 95% interval beside the bound N/(N-k), its peak memory and what it
takes on disk; then the run's wall time, busy slots and footprint, and every point's
worker memory against what the plan said it would need.

    rm -rf runs/demo && time make demo
    python benchmarks/demo.py --run runs/demo --page docs/results/demo.md --wall "9 min 12 s"

It reads the run's catalog and events only; it runs nothing.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.pages import by_model, cpu_line, markers, replace_section  # noqa: E402
from lorp.models.variant_manifest import variant_bytes  # noqa: E402  (a directory's bytes)

BEGIN, END = markers("demo")
GATE = "lee"
"""The corpus the quality gate judges on in the demo: the held-out news."""


def gib(n: float) -> str:
    """Bytes in the unit that shows them: GiB, MiB or KiB."""
    if n >= 2**30:
        return f"{n / 2**30:.2f} GiB"
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def ratio(row: Mapping[str, Any], dense: Mapping[str, Any], corpus: str) -> float:
    return float(row[f"ppl_{corpus}"]) / float(dense[f"ppl_{corpus}"])


def speed_cell(row: Mapping[str, Any]) -> str:
    """The published speed-up with its interval, or what was measured when unresolved."""
    sp, lo, hi = (row.get(k) for k in ("speedup", "speedup_low", "speedup_high"))
    if sp is not None and not math.isnan(sp):
        return f"{sp:.3f} [{lo:.3f}, {hi:.3f}]"
    measured = row.get("speedup_measured")
    if measured is None or math.isnan(measured):
        return "not timed"
    return f"unresolved ({measured:.3f} [{lo:.3f}, {hi:.3f}])"


def blocks(layers: Sequence[int]) -> str:
    """Block indices as runs: 3 9-11."""
    out: list[str] = []
    for b in sorted(layers):
        if out and out[-1].split("-")[-1] == str(b - 1):
            out[-1] = f"{out[-1].split('-')[0]}-{b}"
        else:
            out.append(str(b))
    return " ".join(out)


def model_table(rows: Sequence[Mapping[str, Any]], run: Path | None) -> list[str]:
    """One model's variants: a line per (budget, method), pruned and repaired side by side."""
    dense = next(r for r in rows if r["method"] == "dense")
    n = int(dense["n_blocks"])
    code = dense.get("ppl_code") is not None  # judged on code too (docs: Domains)
    head = [
        f"| method | blocks removed | {GATE} x dense: pruned | repaired | PTB x dense: pruned "
        "| repaired | "
        + ("code x dense: pruned | repaired | " if code else "")
        + "speed-up [95% interval] | N/(N-k) | peak memory GiB | stored: pruned | repaired |",
        "| --- " * (13 if code else 11) + "|",
        f"| dense | - | 1 ({dense[f'ppl_{GATE}']:.1f}) | - | 1 ({dense['ppl_ptb']:.1f}) | - | "
        + (f"1 ({dense['ppl_code']:.2f}) | - | " if code else "")
        + f"1 | 1 | {dense.get('peak_mem_gib') or math.nan:.3f} | - | - |",
    ]
    twins: dict[tuple[int, str], dict[str, Mapping[str, Any]]] = {}
    for r in rows:
        if r["method"] != "dense":
            twins.setdefault((int(r["budget"]), r["method"]), {})[r["repair"]] = r
    lines = []
    for (budget, method), pair in sorted(twins.items()):
        base = pair.get("none") or pair["linear"]
        rep = pair.get("linear")

        def fig(r: Mapping[str, Any] | None, corpus: str) -> str:
            if r is None:
                return "-"
            text = f"{ratio(r, dense, corpus):.2f}"
            gate = r.get("worst_domain") == "code" if code else False
            judged = corpus == ("code" if gate else GATE)
            return f"{text} (degraded)" if judged and r.get("degraded") else text

        def stored(r: Mapping[str, Any] | None) -> str:
            if r is None or not r.get("checkpoint") or run is None:
                return "-"
            path = Path(r["checkpoint"])
            return gib(variant_bytes(path)) if path.is_dir() else "-"

        codes = f"| {fig(pair.get('none'), 'code')} | {fig(rep, 'code')} " if code else ""
        lines.append(
            f"| {method} | {blocks(base['pruned_layers'])} | {fig(pair.get('none'), GATE)} "
            f"| {fig(rep, GATE)} | {fig(pair.get('none'), 'ptb')} | {fig(rep, 'ptb')} {codes}"
            f"| {speed_cell(base)} | {n / (n - budget):.3f} "
            f"| {base.get('peak_mem_gib') or math.nan:.3f} | {stored(pair.get('none'))} "
            f"| {stored(rep)} |"
        )
    return head + lines


def summary(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """Counts the issue's targets are judged by: resolved speed-ups, a passing variant
    per model and budget, the largest budget's share of blocks."""
    pruned = [r for r in rows if r["method"] != "dense"]
    resolved = [r for r in pruned if r.get("speed_resolved") == 1.0]
    out = [f"- speed-ups published: {len(resolved)} of {len(pruned)} pruned variants"]
    over = [
        r["speedup"] / (r["n_blocks"] / (r["n_blocks"] - r["budget"]))
        for r in resolved
        if r["speedup"] > r["n_blocks"] / (r["n_blocks"] - r["budget"])
    ]
    if over:
        out.append(
            f"- above the bound N/(N-k): {len(over)} of {len(resolved)} published, by at most "
            f"{max(over) - 1:.1%} (the rule allows 5%: more is a broken timing)"
        )
    for model in sorted({r["model"] for r in rows}):
        mine = [r for r in pruned if r["model"] == model]
        n = int(mine[0]["n_blocks"]) if mine else 0
        for budget in sorted({int(r["budget"]) for r in mine}):
            ok = [r for r in mine if int(r["budget"]) == budget and not r.get("degraded")]
            dense = next(r for r in rows if r["model"] == model and r["method"] == "dense")
            best = min(ok, key=lambda r: _judged(r, dense), default=None)
            text = "none (all degraded)"
            if best is not None and best.get("worst_domain"):
                text = (
                    f"{best['method_label']} at {_judged(best, dense):.2f}x dense on its "
                    f"worst domain ({best['worst_domain']}; {GATE} "
                    f"{ratio(best, dense, GATE):.2f}x)"
                )
            elif best is not None:
                text = f"{best['method_label']} at {ratio(best, dense, GATE):.2f}x dense on {GATE}"
            out.append(
                f"- {model}, {budget} of {n} blocks ({budget / n:.0%}): {len(ok)} of "
                f"{sum(1 for r in mine if int(r['budget']) == budget)} variants pass the "
                f"gate; best {text}"
            )
    return out


def _judged(row: Mapping[str, Any], dense: Mapping[str, Any]) -> float:
    """What the gate judged a row by: its worst domain's ratio, else its ratio on `lee`."""
    worst = row.get("worst_domain_ratio")
    return float(worst) if worst is not None else ratio(row, dense, GATE)


def memory_lines(events: Sequence[Mapping[str, Any]]) -> list[str]:
    """Per model, the points' worker peaks against the plan's `evaluate` need (their
    `point` events' `peak_gib` and `planned_gib`; an unrepaired point's plan is the
    smaller): the plan is an upper bound or it is wrong, so the page says which."""
    lines = []
    points = [e for e in events if e.get("event") == "point" and e.get("planned_gib")]
    for model in sorted({e["model"] for e in points}):
        mine = [e for e in points if e["model"] == model]
        ratios = [e["peak_gib"] / e["planned_gib"] for e in mine]
        over = [
            f"{_point_label(e)} by {r - 1:.1%}" for e, r in zip(mine, ratios, strict=True) if r > 1
        ]
        plans = sorted({f"{e['planned_gib']:.2f}" for e in mine}, key=float)
        lines.append(
            f"- {model}: points' peak memory {min(e['peak_gib'] for e in mine):.2f}-"
            f"{max(e['peak_gib'] for e in mine):.2f} GiB against {' and '.join(plans)} "
            f"planned ({min(ratios):.1%}-{max(ratios):.1%} of the plan; "
            + (
                f"{len(over)} of {len(mine)} over it: {', '.join(over)})"
                if over
                else f"none of {len(mine)} over it)"
            )
        )
    return lines


def _point_label(event: Mapping[str, Any]) -> str:
    """A point event's variant as the run's log names it: `dense`, `lorp-b3`."""
    method = event.get("method", "?")
    return method if method == "dense" else f"{method}-b{event.get('budget', '?')}"


def render(rows: Sequence[Mapping[str, Any]], run: Path | None, wall: str | None) -> str:
    from pipeline.events.log import read_events
    from pipeline.events.timeline import summarise

    parts = [
        "Reproduce: `rm -rf runs/demo && time make demo`, then `python benchmarks/demo.py "
        "--run runs/demo --page docs/results/demo.md --wall '<the time>'`. x dense: the "
        f"variant's perplexity over the dense model's (`{GATE}`, held-out news; PTB test, a "
        "calibration corpus's other split; `code`, the code corpus's test files), windows of "
        "256 tokens; the gate judges each variant by its worst domain (prose: lee; code). "
        "Speed-up: batch-1 prefill of 256 tokens, the median of paired dense/variant "
        "ratios with its distribution-free 95% interval, published when its half-width is "
        "within the spec's `speed_half_width` and the figure lies in 0.97-1.05 x N/(N-k); a "
        "repaired twin has its pruned twin's speed (the same shapes). Stored: the variant's "
        "directory (`checkpoints: manifest`: its base by reference and the tensors "
        "its repair changed).",
        "",
    ]
    if run is not None:
        util = summarise(read_events(run / "events.jsonl"))
        line = f"Run: {wall or 'wall time not given'}"
        if util is not None:
            line += (
                f"; its latest attempt kept {util.busy / util.makespan / util.slots:.0%} of "
                f"{util.slots:g} {util.kind} slots busy over {util.makespan:.0f} s"
            )
        parts += [line + f"; `runs/demo` takes {gib(variant_bytes(run))} on disk.", ""]
        parts += [f"Machine: {cpu_line()} (read where this page was written).", ""]
        parts += memory_lines(read_events(run / "events.jsonl"))
    parts += summary(rows) + [""]
    for model, mine in by_model(rows).items():
        n = int(mine[0]["n_blocks"])
        dtype = mine[0].get("dtype", "")
        parts += [f"**{model}** (N = {n}, {dtype})", ""]
        parts += model_table(mine, run) + [""]
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", type=Path, default=Path("runs/demo"), help="the demo's output_dir")
    ap.add_argument("--page", type=Path, help="write the section into this results page")
    ap.add_argument("--wall", help="the wall time `time make demo` printed, as text")
    args = ap.parse_args(argv)
    from pipeline.catalog.table import read_catalog

    rows = read_catalog(args.run / "catalog")
    if not rows:
        print(f"--run {str(args.run)!r}: no catalog rows (run `make demo` first)", file=sys.stderr)
        return 2
    text = render(rows, args.run, args.wall)
    print(text)
    if args.page:
        title = "# What `make demo` measured\n"
        replace_section(args.page, BEGIN, END, text, "The latest run", title)
    return 0


if __name__ == "__main__":
    sys.exit(main())
