"""The transfer report: what calibrating on one domain does to the others.

    python benchmarks/domains.py [--models smollm2-135m ...] [--calibrations prose code mix]
        [--methods lorp shortgpt streamline window] [--max-windows 32] [--dtype bfloat16]
        [--distill] [--runs runs/domains] [--page docs/results/domains.md] [--json domains.json]
    python benchmarks/domains.py --from-runs [--also runs/domains-distill:distilled] --page ...

For each calibration (`CALIBRATIONS`: prose, PTB and Wikipedia; code, the code corpus's
train files; mix, all three, a third each) it runs `jobs/quality.yaml` through `lorp run`
with that calibration, the one-pass methods asked for (no distillation unless
`--distill`: it costs a Qwen point half an hour here), both repairs and perplexity on PTB
test, the held-out news (lee) and the code corpus's test files, each job in its own run
directory (runs/domains/<cal>).
Then, per model, one table: every method and budget under every calibration, each
domain's ratio to dense unrepaired and repaired (the gate's choice), and the findings the
issue asks for: the best variant by its worst domain per calibration, every repaired
variant against its unrepaired twin on every domain (paired: the same windows), and no
row marked not degraded whose worst domain is over the gate. A rerun resumes.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.pages import markers, replace_section, row, table  # noqa: E402

BEGIN, END = markers("domains")
CALIBRATIONS = {
    "prose": [("ptb", 1.0), ("wiki", 1.0)],
    "code": [("code", 1.0)],
    "mix": [("ptb", 1.0), ("wiki", 1.0), ("code", 1.0)],
}
DOMAINS = {"prose": "lee", "code": "code"}
"""Domain -> the corpus its column shows (prose: the held-out news, never calibrated on)."""
METHODS = ("lorp", "shortgpt", "streamline", "window")
TWIN_SLACK = 1.02
"""A repaired variant more than this times its unrepaired twin's perplexity on a domain
is a repair that costs that domain."""


def job_spec(calibration: str, models: list[str] | None, methods: list[str], args: Any):  # type: ignore[no-untyped-def]
    """`jobs/quality.yaml` calibrated on `calibration`, with `methods` undistilled."""
    import dataclasses

    from pipeline.spec.calibration import MixPart
    from pipeline.spec.models import MethodSpec
    from pipeline.spec.parse import load_spec

    spec = load_spec(ROOT / "jobs" / "quality.yaml")
    keep = tuple(m for m in spec.models if not models or m.label in models)
    if not keep:
        raise SystemExit(f"--models: none of {models} is in jobs/quality.yaml")
    if args.dtype:
        keep = tuple(dataclasses.replace(m, dtype=args.dtype) for m in keep)
    chosen = tuple(
        MethodSpec(m.name, m.options, m.label, m.repair_distill if args.distill else None)
        for m in spec.methods
        if m.key in methods
    )
    if len(chosen) != len(methods):
        raise SystemExit(f"--methods: {methods} must all be in jobs/quality.yaml")
    parts = tuple(MixPart(n, w) for n, w in CALIBRATIONS[calibration])
    ev = dataclasses.replace(
        spec.evaluation, perplexity=("ptb", "lee", "code"), max_windows=args.max_windows
    )
    cal = dataclasses.replace(spec.calibration, dataset=parts)
    return dataclasses.replace(
        spec,
        name=f"domains-{calibration}",
        output_dir=str(Path(args.runs) / calibration),
        models=keep,
        methods=chosen,
        calibration=cal,
        evaluation=ev,
    )


def run(args: Any) -> None:
    from pipeline.cli import talk
    from pipeline.driver.run import run_job

    talk(False)
    for cal in args.calibrations:
        spec = job_spec(cal, args.models, args.methods, args)
        summary = run_job(spec)
        print(f"{cal}: {summary.done} done, {len(summary.failed)} failed", flush=True)


def load(runs: Path, calibrations: list[str]) -> dict[str, list[dict[str, Any]]]:
    """Calibration -> its job's catalog rows."""
    from pipeline.catalog.table import read_catalog

    out = {}
    for cal in calibrations:
        table = runs / cal / "catalog"
        out[cal] = read_catalog(table) if table.exists() else []
    return out


