"""The peers report (issue #76): lorp's own best variant against the published recipes
(`lorp.peers`), on the packaged models at `jobs/quality.yaml`'s budgets, judged alike.

    python benchmarks/peers.py                  # runs (or resumes) runs/peers, writes the page
    python benchmarks/peers.py --quick          # smoke run: one model, small windows; prints
    python benchmarks/peers.py --run runs/peers # renders a finished run, runs nothing

One job, `jobs/quality.yaml` (its peer entries included) in its own output directory,
so calibration, held-out windows and gate are the same for every variant; a rerun
resumes. Per model and budget (a cell):

- lorp's own best is `best-<b>`'s rule (`pipeline.catalog.ranking.best`: the lowest
  worst-domain ratio among variants the gate passed; where it passed none, the least
  bad, marked) over the grid without the peer entries; the best peer by the same rule
  over the peers' variants; `best-<b>` over all of them (item 3 of the issue).
- Perplexity per corpus and by each variant's worst domain; beside each peer, lorp's
  best over it as a ratio of perplexities with a paired bootstrap interval over the
  evaluation windows (`benchmarks.paired`; the catalog's `window_nll`).
- Zero-shot: lorp's best and the best peer on all items of the retention page's four
  tasks (`benchmarks.retention`: a second job of the same calibration, its points
  evaluated on them alone), McNemar's exact test over the items of the four pooled.
- The verdict: the side every deciding test names (each at 5%, no correction for the
  four tests), else tie.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.pages import by_model, markers, replace_section, table  # noqa: E402
from benchmarks.peer_cells import (  # noqa: E402
    Cell,
    attach_zero_shot,
    cells,
    is_peer,
    ppl_tests,
    verdict,
    zero_shot_test,
)
from benchmarks.quality import followers  # noqa: E402
from benchmarks.retention import TASKS, distillation, one_job_each, retention_spec  # noqa: E402
from pipeline.catalog.ranking import finite  # noqa: E402
from pipeline.catalog.table import read_catalog  # noqa: E402

Row = dict[str, Any]
BEGIN, END = markers("peers")
QUICK_BEGIN, QUICK_END = markers("peers-quick")
"""The smoke run's own section: it never stands in for the full run's."""
PAGE = ROOT / "docs" / "results" / "peers.md"
ZERO_SHOT_DIR = "zero-shot"
QUICK_MODEL = "smollm2-135m"
QUICK_METHODS = ("lorp", "shortgpt", "streamline")  # and every peer entry


def job_spec(quick: bool, out: Path):  # type: ignore[no-untyped-def]
    """`jobs/quality.yaml` as job `peers` in `out`. `quick`: one model at the first
    budget, lorp, ShortGPT and Streamline (undistilled) and the peers (LinearPatch
    undistilled), 8k calibration tokens, 8 windows of 256 tokens per corpus."""
    from pipeline.spec.parse import load_spec

    spec = dataclasses.replace(
        load_spec(ROOT / "jobs" / "quality.yaml"), name="peers", output_dir=str(out)
    )
    if not quick:
        return spec
    methods = tuple(
        dataclasses.replace(m, repair_distill=0, repair_options={})
        if m.peer is None
        else dataclasses.replace(m, repair_options={})
        for m in spec.methods
        if m.peer is not None or m.key in QUICK_METHODS
    )
    return dataclasses.replace(
        spec,
        models=tuple(m for m in spec.models if m.label == QUICK_MODEL),
        budgets=spec.budgets[:1],
        methods=methods,
        calibration=dataclasses.replace(spec.calibration, samples=32),
        evaluation=dataclasses.replace(spec.evaluation, max_windows=8, seq_len=256),
    )


def run_zero_shot(spec: Any, grid: list[Cell], limit: int | None, out: Path) -> Path:
    """lorp's best and the best peer of every cell on the zero-shot tasks, one job per
    picked method as the retention page runs them (`retention_spec`), into `out`."""
    from pipeline.driver.run import run_job

    for model, mine in by_model(dataclasses.asdict(c) for c in grid).items():
        for side in ("mine", "best_peer"):
            picks = {c["budget"]: c[side] for c in mine if c[side] is not None}
            for group in one_job_each(picks):
                run_job(retention_spec(model, group, limit, str(out), base=spec))
    return out / "catalog"


def removed(row: Row) -> str:
    return " ".join(str(b) for b in list(row.get("pruned_layers") or [])) or "-"


def corpora(cell: Cell) -> list[str]:
    """The perplexity corpora of the cell's protocol, in the job's order."""
    from pipeline.evaluation.corpora import metric_name

    some = cell.dense or cell.mine or cell.best_peer or {}
    listed = json.loads(some.get("evaluation") or "{}").get("perplexity") or []
    return [metric_name(c).removeprefix("ppl_") for c in listed]


def ppl_text(row: Row, corpus: str, dense: Row | None) -> str:
    """`31.2 (1.18x)`: the perplexity and its ratio to dense."""
    ppl = finite(row.get(f"ppl_{corpus}"))
    if ppl is None:
        return "-"
    base = finite((dense or {}).get(f"ppl_{corpus}"))
    ratio = finite(row.get(f"ratio_{corpus}")) or (ppl / base if base else None)
    return f"{ppl:,.1f}" + (f" ({ratio:.2f}x)" if ratio is not None else "")


def worst(row: Row) -> str:
    ratio = finite(row.get("worst_domain_ratio"))
    text = f"{row.get('worst_domain') or '?'} {ratio:.2f}x" if ratio is not None else "-"
    return text + (" (degraded)" if row.get("degraded") else "")


def interval(test: tuple[float, float, float] | None) -> str:
    if test is None:
        return "no per-window losses"
    ratio, low, high = test
    return f"{ratio:.3f} [{low:.3f}, {high:.3f}]"


def won_by(row: Row | None) -> str:
    """What a lorp variant is made of: its selection, repair, followers, distillation."""
    if row is None:
        return "none"
    parts = [f"selection {row['method_label'].split('+')[0]}", f"repair {row.get('repair')}"]
    if row.get("repair") == "linear":
        epochs = distillation(row)[0]
        parts += [f"{followers(row)} follower map(s)", f"distilled {epochs} epochs"]
    return f"{row['method_label']} ({', '.join(parts)})"


def perplexity_table(grid: list[Cell]) -> list[str]:
    """One model's variants per budget: lorp's best, then each peer, per corpus and by
    the worst domain, with lorp's best over each peer per corpus."""
    names = corpora(grid[0])
    head = ["budget", "variant", "removed", *names, "worst domain"]
    head += [f"lorp / it, {c} [95%]" for c in names]
    dense = grid[0].dense
    lines = [["-", "dense", "-", *(ppl_text(dense, c, None) for c in names), "-"]] if dense else []
    lines[0:] = [line + ["-"] * len(names) for line in lines]
    for cell in grid:
        if cell.mine is not None:
            mine = cell.mine
            figures = [ppl_text(mine, c, dense) for c in names]
            lines.append([cell.budget, f"**lorp: {mine['method_label']}**", removed(mine)])
            lines[-1] += [*figures, worst(mine), *["-"] * len(names)]
        for peer in cell.peers:
            tests = ppl_tests(cell.mine, peer)
            figures = [ppl_text(peer, c, dense) for c in names]
            lines.append([cell.budget, peer["method_label"], removed(peer), *figures])
            lines[-1] += [worst(peer), *(interval(tests.get(c)) for c in names)]
    return table(head, lines)


