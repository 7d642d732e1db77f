"""Zero-shot accuracy retained: dense against the best variant of each model and budget,
as the figure ReplaceMe and LinearPatch report (% of dense accuracy), with standard errors.

    python benchmarks/retention.py [--catalog runs/quality/catalog] [--limit 500]
                                   [--models smollm2-135m ...] [--page docs/results/retention.md]

The best variants are read from the quality job's catalog (`jobs/quality.yaml`; the rule
of `lorp catalog best`: the lowest held-out ratio among non-degraded variants). A second
job, `retention`, with the quality job's calibration (so every selection is the same, from
the cached S) evaluates dense and those variants on four zero-shot tasks, `--limit` items
each (the tasks' first items, the same for every model), through `lorp run`. BoolQ is
left out: the quality job calibrates on Wikipedia paragraphs that are BoolQ's passages.

Retained = variant accuracy / dense accuracy x 100. Its standard error combines both
accuracies' binomial errors, sqrt(p (1 - p) / n), by the delta method (the two are
measured on the same items, so this overstates it a little); the mean over tasks carries
sqrt(sum se^2) / tasks.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.pages import by_model, markers, replace_section, row, rule  # noqa: E402
from pipeline.catalog.ranking import best, budgets, reference_protocol  # noqa: E402
from pipeline.catalog.table import read_catalog  # noqa: E402

TASKS = ("arc_easy", "arc_challenge", "winogrande", "openbookqa")
BEGIN, END = markers("retention")


def chosen(rows: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """budget -> the best variant of one model's quality rows."""
    protocol = reference_protocol(rows)
    out = {}
    for b in budgets(rows):
        row = best(rows, b, protocol) if protocol else None
        if row is not None:
            out[b] = row
    return out


def distillation(row: dict[str, Any]) -> tuple[int, float | None]:
    """(epochs, learning rate) a catalog row's maps were distilled with, from its
    `repair_fits`; (0, None) for a row not distilled (or from before distillation)."""
    fits = row.get("repair_fits") or []
    fits = json.loads(fits) if isinstance(fits, str) else fits
    for fit in fits:
        if fit.get("distilled"):
            return int(fit["distilled"]["epochs"]), float(fit["distilled"]["lr"])
    return 0, None


def as_picked(spec, picks: dict[int, dict[str, Any]]):  # type: ignore[no-untyped-def]
    """`spec`'s methods, each distilled as its picked rows were (so the retention job
    evaluates the catalog's variant, whatever `jobs/quality.yaml` says today)."""
    by_method: dict[str, set[tuple[int, float | None]]] = {}
    for r in picks.values():  # a peer recipe's own repair (`lorp.peers`): not lorp's to distil
        if r.get("repair") == "linear":
            by_method.setdefault(r["method_label"].split("+")[0], set()).add(distillation(r))
    lrs = {lr for d in by_method.values() for _, lr in d if lr is not None}
    if any(len(d) > 1 for d in by_method.values()) or len(lrs) > 1:
        raise SystemExit(f"picks distilled differently within one job: {by_method}")
    methods = tuple(
        dataclasses.replace(m, repair_distill=next(iter(by_method[m.key]))[0])
        if m.key in by_method
        else m
        for m in spec.methods
    )
    lr = lrs.pop() if lrs else spec.repair_distill_lr
    return dataclasses.replace(spec, methods=methods, repair_distill_lr=lr)


def one_job_each(picks: dict[int, dict[str, Any]]) -> list[dict[int, dict[str, Any]]]:
    """`picks` grouped by method and repair: a job runs its methods at all its budgets, so
    picks of two methods in one job would evaluate two variants nobody picked."""
    groups: dict[tuple[str, str], dict[int, dict[str, Any]]] = {}
    for b, r in sorted(picks.items()):
        groups.setdefault((r["method_label"], r.get("repair") or "none"), {})[b] = r
    return list(groups.values())