def ratio(row: dict[str, Any], domain: str) -> float | None:
    value = row.get(f"ratio_{DOMAINS[domain]}")
    return float(value) if value is not None else None


def worst(row: dict[str, Any]) -> float:
    values = [ratio(row, d) for d in DOMAINS]
    return max(v for v in values if v is not None) if any(values) else float("inf")


def twins(rows: list[dict[str, Any]]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(unrepaired, repaired) pairs: the same model, method and budget."""
    by = {(r["model"], r["method_label"], r["budget"]): r for r in rows if r["budget"]}
    out = []
    for (model, label, budget), r in sorted(by.items(), key=lambda kv: str(kv[0])):
        if r["repair"] == "linear":
            twin = by.get((model, label.removesuffix("+linear"), budget))
            if twin is not None:
                out.append((twin, r))
    return out


def fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


HEAD = (
    "method",
    "blocks",
    "calibrated on",
    "news (lee): pruned -> repaired",
    "code: pruned -> repaired",
    "worst, repaired",
    "repair gate",
)
"""The columns of a model's transfer table."""


def model_table(model: str, data: dict[str, list[dict[str, Any]]]) -> list[str]:
    """Rows: method, budget, calibration; each domain unrepaired -> repaired."""
    lines = table(HEAD, [])
    entries = []
    for cal, rows in data.items():
        for twin, rep in twins([r for r in rows if r["model"] == model]):
            entries.append((twin["method_label"], twin["budget"], cal, twin, rep))
    order = list(data)
    for label, budget, cal, twin, rep in sorted(
        entries, key=lambda e: (e[1], e[0], order.index(e[2]))
    ):
        cells = [f"{fmt(ratio(twin, d))} -> {fmt(ratio(rep, d))}" for d in DOMAINS]
        gate = rep.get("repair_gate") or "-"
        mark = " (degraded)" if rep.get("degraded") else ""
        lines.append(row([label, budget, cal, *cells, f"{fmt(worst(rep))}{mark}", gate]))
    return lines


def best(rows: list[dict[str, Any]], model: str, budget: int) -> dict[str, Any] | None:
    """The variant with the lowest worst-domain ratio (repaired or not)."""
    mine = [r for r in rows if r["model"] == model and r["budget"] == budget and worst(r) < 1e300]
    return min(mine, key=worst, default=None)


def findings(data: dict[str, list[dict[str, Any]]], limit: float = 3.0) -> dict[str, Any]:
    """The figures the issue's Done-when reads, per model."""
    out: dict[str, Any] = {
        "models": {},
        "twins_worse": [],
        "mislabelled": [],
        "calibrations": list(data),
    }
    for cal, rows in data.items():
        for twin, rep in twins(rows):
            for d in DOMAINS:
                a, b = ratio(twin, d), ratio(rep, d)
                if a is not None and b is not None and b > TWIN_SLACK * a:
                    out["twins_worse"].append(
                        f"{rep['model']} {rep['method_label']} at {rep['budget']} ({cal}): "
                        f"{d} {a:.2f}x -> {b:.2f}x"
                    )
        for r in rows:  # a row the gate has not judged yet (no ratios) is not counted
            if r["budget"] and not r.get("degraded") and limit < worst(r) < float("inf"):
                out["mislabelled"].append(f"{r['model']} {r['method_label']} ({cal})")
    models = sorted({r["model"] for rows in data.values() for r in rows})
    for model in models:
        budgets = sorted(
            {
                r["budget"]
                for rows in data.values()
                for r in rows
                if r["model"] == model and r["budget"]
            }
        )
        per = out["models"][model] = {}
        for b in budgets:
            for cal, rows in data.items():
                r = best(rows, model, b)
                if r is not None:
                    per[f"{b}/{cal}"] = {
                        "variant": r["method_label"],
                        "lee": ratio(r, "prose"),
                        "code": ratio(r, "code"),
                        "worst": worst(r),
                    }
    return out


def finding_lines(f: dict[str, Any]) -> list[str]:
    lines = []
    for model, per in f["models"].items():
        for key, v in per.items():
            budget, cal = key.split("/")
            lines.append(
                f"- {model} at {budget} blocks, calibrated on {cal}: best by its worst domain "
                f"is {v['variant']}: news {fmt(v['lee'])}, code {fmt(v['code'])}"
            )
    worse = f["twins_worse"]
    for cal in dict.fromkeys(f.get("calibrations") or [""]):
        mine = [w for w in worse if not cal or f"({cal})" in w]
        lines.append(
            f"- repaired variants more than {100 * (TWIN_SLACK - 1):.0f}% worse than their "
            f"unrepaired twin on a domain{f', calibrated on {cal}' if cal else ''}: {len(mine)}"
            + (f" ({'; '.join(mine)})" if mine else "")
        )
    bad = f["mislabelled"]
    lines.append(
        f"- rows marked not degraded whose worst domain is over the gate: {len(bad)}"
        + (f" ({', '.join(bad)})" if bad else "")
    )
    return lines


def page(data: dict[str, list[dict[str, Any]]], args: Any) -> str:
    models = sorted({r["model"] for rows in data.values() for r in rows})
    out = [
        f"Reproduce: `python benchmarks/domains.py --methods {' '.join(args.methods)} "
        f"--max-windows {args.max_windows}"
        + (f" --dtype {args.dtype}" if args.dtype else "")
        + (" --distill" if getattr(args, "distill", False) else "")
        + " --page docs/results/domains.md` (`jobs/quality.yaml` calibrated three ways, "
        "through `lorp run`). Ratios to dense perplexity on the held-out news (lee, prose) and "
        f"the code corpus's test files, {args.max_windows} x 512 tokens each; repaired: the "
        "validated maps with one follower, as the repair gate kept them.",
    ]
    for extra in getattr(args, "also", []):
        where, label = extra.split(":", 1)
        flag = label.split()[0]
        out.append(
            f"Rows calibrated on `<calibration>, {label}`: the same command with `--{flag} "
            f"--runs {where}` and the models and methods they name."
        )
    out.append("")
    for model in models:
        out += [f"**{model}**", "", *model_table(model, data), ""]
    out += finding_lines(findings(data))
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--models", nargs="*")
    p.add_argument(
        "--calibrations", nargs="*", default=list(CALIBRATIONS), choices=list(CALIBRATIONS)
    )
    p.add_argument("--methods", nargs="*", default=list(METHODS))
    p.add_argument("--max-windows", type=int, default=32)
    p.add_argument("--dtype", default=None, help="the models' dtype (default: the job's)")
    p.add_argument("--runs", default="runs/domains")
    p.add_argument(
        "--distill",
        action="store_true",
        help="distil as jobs/quality.yaml's methods ask (window, streamline: 2 epochs)",
    )
    p.add_argument("--from-runs", action="store_true", help="render what --runs holds; run nothing")
    p.add_argument(
        "--also",
        nargs="*",
        default=[],
        metavar="DIR:LABEL",
        help="another run's calibrations beside them, labelled `<cal>, LABEL`",
    )
    p.add_argument("--page", type=Path)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    if not args.from_runs:
        run(args)
    data = load(Path(args.runs), args.calibrations)
    for extra in args.also:
        where, label = extra.split(":", 1)
        more = load(Path(where), args.calibrations)
        data |= {f"{cal}, {label}": rows for cal, rows in more.items() if rows}
    text = page(data, args)
    print(text)
    if args.page:
        new_page = f"# Domains: the transfer report\n\n{BEGIN}\n{END}\n"
        replace_section(args.page, BEGIN, END, text, "The transfer report", new_page)
    if args.json:
        args.json.write_text(json.dumps(findings(data), indent=2))


if __name__ == "__main__":
    main()
