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
4k context are at most the block variant's (`lorp.serving_cost`). The comparison takes,
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
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

BEGIN, END = "<!-- sublayers:begin -->", "<!-- sublayers:end -->"
MODELS = ("smollm2-135m", "qwen2.5-coder-0.5b", "gemma3-270m")
DOMAINS = {"prose": "lee", "code": "code"}
BLOCK_BUDGETS = (4, 8)
METHODS = ("shortgpt", "lorp")
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


def matched_mixed(
    model: Any, shape: Any, similarity: Any, method: str, target: float, dtype: str
) -> int:
    """The fewest mixed units `method` removes (its own choice at each count: an MLP saves
    more than an attention) whose decode bytes at 4k are at most `target`."""
    from lorp.methods.sublayer_selection import select_units
    from lorp.models.sublayers import budget_limit, sublayer_parameters

    dense = sum(p.numel() for p in model.parameters())
    limit = budget_limit("mixed", shape.n_blocks)
    for k in range(1, limit + 1):
        units = list(select_units(similarity, k, "mixed", method).layers)
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
) -> list[tuple[str, str, int]]:
    """(granularity, method, budget) points: whole blocks at `budgets`, and at each the
    attention, MLP and (given the sub-layer S) each method's mixed budget matched to its
    decode cost at 4k."""
    from lorp.models.sublayers import block_units, sublayer_parameters

    dense = sum(p.numel() for p in model.parameters())
    points = []
    for b in [b for b in budgets if b <= shape.n_blocks - 2]:
        units = block_units(range(1, b + 1))
        target = decode_bytes(shape, units, dense - sublayer_parameters(model, units), dtype,
                              CONTEXT)  # fmt: skip
        points += [("block", m, b) for m in METHODS]
        k_attn = matched_budget(model, shape, "attention", target, dtype)
        points += [("attention", m, k_attn) for m in METHODS]
        for m in METHODS:
            k = k_attn if similarity is None else matched_mixed(
                model, shape, similarity, m, target, dtype
            )  # fmt: skip
            points.append(("mixed", m, k))
        points.append(("mlp", "shortgpt", matched_budget(model, shape, "mlp", target, dtype)))
    return points


def batches_of(windows: Any, size: int = 8) -> list[Any]:
    import torch

    w = torch.as_tensor(windows)
    return [w[i : i + size] for i in range(0, len(w), size)]


