"""Pruning inside the block: attention, MLP and mixed sub-layers against whole blocks, at
equal predicted decode cost, on the packaged models.

    python benchmarks/sublayers.py [--models smollm2-135m ...] [--max-windows 16]
        [--zero-shot arc_easy copa] [--zero-shot-limit 200] [--sequential]
        [--runs runs/sublayers] [--page docs/results/sublayers.md]
    python benchmarks/sublayers.py --from-runs --page docs/results/sublayers.md

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
import functools
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.sublayer_data import prepared  # noqa: E402
from benchmarks.sublayers_report import (  # noqa: E402
    DOMAINS,
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
BLOCK_BUDGETS = (4, 8)
METHODS = ("shortgpt", "lorp", "sleb", "ppl", "finercut", "window")
MIXED_ONLY = ("window",)
"""The methods run at mixed granularity only (a window of consecutive units)."""
UNIT_ONLY = {"mlp": ("shortgpt", "sleb", "ppl", "finercut")}
"""The methods run at MLP granularity (LoRP's clusters are spent on attentions there)."""
CONTEXT = 4096
"""The decode context the costs are compared at."""


def decode_bytes(shape: Any, units: list[int], params: int, dtype: str, context: int) -> float:
    """Predicted decode bytes per token at `context` of a variant without `units`."""
    from lorp.models.loading import DTYPES
    from lorp.models.sublayers import kept_attention_blocks
    from lorp.serving_cost import decode_bytes_per_token

    kept = kept_attention_blocks(shape.n_blocks, units)
    return float(decode_bytes_per_token(shape, kept, params, DTYPES[dtype].itemsize, context))


def costs(shape: Any, units: list[int], params: int, dense_params: int, dtype: str) -> dict:
    from lorp.models.sublayers import kept_attention_blocks, kept_mlp_blocks
    from lorp.serving_cost import cost_columns

    n = shape.n_blocks
    out = cost_columns(
        shape, kept_attention_blocks(n, units), params, dense_params, dtype, 512,
        kept_mlp_blocks(n, units),
    )  # fmt: skip
    out["decode_bytes_4k"] = decode_bytes(shape, units, params, dtype, CONTEXT)
    out["decode_bytes_4k_dense"] = decode_bytes(shape, [], dense_params, dtype, CONTEXT)
    return out


def matched_budget(model: Any, shape: Any, granularity: str, target: float, dtype: str) -> int:
    """The fewest units of `granularity` (attention or MLP: every one costs the same)
    whose removal brings decode bytes at 4k to at most `target`."""
    from lorp.models.sublayers import eligible_units, sublayer_parameters

    pool = eligible_units(granularity, shape.n_blocks)
    dense = sum(p.numel() for p in model.parameters())
    for k in range(1, len(pool) + 1):
        units = pool[:k]
        params = dense - sublayer_parameters(model, units)
        if decode_bytes(shape, units, params, dtype, CONTEXT) <= target:
            return k
    return len(pool)


def choose(
    similarity: Any, budget: int, granularity: str, method: str, losses: Any = None
) -> list[int]:
    """The units `method` removes; a loss-guided method asked for every eligible unit of a
    granularity takes them all without scoring (there is nothing to rank)."""
    from lorp.methods.sublayer_selection import LOSS_METHODS, loss_measure, select_units
    from lorp.models.sublayers import eligible_units

    if method == "window":  # by the held-out loss of each repaired window
        scores = losses.repair_scores
        sel = select_units(similarity, budget, granularity, method, repair_scores=scores,
                           score="loss")  # fmt: skip
        return list(sel.layers)
    asks = losses is not None and method in LOSS_METHODS
    scored = losses.by(loss_measure(method)) if asks else None
    if method in ("sleb", "finercut") and granularity != "block":
        pool = eligible_units(granularity, similarity.n_blocks // 2)
        if budget >= len(pool):
            return pool
    sel = select_units(similarity, budget, granularity, method, losses=scored)
    return list(sel.layers)


def matched_mixed(
    model: Any, shape: Any, similarity: Any, method: str, target: float, dtype: str,
    losses: Any = None,
) -> int:  # fmt: skip
    """The fewest mixed units `method` removes (its own choice at each count: an MLP saves
    more than an attention) whose decode bytes at 4k are at most `target`; for `window`,
    the fewest with which every window of that many consecutive units costs no more
    (chosen without scoring any: each count would need its own pass)."""
    from lorp.models.sublayers import budget_limit, eligible_units, sublayer_parameters

    dense = sum(p.numel() for p in model.parameters())
    limit = budget_limit("mixed", shape.n_blocks)
    if method in MIXED_ONLY:
        pool = eligible_units("mixed", shape.n_blocks)
        for k in range(1, limit + 1):
            runs = [pool[i : i + k] for i in range(len(pool) - k + 1)]
            cost = lambda u: decode_bytes(  # noqa: E731
                shape, u, dense - sublayer_parameters(model, u), dtype, CONTEXT
            )
            if all(cost(u) <= target for u in runs):
                return k
        return limit
    for k in range(1, limit + 1):
        units = choose(similarity, k, "mixed", method, losses)
        params = dense - sublayer_parameters(model, units)
        if decode_bytes(shape, units, params, dtype, CONTEXT) <= target:
            return k
    return limit


def grid(
    model: Any,
    shape: Any,
    dtype: str,
    budgets: tuple[int, ...] = BLOCK_BUDGETS,
    similarity: Any = None,
    methods: tuple[str, ...] = METHODS,
    losses: Any = None,
) -> list[tuple[str, str, int]]:
    """(granularity, method, budget) points: whole blocks at `budgets`, and at each the
    attention, MLP and (given the sub-layer S, and `losses` for a loss-guided method)
    each method's mixed budget matched to its decode cost at 4k."""
    from lorp.models.sublayers import block_units, sublayer_parameters

    dense = sum(p.numel() for p in model.parameters())
    points = []
    for b in [b for b in budgets if b <= shape.n_blocks - 2]:
        units = block_units(range(1, b + 1))
        target = decode_bytes(shape, units, dense - sublayer_parameters(model, units), dtype,
                              CONTEXT)  # fmt: skip
        points += [("block", m, b) for m in methods if m not in MIXED_ONLY]
        k_attn = matched_budget(model, shape, "attention", target, dtype)
        points += [("attention", m, k_attn) for m in methods if m not in MIXED_ONLY]
        for m in methods:
            k = k_attn if similarity is None else matched_mixed(
                model, shape, similarity, m, target, dtype, losses
            )  # fmt: skip
            points.append(("mixed", m, k))
        k_mlp = matched_budget(model, shape, "mlp", target, dtype)
        points += [("mlp", m, k_mlp) for m in methods if m in UNIT_ONLY["mlp"]]
    return points


def measure_model(alias: str, args: Any) -> dict[str, Any]:
    from lorp.locality.capture import capture_stats
    from lorp.models.perplexity import perplexity
    from lorp.models.sublayers import (
        parse_unit_label,
        sublayer_parameters,
        sublayers_removed,
        unit_label,
    )
    from lorp.repair.sublayer_repair import (
        repair_from_stats,
        repair_sublayers,
        unit_runs,
        unit_stats,
    )

    start = time.perf_counter()
    m = prepared(alias, args)
    model, tok, shape, skip, fit, held = m.model, m.tok, m.shape, m.skip, m.fit, m.held
    evals = m.evals

    def ppl(m: Any) -> dict[str, float]:
        return {d: perplexity(m, w, batch_size=4) for d, w in evals.items()}

    def zero_shot(m: Any) -> dict[str, float]:
        if not args.zero_shot:
            return {}
        from pipeline.evaluation.zero_shot import hf_zero_shot

        return hf_zero_shot(m, tok, list(args.zero_shot), limit=args.zero_shot_limit)

    dense_params = sum(p.numel() for p in model.parameters())
    stats = capture_stats(model, fit, skip_prefix=skip, sublayers=True, progress=False)
    similarity = stats.similarity()
    base = extended(args, alias)
    dense = {"ppl": ppl(model)}
    dense["zero_shot"] = base["dense"]["zero_shot"] if base else zero_shot(model)
    if base and not close_enough(base["dense"], dense):
        raise SystemExit(f"--extend: {alias}'s dense figures differ from {args.extend}'s")
    print(f"{alias}: dense {dense} ({time.perf_counter() - start:.0f} s)", flush=True)
    losses = SelectionLosses(model, m.held_windows, args.select_dtype)
    losses.repair_scores = WindowLosses(model, fit, held, losses.windows, skip)
    points = grid(
        model, shape, args.dtype, args.block_budgets, similarity, tuple(args.methods), losses
    )
    if args.points:
        points = [p for p in points if ":".join(map(str, p)) in args.points] or [
            (g, m, int(b)) for g, m, b in (x.split(":") for x in args.points)
        ]
    done = {(r["granularity"], r["method"], r["budget"]) for r in base["rows"]} if base else set()
    chosen = {p: choose(similarity, p[2], p[0], p[1], losses) for p in points if p not in done}
    print(f"  selected: {losses.evaluated} candidate losses ({time.perf_counter() - start:.0f} s)")
    one_pass = not (args.sequential or args.distill_epochs)
    shared = None
    if one_pass:  # one capture of every point's runs: each variant fits from its subset
        runs = sorted({r for units in chosen.values() for r in unit_runs(model, units)})
        shared = unit_stats(model, runs, fit, held, skip_prefix=skip)
        print(f"  repair sums of {len(runs)} runs ({time.perf_counter() - start:.0f} s)")

    def repaired(units: list[int]) -> tuple[Any, list[Any]]:
        variant = copy.deepcopy(model)
        if shared is not None and set(unit_runs(model, units)) <= set(shared.runs):
            return variant, repair_from_stats(variant, units, shared)
        fits = repair_sublayers(
            variant, units, fit, held=held, skip_prefix=skip, sequential=args.sequential,
            distill_epochs=args.distill_epochs,
        )  # fmt: skip
        return variant, fits

    rows = list(base["rows"]) if base else []
    seen = {tuple(parse_unit_label(x) for x in r["sublayers"]): r for r in rows}
    for (granularity, method, budget), units in chosen.items():
        row: dict[str, Any] = {
            "granularity": granularity, "method": method, "budget": budget,
            "sublayers": [unit_label(u) for u in units],
        }  # fmt: skip
        params = dense_params - sublayer_parameters(model, units)
        row |= costs(shape, units, params, dense_params, args.dtype)
        key = tuple(units)
        if key in seen:  # the same units as another point: measured once
            row |= {k: seen[key][k] for k in ("ppl", "unrepaired", "maps") if k in seen[key]}
            rows.append(row)
            continue
        if args.unrepaired:
            with sublayers_removed(model, units):
                row["unrepaired"] = ppl(model)
        variant, fits = repaired(units)
        row["maps"] = {
            k: sum(f.kept == k for f in fits) for k in ("fit", "unrepaired", "distilled")
        }
        row["ppl"] = ppl(variant)
        del variant
        seen[key] = row
        rows.append(row)
        print(
            f"  {granularity} {method} {budget}: "
            + " ".join(f"{d} {row['ppl'][d] / dense['ppl'][d]:.3f}x" for d in DOMAINS)
            + f", decode at 4k {row['decode_bytes_4k'] / row['decode_bytes_4k_dense']:.3f}"
            f" ({time.perf_counter() - start:.0f} s)",
            flush=True,
        )
    result = {
        "model": alias, "n_blocks": shape.n_blocks, "dtype": args.dtype, "dense": dense,
        "rows": rows, "max_windows": args.max_windows, "loss_samples": args.loss_samples,
        "sequential": args.sequential, "distill_epochs": args.distill_epochs,
        "zero_shot_limit": args.zero_shot_limit, "select_dtype": args.select_dtype,
        "methods": list(args.methods),
        "selection_losses": losses.evaluated,
    }  # fmt: skip
    if base:
        result["extends"] = base.get("extends", []) + [str(args.extend)]
    result["comparison"] = compare(result)
    for c in result["comparison"]:  # zero-shot of the compared variants, rebuilt
        for side in ("block", "sub_block"):
            r = find_row(rows, c[side])
            if args.zero_shot and "zero_shot" not in r:
                variant, _ = repaired([parse_unit_label(x) for x in r["sublayers"]])
                r["zero_shot"] = zero_shot(variant)
                del variant
            c[f"{side}_zero_shot"] = r.get("zero_shot")
    result["seconds"] = round(time.perf_counter() - start) + (base["seconds"] if base else 0)
    return result


class SelectionLosses:
    """The loss-guided methods' `losses=` over unit sets, on the held-out calibration
    windows: a `select_dtype` copy of the model (bfloat16 runs on this CPU's AMX at about
    five times float32's speed), made on first use, and every candidate's value remembered
    per measure (NLL; FinerCut's JS divergence), so SLEB at a larger budget replays the
    smaller one's steps for free. `by(measure)` is the callable a method takes."""

    def __init__(self, model: Any, windows: Any, dtype: str) -> None:
        self.model, self.windows, self.dtype = model, windows, dtype
        self.memos: dict[str, dict[tuple[int, ...], float]] = {}
        self.evaluators: dict[str, Any] = {}
        self.copy: Any = None
        self.repair_scores: Any = None
        """`window`'s `repair_scores=` (`WindowLosses`), set where the fit's windows are."""

    @property
    def evaluated(self) -> int:
        return sum(len(m) for m in self.memos.values())

    def by(self, measure: str) -> Any:
        scorer = functools.partial(self.score, measure=measure)
        scorer.measure = measure  # type: ignore[attr-defined]  # checked by the method
        return scorer

    def score(self, candidates: list[tuple[int, ...]], measure: str) -> list[float]:
        memo = self.memos.setdefault(measure, {})
        todo = [c for c in dict.fromkeys(candidates) if c not in memo]
        if todo:
            memo.update(zip(todo, self._evaluator(measure)(todo), strict=True))
        return [memo[c] for c in candidates]

    def _evaluator(self, measure: str) -> Any:
        if measure not in self.evaluators:
            import torch

            from lorp.methods.removal_loss import LossEvaluator
            from lorp.models.loading import DTYPES

            if self.copy is None:
                self.copy = copy.deepcopy(self.model).to(DTYPES[self.dtype])
            w = torch.as_tensor(self.windows, dtype=torch.long)
            self.evaluators[measure] = LossEvaluator(
                self.copy, w, batch_size=4, units=True, measure=measure
            )
        return self.evaluators[measure]


class WindowLosses:
    """`window`'s `repair_scores=` at mixed granularity: every candidate run's unit sums
    from the fit's windows (validated on the held-out ones), then each repaired variant's
    loss on the held-out windows (`window_losses(units=True)`), on the float32 model; remembered
    per run."""

    def __init__(self, model: Any, fit: Any, held: Any, windows: Any, skip: int) -> None:
        self.model, self.fit, self.held, self.skip = model, fit, held, skip
        self.windows = windows
        self.memo: dict[tuple[int, int], float] = {}

    def __call__(self, runs: list[tuple[int, int]], score: str) -> list[float]:
        import torch

        from lorp.methods.window_scores import window_losses
        from lorp.repair.sublayer_repair import unit_stats

        assert score == "loss"
        todo = [r for r in runs if r not in self.memo]
        if todo:
            sums = unit_stats(self.model, todo, self.fit, self.held, skip_prefix=self.skip)
            w = torch.as_tensor(self.windows, dtype=torch.long)
            self.memo |= window_losses(self.model, sums, w, batch_size=4, units=True)
        return [self.memo[r] for r in runs]


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


def main(argv: list[str] | None = None) -> int:
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
        "--select-dtype", default="bfloat16",
        help="dtype of the copy the loss-guided methods score candidates on",
    )  # fmt: skip
    p.add_argument(
        "--extend", type=Path,
        help="a run folder whose model results are kept; only the points they lack run",
    )  # fmt: skip
    p.add_argument("--runs", type=Path, default=ROOT / "runs" / "sublayers")
    p.add_argument(
        "--also", type=Path, nargs="*", default=[],
        help="with --from-runs: more run folders (other block budgets) merged in per model",
    )  # fmt: skip
    p.add_argument("--from-runs", action="store_true", help="render what --runs holds")
    p.add_argument("--page", type=Path)
    p.add_argument(
        "--section", default="main", choices=sorted(SECTIONS),
        help="which of the page's rendered blocks --page rewrites",
    )  # fmt: skip
    args = p.parse_args(argv)
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
