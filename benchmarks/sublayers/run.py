"""Pruning inside the block: attention, MLP and mixed sub-layers against whole blocks, at
equal predicted decode cost, on the packaged models.

    python benchmarks/sublayers/run.py [--models smollm2-135m ...] [--max-windows 16]
        [--zero-shot arc_easy copa] [--zero-shot-limit 200] [--sequential]
        [--runs runs/sublayers] [--page docs/results/sublayers.md]
    python benchmarks/sublayers/run.py --from-runs --page docs/results/sublayers.md

Per model, with `jobs/quality.yaml`'s calibration (PTB, Wikipedia and code, a third each,
128 x 256 tokens; its held-out loss windows drawn apart from them validate every map):
one capture of S over the 2N + 1 sub-layer boundaries serves every granularity; each
(granularity, method, budget) of `GRID` is selected, repaired (validated linear maps
folded into `o_proj` / `down_proj`, `lorp.repair.sublayer_repair`) and its perplexity
measured on the held-out news (lee, prose; never calibrated on) and the code corpus's
test files, `--max-windows` x 512 tokens each. Attention and MLP budgets are matched to
each block budget: the fewest sub-layers whose predicted decode bytes per token at a
4k context are at most the block variant's (`lorp.serving_cost`); `window` runs at mixed
granularity only, by the held-out loss of each repaired window, with the fewest units
at which every window costs no more (`matched_mixed`). The comparison takes,
at each block budget, the best sub-block variant (any granularity and method) costing at
most the block variant's decode bytes at 4k, and the best block variant, by their worst
domain; zero-shot accuracy (`--zero-shot`, lm-eval on the packaged task data) is measured
for those and for dense. `lorp/` and the evaluation's zero-shot only: no Ray, MLflow or
vLLM. A model's results are written to `--runs/<model>.json` as soon as it finishes; a
rerun skips the models already there.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.sublayers.costs import costs, dense_parameters  # noqa: E402
from benchmarks.sublayers.data import DOMAINS, maps, prepared  # noqa: E402
from benchmarks.sublayers.losses import SelectionLosses, WindowLosses  # noqa: E402
from benchmarks.sublayers.points import BLOCK_BUDGETS, METHODS, choose, grid  # noqa: E402
from benchmarks.sublayers.report import (  # noqa: E402
    SECTIONS,
    SETTINGS,
    close_enough,
    compare,
    find_row,
    merged,
    page,
    recosted,
    write_page,
)

MODELS = ("smollm2-135m", "qwen2.5-coder-0.5b", "gemma3-270m")
Point = tuple[str, str, int]
"""(granularity, method, budget)."""


class ModelRun:
    """One model measured: its dense figures, the units of every point, each point's
    variant repaired and measured, and the compared variants' zero-shot. `base`: the
    earlier run `--extend` names, whose rows and dense zero-shot are kept."""

    def __init__(self, alias: str, args: Any) -> None:
        self.alias, self.args = alias, args
        self.start = time.perf_counter()
        self.m = prepared(alias, args)
        self.dense_params = dense_parameters(self.m.model)
        self.shared: Any = None
        """Every point's repair sums from one pass (`share`), where the fit is one-pass."""

    def took(self) -> str:
        return f"({time.perf_counter() - self.start:.0f} s)"

    def zero_shot(self, model: Any) -> dict[str, float]:
        if not self.args.zero_shot:
            return {}
        return self.m.zero_shot(model, self.args.zero_shot, self.args.zero_shot_limit)

    def dense(self, base: dict[str, Any] | None) -> dict[str, Any]:
        """The dense model's perplexity per domain and zero-shot (`base`'s, which must
        have the same perplexities)."""
        model = self.m.model
        dense = {"ppl": self.m.ppl(model)}
        dense["zero_shot"] = base["dense"]["zero_shot"] if base else self.zero_shot(model)
        if base and not close_enough(base["dense"], dense):
            raise SystemExit(
                f"--extend: {self.alias}'s dense figures differ from {self.args.extend}'s"
            )
        print(f"{self.alias}: dense {dense} {self.took()}", flush=True)
        return dense

    def chosen(
        self, similarity: Any, losses: SelectionLosses, base: dict[str, Any] | None
    ) -> dict[Point, list[int]]:
        """The grid's points (`--points` only, where given) that `base` lacks, and the
        units each removes."""
        args, m = self.args, self.m
        methods = tuple(args.methods)
        points = grid(m.model, m.shape, args.dtype, args.block_budgets, similarity, methods, losses)
        if args.points:
            points = [p for p in points if ":".join(map(str, p)) in args.points] or [
                (g, method, int(b)) for g, method, b in (x.split(":") for x in args.points)
            ]
        done = (
            {(r["granularity"], r["method"], r["budget"]) for r in base["rows"]} if base else set()
        )
        chosen = {p: choose(similarity, p[2], p[0], p[1], losses) for p in points if p not in done}
        print(f"  selected: {losses.evaluated} candidate losses {self.took()}")
        return chosen

    def share(self, chosen: dict[Point, list[int]]) -> None:
        """One capture of every point's runs, each variant fitting from its subset (unless
        the fit is sequential or distilled)."""
        from lorp.repair.sublayer_repair import unit_runs, unit_stats

        if self.args.sequential or self.args.distill_epochs:
            return
        model = self.m.model
        runs = sorted({r for units in chosen.values() for r in unit_runs(model, units)})
        self.shared = unit_stats(model, runs, self.m.fit, self.m.held, skip_prefix=self.m.skip)
        print(f"  repair sums of {len(runs)} runs {self.took()}")

    def repaired(self, units: list[int]) -> tuple[Any, list[Any]]:
        """A copy of the model without `units`, repaired, and its fits."""
        from lorp.repair.sublayer_repair import repair_from_stats, unit_runs

        variant = copy.deepcopy(self.m.model)
        shared = self.shared
        if shared is not None and set(unit_runs(self.m.model, units)) <= set(shared.runs):
            return variant, repair_from_stats(variant, units, shared)
        return variant, self.m.repair(
            variant, units, self.args.sequential, self.args.distill_epochs
        )

    def rows(
        self, chosen: dict[Point, list[int]], dense: dict[str, Any], base: dict[str, Any] | None
    ) -> list[dict[str, Any]]:
        """`base`'s rows, then a row per chosen point; units another point removes too
        are measured once."""
        from lorp.models.sublayers import parse_unit_label

        rows = list(base["rows"]) if base else []
        seen = {tuple(parse_unit_label(x) for x in r["sublayers"]): r for r in rows}
        for point, units in chosen.items():
            rows.append(self.row(point, units, dense, seen))
        return rows

    def row(
        self, point: Point, units: list[int], dense: dict[str, Any], seen: dict[tuple, dict]
    ) -> dict[str, Any]:
        """The point's row: its costs, and (unless `seen` has its units) its repaired
        variant's perplexity and maps (and without its maps, with `--unrepaired`)."""
        from lorp.models.sublayers import sublayer_parameters, sublayers_removed, unit_label

        model, (granularity, method, budget) = self.m.model, point
        row: dict[str, Any] = {
            "granularity": granularity,
            "method": method,
            "budget": budget,
            "sublayers": [unit_label(u) for u in units],
        }
        params = self.dense_params - sublayer_parameters(model, units)
        row |= costs(self.m.shape, units, params, self.dense_params, self.args.dtype)
        key = tuple(units)
        if key in seen:  # the same units as another point: measured once
            return row | {k: seen[key][k] for k in ("ppl", "unrepaired", "maps") if k in seen[key]}
        if self.args.unrepaired:
            with sublayers_removed(model, units):
                row["unrepaired"] = self.m.ppl(model)
        variant, fits = self.repaired(units)
        row["maps"] = maps(fits)
        row["ppl"] = self.m.ppl(variant)
        del variant
        seen[key] = row
        print(
            f"  {granularity} {method} {budget}: "
            + " ".join(f"{d} {row['ppl'][d] / dense['ppl'][d]:.3f}x" for d in DOMAINS)
            + f", decode at 4k {row['decode_bytes_4k'] / row['decode_bytes_4k_dense']:.3f}"
            f" {self.took()}",
            flush=True,
        )
        return row

    def compared_zero_shot(self, result: dict[str, Any]) -> None:
        """The zero-shot of the variants `result`'s comparison holds against each other,
        rebuilt where their rows lack it, beside each comparison."""
        from lorp.models.sublayers import parse_unit_label

        for c in result["comparison"]:
            for side in ("block", "sub_block"):
                r = find_row(result["rows"], c[side])
                if self.args.zero_shot and "zero_shot" not in r:
                    variant, _ = self.repaired([parse_unit_label(x) for x in r["sublayers"]])
                    r["zero_shot"] = self.zero_shot(variant)
                    del variant
                c[f"{side}_zero_shot"] = r.get("zero_shot")