def zero_shot_cells(cell: Cell) -> list[str]:
    """Items right (lorp / best peer of all), right alone each side, p, detectable."""
    test = zero_shot_test(cell)
    if test is None:
        return ["not run", "-", "-", "-"]
    (a, b), (only_a, only_b) = test["right"], test["discordant"]
    tasks = ", ".join(f"{t} {n}" for t, n in test["tasks"].items())
    smallest = test["detectable"]
    return [
        f"{a:,} / {b:,} of {test['n']:,} ({tasks})",
        f"{only_a} / {only_b}",
        f"{test['p']:.3g}",
        f"{smallest:.1f} points" if smallest is not None else "none (too few discordant)",
    ]


def cell_table(grid: list[Cell]) -> list[str]:
    """One model's cells: lorp's best against the best peer, the verdict, `best-<b>`."""
    head = ["budget", "lorp's best", "best peer", "zero-shot right: lorp / peer"]
    head += ["right alone: lorp / peer", "McNemar p", "smallest detectable", "verdict"]
    head += ["best-<b>"]
    lines = []
    for cell in grid:
        peer = cell.best_peer["method_label"] if cell.best_peer else "none"
        said = verdict(cell)
        winner = {"lorp": "lorp", "peer": peer}.get(said, "tie")
        alias = cell.alias
        owner = "none passes the gate"
        if alias is not None:
            owner = f"{'peer' if is_peer(alias) else 'lorp'}: {alias['method_label']}"
        lines.append([cell.budget, won_by(cell.mine), peer, *zero_shot_cells(cell), winner, owner])
    return table(head, lines)


