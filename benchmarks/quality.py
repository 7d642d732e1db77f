"""The quality report: the paper's Table 2 for the models we can run, through `lorp run`.

    python benchmarks/quality.py [--models smollm2-135m ...] [--page docs/results/quality.md]
    python benchmarks/quality.py --bos-check      # Gemma 3 dense PTB perplexity, BOS on/off
    python benchmarks/quality.py --from-catalog runs/quality/catalog [--page ...]

It runs `jobs/quality.yaml` (optionally restricted to some models) with the product's own
driver, then renders one table per model from the catalog: PTB test perplexity at each
budget for every method, the dense row, the best non-degraded variant per budget in bold,
degraded variants marked, and each method's candidate evaluations and selection time. A
rerun resumes: finished points are skipped, S and loss-guided selections come from the
caches.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.pages import by_model, markers, replace_section, rule  # noqa: E402
from pipeline.catalog.table import read_catalog  # noqa: E402

BEGIN, END = markers("quality")
REPAIR_BEGIN, REPAIR_END = markers("quality-repair")
PAPER_METHODS = ("lorp", "shortgpt", "streamline")
# Methods that decide from S (one calibration pass), against which `lorp-loss` is held.
ONE_PASS = ("lorp", "lorp-released", "lorp-stage2", "shortgpt", "streamline", "angular")
SLEB_SLACK = 1.25  # lorp-loss should be within this factor of SLEB's perplexity


def run(models: list[str] | None, methods: list[str] | None = None) -> Path:
    import dataclasses

    from pipeline.cli import talk
    from pipeline.driver.run import run_job
    from pipeline.spec.parse import load_spec

    spec = load_spec(ROOT / "jobs" / "quality.yaml")
    if models:
        keep = tuple(m for m in spec.models if m.label in models)
        if not keep:
            raise SystemExit(f"--models: none of {models} is in jobs/quality.yaml")
        spec = dataclasses.replace(spec, models=keep)
    if methods:
        chosen = tuple(m for m in spec.methods if m.key in methods)
        if not chosen:
            raise SystemExit(f"--methods: none of {methods} is in jobs/quality.yaml")
        spec = dataclasses.replace(spec, methods=chosen)
    talk(False)
    summary = run_job(spec)
    return summary.catalog


def _ppl(row: dict[str, Any]) -> float:
    value = row.get("ppl_ptb")
    return float(value) if value is not None else math.nan


def _judged(row: dict[str, Any]) -> float:
    """What ranks a row: its gate ratio (held-out, `ppl_ratio`), else its PTB perplexity."""
    value = row.get("ppl_ratio") if row.get("judged_on") else None
    return float(value) if value is not None else _ppl(row)


def model_table(rows: list[dict[str, Any]]) -> list[str]:
    """One model's Table 2: methods x budgets, best per budget bold (the best non-degraded
    one, or the least bad where every variant is degraded), degraded marked."""
    budgets = sorted({r["budget"] for r in rows if r["budget"]})
    dense = next((r for r in rows if r["method"] == "dense"), None)
    by = defaultdict(dict)
    for r in rows:
        if r["budget"]:
            by[r["method_label"]][r["budget"]] = r
    best = {}  # the lowest non-degraded variant per budget; where all are degraded, the lowest
    for b in budgets:
        at = [by[m][b] for m in by if b in by[m]]
        usable = [r for r in at if not r.get("degraded")]
        best[b] = min(usable or at, key=_ppl, default=None)
    head = "| method | " + " | ".join(f"{b} blocks: pruned | PPL" for b in budgets)
    lines = [head + " | evaluations | selection s |"]
    lines.append(rule(2 * len(budgets) + 3))
    if dense:
        cells = " | ".join(f"- | {_ppl(dense):,.1f}" for _ in budgets)
        lines.append(f"| dense | {cells} | - | - |")
    for label in sorted(by, key=lambda m: min(_ppl(r) for r in by[m].values())):
        cells, evals, secs = [], 0.0, 0.0
        for b in budgets:
            r = by[label].get(b)
            if r is None:
                cells.append("- | -")
                continue
            figure = f"{_ppl(r):,.1f}"
            figure = f"**{figure}**" if best[b] is r else figure
            figure += " (degraded)" if r.get("degraded") else ""
            cells.append(f"{' '.join(str(x) for x in r['pruned_layers'])} | {figure}")
            evals += r.get("n_evals") or 0
            secs += r.get("select_s") or 0
        lines.append(f"| {label} | {' | '.join(cells)} | {int(evals)} | {secs:.1f} |")
    return lines


def repair_table(rows: list[dict[str, Any]]) -> list[str]:
    """One model's variants pruned and repaired side by side: per budget the blocks
    removed, the pruned perplexity and the repaired one (x dense), best repaired bold."""
    budgets = sorted({r["budget"] for r in rows if r["budget"]})
    dense = next((_ppl(r) for r in rows if r["method"] == "dense"), math.nan)
    by: dict[str, dict[int, dict[str, dict[str, Any]]]] = defaultdict(lambda: defaultdict(dict))
    for r in rows:
        if r["budget"]:
            by[r["method_label"].split("+")[0]][r["budget"]][r.get("repair") or "none"] = r
    best = {  # the gate's figure where rows have it (held-out), else PTB
        b: min((by[m][b]["linear"] for m in by if "linear" in by[m][b]), key=_judged, default=None)
        for b in budgets
    }
    head = "| method | " + " | ".join(
        f"{b} blocks: removed | pruned | repaired (x dense)" for b in budgets
    )
    lines = [head + " |", rule(3 * len(budgets) + 1)]
    lines.append(f"| dense | {' | '.join(f'- | {dense:,.1f} | -' for _ in budgets)} |")

    def fig(r: dict[str, Any] | None, bold: bool = False, ratio: bool = False) -> str:
        if r is None:
            return "-"
        text = f"{_ppl(r):,.1f}" + (f" ({_ppl(r) / dense:.2f}x)" if ratio else "")
        held = r.get("ratio_lee")
        if ratio and held is not None:  # the held-out news beside PTB
            text += f"; lee {float(held):.2f}x"
        text = f"**{text}**" if bold else text
        marks = [m.replace("_", " ") for m in ("degraded", "fits_calibration_only") if r.get(m)]
        if ratio and not followers(r):  # a cut at the end has none; an older run had none
            marks.append("no follower")
        if ratio and distilled(r):
            marks.append("distilled")
        return text + "".join(f" ({m})" for m in marks)

    order = sorted(
        by, key=lambda m: min(_ppl(v.get("linear") or v["none"]) for v in by[m].values() if v)
    )
    for method in order:
        cells = []
        for b in budgets:
            pair = by[method].get(b, {})
            some = pair.get("none") or pair.get("linear")
            removed = " ".join(str(x) for x in some["pruned_layers"]) if some else "-"
            fixed = pair.get("linear")
            cells += [removed, fig(pair.get("none")), fig(fixed, fixed is best[b], True)]
        lines.append(f"| {method} | {' | '.join(cells)} |")
    return lines


def latest(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per variant (model, label, budget): the newest. A rerun under a changed
    repair setting (followers) gives the repaired points new keys; the catalog keeps the
    earlier rows beside them, and the report is the latest run's."""
    newest: dict[tuple[Any, ...], dict[str, Any]] = {}
    for r in rows:
        key = (r["model"], r["method_label"], r["budget"])
        if key not in newest or str(r.get("created_at")) > str(newest[key].get("created_at")):
            newest[key] = r
    return list(newest.values())