def measure_model(alias: str, args: Any) -> dict[str, Any]:
    """`alias` measured at every point of the grid: its result."""
    from lorp.locality.capture import capture_stats

    run = ModelRun(alias, args)
    m = run.m
    stats = capture_stats(m.model, m.fit, skip_prefix=m.skip, sublayers=True, progress=False)
    similarity = stats.similarity()
    base = extended(args, alias)
    dense = run.dense(base)
    losses = SelectionLosses(m.model, m.held_windows, args.select_dtype)
    losses.repair_scores = WindowLosses(m.model, m.fit, m.held, losses.windows, m.skip)
    chosen = run.chosen(similarity, losses, base)
    run.share(chosen)
    result = {
        "model": alias,
        "n_blocks": m.shape.n_blocks,
        "dtype": args.dtype,
        "dense": dense,
        "rows": run.rows(chosen, dense, base),
        "max_windows": args.max_windows,
        "loss_samples": args.loss_samples,
        "sequential": args.sequential,
        "distill_epochs": args.distill_epochs,
        "zero_shot_limit": args.zero_shot_limit,
        "select_dtype": args.select_dtype,
        "methods": list(args.methods),
        "selection_losses": losses.evaluated,
    }
    if base:
        result["extends"] = base.get("extends", []) + [str(args.extend)]
    result["comparison"] = compare(result)
    run.compared_zero_shot(result)
    result["seconds"] = round(time.perf_counter() - run.start) + (base["seconds"] if base else 0)
    return result