def measure_model(alias: str, args: Any) -> dict[str, Any]:

    from lorp.data.windows import resolve_bos
    from lorp.locality.capture import capture_stats
    from lorp.methods.sublayer_selection import select_units
    from lorp.models.loading import load_model
    from lorp.models.perplexity import perplexity
    from lorp.models.shape import ModelShape
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
    from pipeline.evaluation.metrics import corpus_windows
    from pipeline.spec.parse import load_spec
    from pipeline.stages.calibration import _windows, heldout_windows

    start = time.perf_counter()
    spec = load_spec(ROOT / "jobs" / "quality.yaml")
    cal = dataclasses.replace(spec.calibration, loss_samples=args.loss_samples)
    ev = dataclasses.replace(spec.evaluation, max_windows=args.max_windows)
    loaded = load_model(alias, dtype=args.dtype)
    model, tok = loaded.model, loaded.tokenizer
    shape = ModelShape.from_config(model.config.to_dict())
    bos = resolve_bos(tok, cal.bos)
    skip = 1 if bos is not None else 0
    cut, _ = _windows(tok, cal, cal.samples, cal.seed, bos)
    fit = batches_of(cut(), cal.batch_size * 2)
    held = {d: batches_of(w) for d, w in heldout_windows(tok, cal).by_domain().items()}
    evals = {d: corpus_windows(tok, c, ev) for d, c in DOMAINS.items()}

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
    dense = {"ppl": ppl(model), "zero_shot": zero_shot(model)}
    print(f"{alias}: dense {dense} ({time.perf_counter() - start:.0f} s)", flush=True)
    points = grid(model, shape, args.dtype, args.block_budgets, similarity)
    if args.points:
        points = [p for p in points if ":".join(map(str, p)) in args.points] or [
            (g, m, int(b)) for g, m, b in (x.split(":") for x in args.points)
        ]
    chosen = {p: list(select_units(similarity, p[2], p[0], p[1]).layers) for p in points}
    one_pass = not (args.sequential or args.distill_epochs)
    shared = None
    if one_pass:  # one capture of every point's runs: each variant fits from its subset
        runs = sorted({r for units in chosen.values() for r in unit_runs(model, units)})
        shared = unit_stats(model, runs, fit, held, skip_prefix=skip)
        print(f"  repair sums of {len(runs)} runs ({time.perf_counter() - start:.0f} s)")

    def repaired(units: list[int]) -> tuple[Any, list[Any]]:
        variant = copy.deepcopy(model)
        if shared is not None:
            return variant, repair_from_stats(variant, units, shared)
        fits = repair_sublayers(
            variant, units, fit, held=held, skip_prefix=skip, sequential=args.sequential,
            distill_epochs=args.distill_epochs,
        )  # fmt: skip
        return variant, fits

    rows, seen = [], {}
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
        "zero_shot_limit": args.zero_shot_limit,
    }  # fmt: skip
    result["comparison"] = compare(result)
    for c in result["comparison"]:  # zero-shot of the compared variants, rebuilt
        for side in ("block", "sub_block"):
            r = _row(rows, c[side])
            if args.zero_shot and "zero_shot" not in r:
                variant, _ = repaired([parse_unit_label(x) for x in r["sublayers"]])
                r["zero_shot"] = zero_shot(variant)
                del variant
            c[f"{side}_zero_shot"] = r.get("zero_shot")
    result["seconds"] = round(time.perf_counter() - start)
    return result


SETTINGS = ("model", "dtype", "max_windows", "loss_samples", "sequential", "distill_epochs",
            "zero_shot_limit")  # fmt: skip
"""What two runs of a model must share to be shown as one (the dense figures too)."""


def merged(a: dict[str, Any], b: dict[str, Any], where: str) -> dict[str, Any]:
    """Run `b` of the same model and settings (other block budgets) merged into `a`: its
    rows not already in `a` and its comparisons at other budgets; refused in one line when
    a setting or the dense figures differ."""
    for key in (*SETTINGS, "dense"):
        if not _close(a.get(key), b.get(key)):
            raise SystemExit(f"--also {where}: {key} differs ({a.get(key)!r} vs {b.get(key)!r})")
    keys = {(r["granularity"], r["method"], r["budget"]) for r in a["rows"]}
    rows = a["rows"] + [r for r in b["rows"]
                        if (r["granularity"], r["method"], r["budget"]) not in keys]  # fmt: skip
    have = {c["blocks"] for c in a["comparison"]}
    comparison = a["comparison"] + [c for c in b["comparison"] if c["blocks"] not in have]
    comparison.sort(key=lambda c: c["blocks"])
    parts = [*(a.get("parts") or [block_budgets(a)]), block_budgets(b)]
    return a | {"rows": rows, "comparison": comparison, "seconds": a["seconds"] + b["seconds"],
                "parts": parts}  # fmt: skip


