"""One block's decode cost spent on one MLP and one attention of two other blocks, against
the best single blocks: both sides chosen by the same held-out loss, repaired the same way.

    python benchmarks/sublayers/pairs.py --model qwen2.5-coder-0.5b [--top 5] [--repair 4]
        [--max-windows 16] [--zero-shot-limit 500] [--out runs/sublayer-pairs]
    python benchmarks/sublayers/pairs.py --model qwen2.5-coder-0.5b
        --only attn.11,mlp.11 mlp.10,attn.11 [--distill-epochs 2] --out runs/pairs-distilled

Why. The grid's mixed search (`benchmarks/sublayers/run.py`, SLEB over units) counts every
unit alike, so at one block's cost it removes attentions, the cheapest units, until
their savings add up: six on Qwen2.5-Coder. An MLP and an attention cost exactly one
block (its MLP weights, its attention weights and KV cache) where the attention's layer
attends as far as the block's does, so a pair is the sub-block variant that matches one
block's decode cost with the fewest units, and the one a cost-aware search would find.

How. Every eligible block, MLP and attention is scored alone by the held-out calibration
loss of the model without it (SLEB's measure, on a bfloat16 copy, `loss_samples` x 256
tokens drawn apart from the fit's); every pair of the `--top` best MLPs and `--top` + 2
best attentions of other blocks whose decode bytes at 4k are at most the cheapest-saving
block's is scored the same way; the `--repair` best blocks and pairs are repaired by
one-pass least squares (maps validated on held-out windows, `lorp.repair.sublayer_repair`)
and their perplexity measured on the held-out news and code (`--max-windows` x 512
tokens each). The best of each side, by its worst domain, is scored on zero-shot. The
result is written to `--out/<model>.json`. `--only` measures the named unit sets instead
of searching (each scored on zero-shot); `--distill-epochs` distills every repair's maps
after the fit (`lorp.repair.distill`), on both sides alike.
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

from benchmarks.sublayers.costs import unit_cost  # noqa: E402
from benchmarks.sublayers.data import Prepared, maps, prepared  # noqa: E402
from benchmarks.sublayers.losses import SelectionLosses  # noqa: E402
from benchmarks.sublayers.report import mean_zero_shot, whole_blocks  # noqa: E402


def candidates(model: Any, shape: Any, score: Any, top: int, dtype: str) -> dict[str, Any]:
    """Every eligible block and single unit scored by `score` (unit sets -> losses), then
    the pairs of the `top` best MLPs and `top` + 2 best attentions of two blocks that cost
    no more at 4k than the block that saves least: blocks and pairs, best first."""
    from lorp.models.sublayers import block_units, eligible_units

    n, cost = shape.n_blocks, unit_cost(model, shape, dtype)
    blocks = [tuple(block_units([b])) for b in range(1, n - 1)]
    singles = [(u,) for u in eligible_units("mixed", n)]
    loss = dict(zip(blocks + singles, score(blocks + singles), strict=True))
    cap = max(cost(b) for b in blocks)
    ranked = sorted(singles, key=loss.__getitem__)
    mlps = [u for (u,) in ranked if u % 2][:top]
    attns = [u for (u,) in ranked if u % 2 == 0][: top + 2]
    pairs = [tuple(sorted((m, a))) for m in mlps for a in attns if m // 2 != a // 2]
    pairs = [p for p in pairs if cost(p) <= cap]
    loss |= dict(zip(pairs, score(pairs), strict=True))
    return {
        "blocks": sorted(blocks, key=loss.__getitem__),
        "pairs": sorted(pairs, key=loss.__getitem__),
        "loss": loss,
        "cap": cap,
    }


def named(only: list[str]) -> dict[str, Any]:
    """`--only`'s unit sets ("attn.11,mlp.11") as `candidates` gives them, unscored: sets of
    whole blocks on the block side, the rest on the pair side."""
    from lorp.models.sublayers import parse_unit_label

    sets = [tuple(sorted(parse_unit_label(x) for x in s.split(","))) for s in only]
    block = [whole_blocks({"granularity": "mixed", "sublayers": s.split(",")}) for s in only]
    return {
        "blocks": [u for u, b in zip(sets, block, strict=True) if b],
        "pairs": [u for u, b in zip(sets, block, strict=True) if not b],
        "loss": {},
    }


def measured(
    setup: Prepared, args: Any, units: tuple[int, ...], cost: Any, zero_shot: bool
) -> dict[str, Any]:
    """A repaired copy of the model without `units`: its perplexity per domain and cost
    (and its zero-shot, where `zero_shot`)."""
    from lorp.models.sublayers import unit_label

    variant = copy.deepcopy(setup.model)
    fits = setup.repair(variant, list(units), distill_epochs=args.distill_epochs)
    row = {
        "sublayers": [unit_label(u) for u in units],
        "ppl": setup.ppl(variant),
        "decode_bytes_4k": cost(units),
        "maps": maps(fits),
    }
    if zero_shot:
        row["zero_shot"] = setup.zero_shot(variant, args.zero_shot, args.zero_shot_limit)
    return row


def worst(row: dict[str, Any], dense: dict[str, float]) -> float:
    return max(row["ppl"][d] / dense[d] for d in dense)


def measure(alias: str, args: Any) -> dict[str, Any]:
    start = time.perf_counter()
    setup = prepared(alias, args)
    model, shape = setup.model, setup.shape
    dense = setup.ppl(model)
    losses = SelectionLosses(model, setup.held_windows, args.select_dtype)
    if args.only:  # the named sets, each scored on zero-shot as it is measured
        found = named(args.only)
    else:
        found = candidates(model, shape, losses.by("nll"), args.top, args.dtype)
    print(f"{alias}: {losses.evaluated} losses ({time.perf_counter() - start:.0f} s)", flush=True)
    cost = unit_cost(model, shape, args.dtype)
    sides = measured_sides(setup, args, found, cost, dense)
    best = {"blocks": min(sides["blocks"], key=lambda r: worst(r, dense))}
    cap = best["blocks"]["decode_bytes_4k"]  # a pair may cost no more than the block it beats
    fair = [r for r in sides["pairs"] if r["decode_bytes_4k"] <= cap]
    if fair:
        best["pairs"] = min(fair, key=lambda r: worst(r, dense))
    result: dict[str, Any] = {
        "model": alias,
        "dtype": args.dtype,
        "max_windows": args.max_windows,
        "loss_samples": args.loss_samples,
        "top": args.top,
        "repair": args.repair,
        "dense": {"ppl": dense, "decode_bytes_4k": cost(())},
        **sides,
        "selection_losses": losses.evaluated,
        "only": args.only,
        "distill_epochs": args.distill_epochs,
    }
    if args.zero_shot_limit:
        best_zero_shot(setup, args, result["dense"], best)
    result["best"] = {s: best[s]["sublayers"] for s in best}
    result["seconds"] = round(time.perf_counter() - start)
    return result


def measured_sides(
    setup: Prepared, args: Any, found: dict[str, Any], cost: Any, dense: dict[str, float]
) -> dict[str, list[dict[str, Any]]]:
    """The `--repair` best blocks and pairs `found` holds, each repaired and measured (on
    zero-shot too where `--only` named them), with its selection loss."""
    each = bool(args.only and args.zero_shot_limit)
    sides: dict[str, list[dict[str, Any]]] = {}
    for side in ("blocks", "pairs"):
        todo = found[side][: args.repair]
        sides[side] = [measured(setup, args, u, cost, each) for u in todo]
        for u, row in zip(todo, sides[side], strict=True):
            row["loss"] = found["loss"].get(u)
            print(f"  {row['sublayers']}: {worst(row, dense):.4f}x", flush=True)
    return sides


def best_zero_shot(
    setup: Prepared, args: Any, dense: dict[str, Any], best: dict[str, dict[str, Any]]
) -> None:
    """Dense's zero-shot, and each side's best's where it was not measured with it."""
    from lorp.models.sublayers import parse_unit_label

    dense["zero_shot"] = setup.zero_shot(setup.model, args.zero_shot, args.zero_shot_limit)
    for row in [r for r in best.values() if "zero_shot" not in r]:
        variant = copy.deepcopy(setup.model)
        units = [parse_unit_label(x) for x in row["sublayers"]]
        setup.repair(variant, units, distill_epochs=args.distill_epochs)
        row["zero_shot"] = setup.zero_shot(variant, args.zero_shot, args.zero_shot_limit)