def extended(args: Any, alias: str) -> dict[str, Any] | None:
    """The earlier run of `alias` that `--extend` names: its rows are kept, its dense
    zero-shot reused, and only the points it lacks are measured."""
    if args.extend is None:
        return None
    path = args.extend / f"{Path(alias).name}.json"
    if not path.exists():
        raise SystemExit(f"--extend: no run of {alias} at {path}")
    base = json.loads(path.read_text())
    mine = {"model": alias} | {k: getattr(args, k) for k in SETTINGS if k != "model"}
    for key in SETTINGS:
        if base.get(key) != mine[key]:
            raise SystemExit(f"--extend {path}: {key} differs ({base.get(key)!r} vs {mine[key]!r})")
    return base


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--models", nargs="*", default=list(MODELS))
    p.add_argument("--max-windows", type=int, default=16)
    p.add_argument("--loss-samples", type=int, default=8)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--zero-shot", nargs="*", default=["arc_easy", "copa"])
    p.add_argument("--zero-shot-limit", type=int, default=200)
    p.add_argument("--sequential", action="store_true")
    p.add_argument("--distill-epochs", type=int, default=0)
    p.add_argument("--block-budgets", nargs="*", type=int, default=list(BLOCK_BUDGETS))
    p.add_argument(
        "--unrepaired", action="store_true", help="also measure each point without its maps"
    )
    p.add_argument(
        "--points", nargs="*", metavar="GRANULARITY:METHOD:BUDGET", help="only these points"
    )
    p.add_argument("--methods", nargs="*", default=list(METHODS), choices=METHODS)
    p.add_argument(
        "--select-dtype",
        default="bfloat16",
        help="dtype of the copy the loss-guided methods score candidates on",
    )
    p.add_argument(
        "--extend",
        type=Path,
        help="a run folder whose model results are kept; only the points they lack run",
    )
    add_outputs(p)
    return p


def add_outputs(p: argparse.ArgumentParser) -> None:
    """Where the results go, and what is rendered from them."""
    p.add_argument("--runs", type=Path, default=ROOT / "runs" / "sublayers")
    p.add_argument(
        "--also",
        type=Path,
        nargs="*",
        default=[],
        help="with --from-runs: more run folders (other block budgets) merged in per model",
    )
    p.add_argument("--from-runs", action="store_true", help="render what --runs holds")
    p.add_argument("--page", type=Path)
    p.add_argument(
        "--section",
        default="main",
        choices=sorted(SECTIONS),
        help="which of the page's rendered blocks --page rewrites",
    )


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    args.runs.mkdir(parents=True, exist_ok=True)
    results = []
    for alias in args.models:
        path = args.runs / f"{Path(alias).name}.json"
        if not path.exists():
            if args.from_runs:
                continue
            path.write_text(json.dumps(measure_model(alias, args), indent=1))
        result = recosted(json.loads(path.read_text()))
        for more in args.also:
            other = more / path.name
            if other.exists():
                result = merged(result, recosted(json.loads(other.read_text())), str(other))
        results.append(result)
    if not results:
        raise SystemExit(f"no results under {args.runs}")
    text = page(results, args)
    print(text)
    if args.page:
        write_page(args.page, text, args.section)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