def distilled(row: dict[str, Any]) -> bool:
    """Whether a repaired row's maps are the distilled ones (`lorp.repair.distill`)."""
    fits = json.loads(row.get("repair_fits") or "[]")
    return any(f.get("kept") == "distilled" for f in fits)


def followers(row: dict[str, Any]) -> int:
    """How many follower maps a repaired row's variant folded (`repair_fits`)."""
    return sum("follower" in f for f in json.loads(row.get("repair_fits") or "[]"))


def render_repair(
    catalog: Path, models: list[str] | None = None, methods: list[str] | None = None
) -> str:
    rows = latest([r for r in read_catalog(catalog) if shown(r, models, methods)])
    if not any((r.get("repair") or "none") != "none" for r in rows):
        raise SystemExit(f"no repaired variants in {catalog}")
    parts = [
        "Reproduce: `python benchmarks/quality.py --methods lorp shortgpt streamline window "
        "window-loss --section repair --page docs/results/quality-repair.md` "
        "(`jobs/quality.yaml`, `repair: [none, linear]`, through `lorp run`; the repair's sums "
        "from the same calibration tokens as S, one pass on the capture workers, fitted on "
        "dense inputs, the ridge chosen on the held-out calibration windows, one follower map "
        "per cut: `repair_followers`; the twins of streamline and window distilled 2 epochs: "
        "`repair_distill`). Ratios to dense on PTB and on the held-out news (lee); bold: the "
        "best repaired variant by the held-out ratio; `no follower`: a repaired variant without"
        " a follower map (its cut ends the stack, or its row is from a run before followers); "
        "`distilled`: its maps distilled (an epoch beat least squares on the held-out windows).",
        "",
    ]
    return _per_model(parts, rows, repair_table, repair_findings)