def summary(result: dict[str, Any]) -> str:
    """One line per side: the best variant, its worst-domain ratio, decode at 4k and
    zero-shot retained."""
    dense = result["dense"]
    out = []
    for side in ("blocks", "pairs"):
        if side not in result["best"]:
            out.append(f"{result['model']}: no pair costs at most the best block")
            continue
        row = next(r for r in result[side] if r["sublayers"] == result["best"][side])
        zs = row.get("zero_shot")
        z = f", {100 * mean_zero_shot(zs, dense['zero_shot']):.1f}% zero-shot" if zs else ""
        dec = row["decode_bytes_4k"] / dense["decode_bytes_4k"]
        out.append(
            f"{result['model']} best of {side}: {', '.join(row['sublayers'])}: "
            f"{worst(row, dense['ppl']):.3f}x (decode at 4k {dec:.3f}{z})"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", required=True)
    p.add_argument("--top", type=int, default=5)
    p.add_argument("--repair", type=int, default=4)
    p.add_argument("--max-windows", type=int, default=16)
    p.add_argument("--loss-samples", type=int, default=8)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--select-dtype", default="bfloat16")
    p.add_argument("--zero-shot", nargs="*", default=["arc_easy", "copa"])
    p.add_argument("--zero-shot-limit", type=int, default=500, help="0: no zero-shot")
    p.add_argument("--distill-epochs", type=int, default=0, help="repair: then distilled")
    p.add_argument(
        "--only",
        nargs="*",
        metavar="UNITS",
        help='measure these unit sets instead of searching ("attn.11,mlp.11 mlp.10,attn.11")',
    )
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "sublayer-pairs")
    args = p.parse_args(argv)
    for name in ("top", "repair", "max_windows"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}: must be at least 1, got {getattr(args, name)}")
    if args.only is not None:
        try:
            found = named(args.only)
        except ValueError as exc:
            p.error(f"--only: {exc}")
        if not (found["blocks"] and found["pairs"]):
            p.error(f"--only: needs whole blocks and a pair to compare, got {args.only}")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{Path(args.model).name}.json"
    if not path.exists():
        path.write_text(json.dumps(measure(args.model, args), indent=1))
    print(summary(json.loads(path.read_text())))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