def _close(a: Any, b: Any, rel: float = 1e-5) -> bool:
    """Equal, numbers to `rel` (two runs' dense perplexities differ in the 7th digit:
    another run's thread scheduling sums the same windows in another order)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k], rel) for k in a)
    if isinstance(a, float) and isinstance(b, float):
        return abs(a - b) <= rel * max(abs(a), abs(b))
    return bool(a == b)


def block_budgets(result: dict[str, Any]) -> list[int]:
    return sorted({x["budget"] for x in result["rows"] if x["granularity"] == "block"})


def _row(rows: list[dict[str, Any]], key: list[Any]) -> dict[str, Any]:
    return next(r for r in rows if [r["granularity"], r["method"], r["budget"]] == key)


def worst(row: dict[str, Any], dense: dict[str, Any]) -> float:
    return max(row["ppl"][d] / dense["ppl"][d] for d in DOMAINS)


def compare(result: dict[str, Any]) -> list[dict[str, Any]]:
    """At each block budget: the best block variant and the best sub-block variant whose
    decode bytes at 4k are at most its, by worst-domain perplexity ratio."""
    rows, dense = result["rows"], result["dense"]
    out = []
    for b in sorted({r["budget"] for r in rows if r["granularity"] == "block"}):
        blocks = [r for r in rows if r["granularity"] == "block" and r["budget"] == b]
        if not blocks:
            continue
        best_block = min(blocks, key=lambda r: worst(r, dense))
        cap = max(r["decode_bytes_4k"] for r in blocks)
        subs = [r for r in rows if r["granularity"] != "block" and r["decode_bytes_4k"] <= cap]
        if not subs:
            continue
        best_sub = min(subs, key=lambda r: worst(r, dense))
        out.append(
            {
                "blocks": b,
                "block": [best_block["granularity"], best_block["method"], best_block["budget"]],
                "sub_block": [best_sub["granularity"], best_sub["method"], best_sub["budget"]],
                "block_worst": worst(best_block, dense),
                "sub_block_worst": worst(best_sub, dense),
                "block_decode": best_block["decode_bytes_4k"] / best_block["decode_bytes_4k_dense"],
                "sub_block_decode": best_sub["decode_bytes_4k"] / best_sub["decode_bytes_4k_dense"],
            }
        )
    return out


def mean_zero_shot(scores: dict[str, float], dense: dict[str, float]) -> float | None:
    """Retention: the variant's accuracy over dense's, averaged over the tasks (the
    `acc_<task>` entries; not their average `acc_avg` nor the item counts `n_<task>`)."""
    tasks = [t for t in dense if t.startswith("acc_") and t != "acc_avg"]
    if not scores or not tasks:
        return None
    return sum(scores[t] / dense[t] for t in tasks) / len(tasks)


def model_table(result: dict[str, Any]) -> list[str]:
    dense = result["dense"]
    out = [
        "| granularity | method | removed | prose (lee) | code | worst, unrepaired | "
        "KV / token | decode bytes at 4k | predicted decode speed-up (bound) | sub-layers |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in result["rows"]:
        ratios = [r["ppl"][d] / dense["ppl"][d] for d in DOMAINS]
        un = (
            f"{max(r['unrepaired'][d] / dense['ppl'][d] for d in DOMAINS):.3f}x"
            if "unrepaired" in r
            else "-"
        )
        dec = r["decode_bytes_4k"] / r["decode_bytes_4k_dense"]
        names = ", ".join(r["sublayers"]) if r["granularity"] != "block" else (
            ", ".join(sorted({s.split(".")[1] for s in r["sublayers"]}, key=int)))  # fmt: skip
        out.append(
            f"| {r['granularity']} | {r['method']} | {r['budget']} | {ratios[0]:.3f}x | "
            f"{ratios[1]:.3f}x | {un} | {r['kv_bytes_per_token']:.0f} B | {dec:.3f} | "
            f"{1 / dec:.3f}x | {names} |"
        )
    return out


def comparison_lines(result: dict[str, Any]) -> list[str]:
    dense_zs = result["dense"].get("zero_shot") or {}
    out = [
        "| at the decode cost of | best whole-block variant | worst ratio | zero-shot retained | "
        "best sub-block variant | worst ratio | zero-shot retained | sub-block better on both |",
        "|---|---|---:|---:|---|---:|---:|---|",
    ]
    for c in result["comparison"]:
        zb = mean_zero_shot(c.get("block_zero_shot") or {}, dense_zs)
        zs = mean_zero_shot(c.get("sub_block_zero_shot") or {}, dense_zs)
        both = c["sub_block_worst"] < c["block_worst"] and (zb is None or zs is None or zs > zb)
        fmt = lambda z: "n/a" if z is None else f"{100 * z:.1f}%"  # noqa: E731
        out.append(
            f"| {c['blocks']} blocks | {c['block'][1]} {c['block'][2]} blocks "
            f"(decode {c['block_decode']:.3f}) | {c['block_worst']:.3f}x | {fmt(zb)} | "
            f"{c['sub_block'][0]} {c['sub_block'][1]} {c['sub_block'][2]} (decode "
            f"{c['sub_block_decode']:.3f}) | {c['sub_block_worst']:.3f}x | {fmt(zs)} | "
            f"{'yes' if both else 'no'} |"
        )
    return out


def page(results: list[dict[str, Any]], args: Any) -> str:
    out = [
        "Calibration: `jobs/quality.yaml`'s (PTB, Wikipedia and code, 128 x 256 tokens); "
        "every map validated on held-out windows drawn apart from them and kept only "
        "where no domain is worse. Ratios: perplexity over dense on the held-out news "
        "(lee) and the code test files (512-token windows), every variant repaired by "
        "least squares in one pass (worst, unrepaired: the same sub-layers without their "
        "maps, where measured). Decode: predicted bytes per generated token at a 4k "
        "context over dense's (weights read once plus the KV cache), so 1 / decode bounds "
        "the memory-bound decode speed-up. Zero-shot retained: the variant's accuracy over "
        f"dense's, averaged over {', '.join(args.zero_shot) or 'no tasks'}.",
        "",
    ]
    for r in results:
        commands = [
            f"`python benchmarks/sublayers.py --models {r['model']} --max-windows "
            f"{r['max_windows']} --block-budgets {' '.join(map(str, budgets))} "
            f"--zero-shot-limit {r.get('zero_shot_limit', args.zero_shot_limit)} "
            f"--loss-samples {r['loss_samples']}`"
            for budgets in r.get("parts") or [block_budgets(r)]
        ]
        runs = " and ".join(commands) + (
            ", two runs merged with --also" if len(commands) > 1 else ""
        )
        out += [
            f"**{r['model']}** (N = {r['n_blocks']}, {r['dtype']}; {r['max_windows']} windows "
            f"per domain, {r.get('zero_shot_limit', args.zero_shot_limit)} zero-shot items "
            f"per task; {runs})",
            "",
            *comparison_lines(r),
            "",
            *model_table(r),
            "",
        ]
    return "\n".join(out)


def write_page(path: Path, text: str) -> None:
    old = path.read_text() if path.exists() else f"# Sub-layers, measured\n\n{BEGIN}\n{END}\n"
    head, rest = old.split(BEGIN, 1)
    tail = rest.split(END, 1)[1]
    path.write_text(f"{head}{BEGIN}\n{text}\n{END}{tail}")


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
    p.add_argument("--runs", type=Path, default=ROOT / "runs" / "sublayers")
    p.add_argument(
        "--also", type=Path, nargs="*", default=[],
        help="with --from-runs: more run folders (other block budgets) merged in per model",
    )  # fmt: skip
    p.add_argument("--from-runs", action="store_true", help="render what --runs holds")
    p.add_argument("--page", type=Path)
    args = p.parse_args(argv)
    args.runs.mkdir(parents=True, exist_ok=True)
    results = []
    for alias in args.models:
        path = args.runs / f"{Path(alias).name}.json"
        if not path.exists():
            if args.from_runs:
                continue
            path.write_text(json.dumps(measure_model(alias, args), indent=1))
        result = json.loads(path.read_text())
        for more in args.also:
            other = more / path.name
            if other.exists():
                result = merged(result, json.loads(other.read_text()), str(other))
        results.append(result)
    if not results:
        raise SystemExit(f"no results under {args.runs}")
    text = page(results, args)
    print(text)
    if args.page:
        write_page(args.page, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