def repair_findings(rows: list[dict[str, Any]]) -> list[str]:
    """Per budget: the best repaired variant by the gate's (held-out) ratio, against
    dense on both corpora, and the repaired LoRP's gate verdict on that ratio."""
    dense = next((_ppl(r) for r in rows if r["method"] == "dense"), math.nan)
    out = []
    for b in sorted({r["budget"] for r in rows if r["budget"]}):
        fixed = [r for r in rows if r["budget"] == b and (r.get("repair") or "none") != "none"]
        if not fixed or not math.isfinite(dense):
            continue
        best = min(fixed, key=_judged)
        plain = {r["method_label"]: _ppl(r) for r in rows if r["budget"] == b}
        gains = [
            plain[r["method_label"].split("+")[0]] / _ppl(r)
            for r in fixed
            if r["method_label"].split("+")[0] in plain
        ]
        line = (
            f"at {b} blocks the best repaired variant is {best['method_label']}: "
            f"{_both(best, dense)}; repair divides PTB perplexity by "
            f"{min(gains):.2f}-{max(gains):.2f}x"
            if gains
            else ""
        )
        lorp = next((r for r in fixed if r["method_label"] == "lorp+linear"), None)
        if lorp is not None:
            verdict = "fails" if lorp.get("degraded") else "passes"
            line += f"; repaired LoRP {verdict} the quality gate ({_both(lorp, dense)})"
        out.append(line)
    return out


def _both(row: dict[str, Any], dense: float) -> str:
    """'PTB 1.22x, lee 1.48x dense' (the held-out ratio where the row has it)."""
    text = f"PTB {_ppl(row) / dense:.2f}x"
    held = row.get("ratio_lee")
    return text + (f", lee {float(held):.2f}x dense" if held is not None else " dense")


def findings(rows: list[dict[str, Any]]) -> list[str]:
    """Where the paper's ranking (LoRP ahead of ShortGPT and Streamline) holds here, how
    `lorp-loss` compares with the best one-pass method and with SLEB, and what the linear
    repair recovers."""
    out = []
    for b in sorted({r["budget"] for r in rows if r["budget"]}):
        at = {r["method_label"]: _ppl(r) for r in rows if r["budget"] == b}
        if all(m in at for m in PAPER_METHODS):
            rest = min(at["shortgpt"], at["streamline"])
            verdict = "holds" if at["lorp"] <= rest else "does not hold"
            out.append(
                f"at {b} blocks the paper's ranking {verdict} (LoRP {at['lorp']:,.1f}, "
                f"best of ShortGPT/Streamline {rest:,.1f})"
            )
        one_pass = {m: at[m] for m in ONE_PASS if m in at}
        if "lorp-loss" in at and one_pass:
            best = min(one_pass, key=one_pass.__getitem__)
            verdict = "at or below" if at["lorp-loss"] <= one_pass[best] else "above"
            out.append(
                f"at {b} blocks lorp-loss ({at['lorp-loss']:,.1f}) is {verdict} the best "
                f"one-pass method ({best}, {one_pass[best]:,.1f})"
            )
        if "lorp-loss" in at and "sleb" in at:
            ratio = at["lorp-loss"] / at["sleb"]
            verdict = "within" if ratio <= SLEB_SLACK else "outside"
            out.append(
                f"at {b} blocks lorp-loss / SLEB = {ratio:.2f} ({verdict} {SLEB_SLACK}x; "
                f"SLEB {at['sleb']:,.1f})"
            )
    return out + repair_findings(rows)