def retention_spec(  # type: ignore[no-untyped-def]
    model: str, picks: dict[int, dict[str, Any]], limit: int | None, out: str, base=None
):
    """The quality job (or `base`, a job spec of the same calibration) cut down to dense
    and `picks`, scored on the zero-shot tasks (`limit` items each; None: all)."""
    from pipeline.spec.parse import load_spec

    spec = as_picked(base or load_spec(ROOT / "jobs" / "quality.yaml"), picks)
    labels = {r["method_label"].split("+")[0] for r in picks.values()}
    repairs = {r.get("repair") or "none" for r in picks.values()}
    ev = dataclasses.replace(
        spec.evaluation, perplexity=(), zero_shot=TASKS, zero_shot_limit=limit, speed=False
    )
    return dataclasses.replace(
        spec,
        name="retention",
        output_dir=out,
        catalog=None,
        models=tuple(m for m in spec.models if m.label == model),
        methods=tuple(m for m in spec.methods if m.key in labels),
        budgets=tuple(sorted(picks)),
        # a peer recipe's points take their own repair whatever the job's says
        repair=tuple(r for r in ("none", "linear") if r in repairs) or ("none",),
        evaluation=ev,
    )


def _se(acc: float, n: float) -> float:
    p = acc / 100.0
    return math.sqrt(max(p * (1 - p), 0.0) / n) * 100.0 if n else math.nan


def retained(variant: dict[str, Any], dense: dict[str, Any], task: str) -> tuple[float, float]:
    """(% of dense accuracy, its standard error) on one task."""
    a, d = float(variant[f"acc_{task}"]), float(dense[f"acc_{task}"])
    sa, sd = _se(a, variant[f"n_{task}"]), _se(d, dense[f"n_{task}"])
    r = 100.0 * a / d
    return r, r * math.sqrt((sa / a) ** 2 + (sd / d) ** 2) if a > 0 else math.nan


def table(model: str, picks: dict[int, dict[str, Any]], rows: list[dict[str, Any]]) -> list[str]:
    """Dense's accuracies, then per budget the best variant's accuracy and retention."""
    dense = next(r for r in rows if r["method"] == "dense")
    by = {}  # the newest row of each variant as picked (an older, undistilled twin may remain)
    for r in sorted(rows, key=lambda r: str(r.get("created_at") or "")):
        by[(r["method_label"], r["budget"], distillation(r)[0])] = r
    lines = [row((model, *TASKS, "mean retained")), rule(len(TASKS) + 2)]
    cells = [f"{dense[f'acc_{t}']:.1f} ({int(dense[f'n_{t}'])} items)" for t in TASKS]
    lines.append(row(("dense (acc %)", *cells, 100)))
    for b, pick in sorted(picks.items()):
        got = by.get((pick["method_label"], b, distillation(pick)[0]))
        if got is None:
            continue
        scores = [retained(got, dense, t) for t in TASKS]
        cells = [
            f"{got[f'acc_{t}']:.1f} ({r:.1f} ± {s:.1f}%)"
            for t, (r, s) in zip(TASKS, scores, strict=True)
        ]
        mean = sum(r for r, _ in scores) / len(scores)
        se = math.sqrt(sum(s * s for _, s in scores)) / len(scores)
        label = f"{pick['method_label']} @ {b}/{got['n_blocks']}"
        lines.append(row((label, *cells, f"**{mean:.1f} ± {se:.1f}%**")))
    return lines


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--catalog", default="runs/quality/catalog")
    p.add_argument("--models", nargs="*")
    p.add_argument("--limit", type=int, default=500)
    p.add_argument("--out", default="runs/retention")
    p.add_argument("--page")
    args = p.parse_args()
    from pipeline.cli import talk
    from pipeline.driver.run import run_job

    rows = read_catalog(args.catalog)
    if not rows:
        raise SystemExit(f"--catalog: no rows in {args.catalog} (run jobs/quality.yaml first)")
    talk(False)
    parts = [
        f"Reproduce: `python benchmarks/retention.py --limit {args.limit} "
        "--page docs/results/retention.md` "
        f"(after `jobs/quality.yaml`). Zero-shot, the first {args.limit} items of each task "
        "(lm-eval, acc_norm where defined), dense against the best variant per budget "
        "(lowest held-out ratio, not degraded): accuracy (% retained of dense ± 1 s.e.).",
        "",
    ]
    for model, mine in by_model(rows).items():
        if args.models and model not in args.models:
            continue
        picks = chosen(mine)
        if not picks:
            continue
        for group in one_job_each(picks):  # a job per method: only the picked points run
            summary = run_job(retention_spec(model, group, args.limit, args.out))
        got = [r for r in read_catalog(summary.catalog) if r["model"] == model]
        parts += table(model, picks, got) + [""]
        print("\n".join(parts), flush=True)
    text = "\n".join(parts)
    if args.page:
        replace_section(Path(args.page), BEGIN, END, text, "Zero-shot retention")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