def render(grid: list[Cell], quick: bool, limit: int | None) -> str:
    """The page's section: how it was made, then per model its two tables."""
    command = "python benchmarks/peers.py" + (" --quick" if quick else "")
    items = f"the first {limit} items" if limit else "all items"
    parts = [
        f"Reproduce: `{command}` (`jobs/quality.yaml` with its peer entries, one job; "
        f"zero-shot on {items} of {', '.join(TASKS)}). " + METHOD,
        "",
    ]
    for model, mine in by_model(dataclasses.asdict(c) | {"cell": c} for c in grid).items():
        model_cells = [m["cell"] for m in mine]
        n = (model_cells[0].dense or model_cells[0].mine or {}).get("n_blocks", "?")
        parts += [f"### {model} (N = {n})", ""]
        parts += perplexity_table(model_cells) + [""] + cell_table(model_cells) + [""]
    if not grid:
        parts.append("No cells: the run has no evaluated variants.")
    return "\n".join(parts)


METHOD = (
    "lorp's best: `best-<b>`'s rule (lowest worst-domain ratio to dense among variants the "
    "gate passed; marked degraded where it passed none) over the grid without the peer "
    "entries. `lorp / it`: lorp's best's perplexity over the peer's on the same windows, "
    "exp(mean of per-window NLL differences), with the 2.5-97.5 percentiles of 10,000 "
    "paired bootstrap resamplings of the windows (seed 0). Zero-shot: lorp's best against "
    "the best peer by the same rule, the four tasks' items pooled; McNemar's exact test "
    "(two-sided binomial on the items right for one alone). Smallest detectable: the "
    "least gap between the two sides' items right alone that the test rejects at 0.05, "
    "given as many discordant items as observed, over all items (accuracy points). "
    "Verdict: the side every deciding test names (an interval off 1 on a corpus, or "
    "McNemar p < 0.05), each at 5% without correction; tie where none decides or two "
    "disagree. best-<b>: the alias's row over every entry, lorp's and the peers'."
)


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="smollm2-135m, budget 4, small windows")
    p.add_argument("--run", metavar="DIR", help="render this finished run; run nothing")
    p.add_argument("--out", help="the run's directory (default runs/peers, runs/peers-quick)")
    p.add_argument("--limit", type=int, help="zero-shot items per task (default all; 40 quick)")
    p.add_argument(
        "--page", help=f"the page to write (default {PAGE.relative_to(ROOT)}; none quick)"
    )
    args = p.parse_args(argv)
    if args.quick and args.limit is None:
        args.limit = 40
    if args.page is None and not args.quick:
        args.page = str(PAGE)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    out = Path(args.run or args.out or ("runs/peers-quick" if args.quick else "runs/peers"))
    if args.run and not (out / "catalog").exists():
        raise SystemExit(f"--run: no catalog in {out}")
    spec = job_spec(args.quick, out)
    if not args.run:
        from pipeline.cli import talk
        from pipeline.driver.run import run_job

        talk(False)
        run_job(spec)
    grid = [c for rows in by_model(read_catalog(out / "catalog")).values() for c in cells(rows)]
    if not args.run:
        run_zero_shot(spec, grid, args.limit, out / ZERO_SHOT_DIR)
    attach_zero_shot(grid, read_catalog(out / ZERO_SHOT_DIR / "catalog"))
    text = render(grid, args.quick, args.limit)
    print(text)
    if args.page:
        begin, end = (QUICK_BEGIN, QUICK_END) if args.quick else (BEGIN, END)
        heading = "The smoke run" if args.quick else "Side by side"
        replace_section(Path(args.page), begin, end, text, heading)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