def shown(r: dict[str, Any], models: list[str] | None, methods: list[str] | None) -> bool:
    """A catalog row of `models` and `methods` (labels, repaired twins with them; dense
    always); None: all."""
    if models and r["model"] not in models:
        return False
    return not methods or r["method"] == "dense" or r["method_label"].split("+")[0] in methods


def render(catalog: Path, models: list[str] | None = None, methods: list[str] | None = None) -> str:
    rows = [r for r in read_catalog(catalog) if shown(r, models, methods)]
    if not rows:
        raise SystemExit(f"--models: no rows for {models} in {catalog}")
    parts = [
        "Reproduce: `python benchmarks/quality.py --page docs/results/quality.md` (runs "
        "`jobs/quality.yaml` through `lorp run`). Evaluations: candidate block sets the "
        "method scored (both budgets); selection s: wall time of the selections with the "
        "evaluator actors `jobs/quality.yaml` asks for (2 of 1 CPU each here). A selection "
        "resumed from the loss memo after an interrupted run counts only its last run.",
        "",
    ]
    return _per_model(parts, rows, model_table, findings)


Lines = Callable[[list[dict[str, Any]]], list[str]]


def _per_model(parts: list[str], rows: list[dict[str, Any]], table: Lines, notes: Lines) -> str:
    """`parts`, then per model: its heading, `table` of its rows and `notes` as bullets."""
    for model, mrows in by_model(rows).items():
        n = mrows[0]["n_blocks"]
        parts += [
            f"**{model}** (N = {n}; PTB test and held-out lee, 32 x 512, BOS per the tokenizer)",
            "",
        ]
        parts += table(mrows) + [""]
        parts += [f"- {line}" for line in notes(mrows)] + [""]
    return "\n".join(parts)


def write_page(path: Path, text: str, section: str = "quality") -> None:
    if section == "repair":
        replace_section(path, REPAIR_BEGIN, REPAIR_END, text, "Quality report with repair")
    else:
        replace_section(path, BEGIN, END, text, "Quality report")


def bos_check() -> None:
    import torch

    from lorp.models.loading import load_model
    from lorp.models.perplexity import perplexity
    from pipeline.evaluation.corpora import corpus_windows
    from pipeline.spec.evaluation import EvaluationSpec

    torch.set_num_threads(2)
    lm = load_model("gemma3-270m")
    for bos in ("auto", "never"):
        windows = corpus_windows(
            lm.tokenizer, "ptb", EvaluationSpec(seq_len=512, max_windows=16, bos=bos)
        )
        print(
            f"gemma3-270m dense PTB perplexity, 16 x 512, bos {bos}: "
            f"{perplexity(lm.model, windows, batch_size=4):.1f}"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", help="restrict to these model labels")
    parser.add_argument("--methods", nargs="*", help="restrict to these method labels")
    parser.add_argument("--page", help="write the tables into this results page")
    parser.add_argument("--bos-check", action="store_true", help="Gemma 3 with and without BOS")
    parser.add_argument(
        "--section",
        choices=("quality", "repair"),
        default="quality",
        help="quality: every method's Table 2; repair: pruned vs repaired side by side",
    )
    parser.add_argument(
        "--from-catalog", metavar="PARQUET", help="render this catalog; run nothing"
    )
    args = parser.parse_args()
    if args.bos_check:
        bos_check()
        return 0
    if args.from_catalog and not Path(args.from_catalog).is_file():
        raise SystemExit(f"--from-catalog: no such file {args.from_catalog}")
    catalog = Path(args.from_catalog) if args.from_catalog else run(args.models, args.methods)
    chosen = (args.models, args.methods) if args.from_catalog else (None, None)
    draw = render_repair if args.section == "repair" else render
    text = draw(catalog, *chosen)
    print(text)
    if args.page:
        write_page(Path(args.page), text, args.section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
