"""The report half of `benchmarks/sublayers/run.py`: the equal-cost comparison of its
measured rows, runs of one model merged, and the results page it writes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.pages import markers, replace_section
from benchmarks.sublayers.costs import unit_cost
from benchmarks.sublayers.data import DOMAINS

BEGIN, END = markers("sublayers")
SETTINGS = (
    "model",
    "dtype",
    "max_windows",
    "loss_samples",
    "sequential",
    "distill_epochs",
    "zero_shot_limit",
)
"""What two runs of a model must share to be shown as one (the dense figures too)."""


def merged(a: dict[str, Any], b: dict[str, Any], where: str) -> dict[str, Any]:
    """Run `b` of the same model and settings (other block budgets) merged into `a`: its
    rows not already in `a` and its comparisons at other budgets; refused in one line when
    a setting or the dense figures differ."""
    for key in (*SETTINGS, "dense"):
        if not close_enough(a.get(key), b.get(key)):
            raise SystemExit(f"--also {where}: {key} differs ({a.get(key)!r} vs {b.get(key)!r})")
    keys = {(r["granularity"], r["method"], r["budget"]) for r in a["rows"]}
    rows = a["rows"] + [
        r for r in b["rows"] if (r["granularity"], r["method"], r["budget"]) not in keys
    ]
    have = {c["blocks"] for c in a["comparison"]}
    comparison = a["comparison"] + [c for c in b["comparison"] if c["blocks"] not in have]
    comparison.sort(key=lambda c: c["blocks"])
    parts = [*(a.get("parts") or [block_budgets(a)]), block_budgets(b)]
    return a | {
        "rows": rows,
        "comparison": comparison,
        "seconds": a["seconds"] + b["seconds"],
        "parts": parts,
    }


def close_enough(a: Any, b: Any, rel: float = 1e-5) -> bool:
    """Equal, numbers to `rel` (two runs' dense perplexities differ in the 7th digit:
    another run's thread scheduling sums the same windows in another order)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(close_enough(a[k], b[k], rel) for k in a)
    if isinstance(a, float) and isinstance(b, float):
        return abs(a - b) <= rel * max(abs(a), abs(b))
    return bool(a == b)


def block_budgets(result: dict[str, Any]) -> list[int]:
    return sorted({x["budget"] for x in result["rows"] if x["granularity"] == "block"})


def find_row(rows: list[dict[str, Any]], key: list[Any]) -> dict[str, Any]:
    return next(r for r in rows if [r["granularity"], r["method"], r["budget"]] == key)


def worst(row: dict[str, Any], dense: dict[str, Any]) -> float:
    return max(row["ppl"][d] / dense["ppl"][d] for d in DOMAINS)


def whole_blocks(row: dict[str, Any]) -> bool:
    """Whether a row removes whole blocks only: a block row, or a mixed one whose every unit
    goes with its block's other (`window` and SLEB over units may choose just that). Such a
    variant is a block variant, whatever granularity it was asked at."""
    from lorp.models.sublayers import parse_unit_label

    units = {parse_unit_label(x) for x in row["sublayers"]}
    return row["granularity"] == "block" or all(u ^ 1 in units for u in units)  # attn.i <-> mlp.i


def compare(result: dict[str, Any]) -> list[dict[str, Any]]:
    """At each block budget: the best block variant and the best sub-block variant whose
    decode bytes at 4k are at most its, by worst-domain perplexity ratio. A sub-block
    variant removes at least one sub-layer without the rest of its block (`whole_blocks`);
    a mixed row that removes whole blocks competes on the block side."""
    rows, dense = result["rows"], result["dense"]
    out = []
    for b in sorted({r["budget"] for r in rows if r["granularity"] == "block"}):
        blocks = [r for r in rows if r["granularity"] == "block" and r["budget"] == b]
        blocks += [
            r
            for r in rows
            if whole_blocks(r) and r["granularity"] != "block" and len(r["sublayers"]) == 2 * b
        ]
        if not blocks:
            continue
        best_block = min(blocks, key=lambda r: worst(r, dense))
        cap = max(r["decode_bytes_4k"] for r in blocks)
        subs = [r for r in rows if not whole_blocks(r) and r["decode_bytes_4k"] <= cap]
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


def recosted(result: dict[str, Any]) -> dict[str, Any]:
    """`result` with every row's decode bytes at 4k (and dense's) counted again from its
    units by today's `lorp.serving_cost`, on the model's config alone (meta tensors), and
    its comparison redone; the measured figures are kept. A run stores the counts of the
    code that measured it: Gemma 3's runs before the sliding-window fix (af1e967) counted
    every KV cache over the whole 4k context."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from lorp.models.loading import materialize
    from lorp.models.shape import ModelShape
    from lorp.models.sublayers import parse_unit_label

    config = AutoConfig.from_pretrained(materialize(result["model"]))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    decode = unit_cost(model, ModelShape.from_config(config.to_dict()), result["dtype"])
    dense = decode([])
    rows = [
        r
        | {
            "decode_bytes_4k": decode([parse_unit_label(x) for x in r["sublayers"]]),
            "decode_bytes_4k_dense": dense,
        }
        for r in result["rows"]
    ]
    out = result | {"rows": rows}
    out["comparison"] = compare(out)
    for c in out["comparison"]:  # the zero-shot the compared rows were measured with
        for side in ("block", "sub_block"):
            c[f"{side}_zero_shot"] = find_row(rows, c[side]).get("zero_shot")
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
        names = (
            ", ".join(r["sublayers"])
            if r["granularity"] != "block"
            else (", ".join(sorted({s.split(".")[1] for s in r["sublayers"]}, key=int)))
        )
        out.append(
            f"| {r['granularity']} | {r['method']} | {r['budget']} | {ratios[0]:.3f}x | "
            f"{ratios[1]:.3f}x | {un} | {r['kv_bytes_per_token']:.0f} B | {dec:.3f} | "
            f"{1 / dec:.3f}x | {names} |"
        )
    return out


def blocks(n: int) -> str:
    return f"{n} block" if n == 1 else f"{n} blocks"


def block_label(key: list[Any], n: int) -> str:
    """`sleb 2 blocks`, or for whole blocks a mixed search chose, `window, mixed 4 units`."""
    if key[0] == "block":
        return f"{key[1]} {blocks(n)}"
    return f"{key[1]}, {key[0]} {key[2]} units"


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
            f"| {blocks(c['blocks'])} | {block_label(c['block'], c['blocks'])} "
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
        "maps, where measured). Methods: `shortgpt` (1 - cos per unit), `lorp` (LoRP over "
        "the 2N units) and `sleb` (greedy removal by the held-out calibration loss, "
        "`loss_samples` x 256 tokens drawn apart from the fit's, scored on a bfloat16 copy "
        "of the model), at every granularity; `finercut` (the same greedy search by the "
        "JS divergence of the outputs from dense's on those windows) where a model's rows "
        "name it. Decode: predicted bytes per generated token "
        "at a 4k "
        "context over dense's (weights read once plus the KV cache), so 1 / decode bounds "
        "the memory-bound decode speed-up. Zero-shot retained: the variant's accuracy over "
        f"dense's, averaged over {', '.join(args.zero_shot) or 'no tasks'}.",
        "",
    ]
    for r in results:
        commands = [
            f"`python benchmarks/sublayers/run.py --models {r['model']} --max-windows "
            f"{r['max_windows']} --block-budgets {' '.join(map(str, budgets))} "
            f"--zero-shot-limit {r.get('zero_shot_limit', args.zero_shot_limit)} "
            f"--loss-samples {r['loss_samples']}"
            + (f" --methods {' '.join(r['methods'])}" if r.get("methods") else "")
            + "`"
            for budgets in r.get("parts") or [block_budgets(r)]
        ]
        runs = (
            " and ".join(commands)
            + (", two runs merged with --also" if len(commands) > 1 else "")
            + "".join(f", extending {x}" for x in r.get("extends", []))
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


SECTIONS = {"main": "The tables", "small": "At one and two blocks' cost"}
"""The page's rendered blocks (`--section`): the comparison at 4 and 8 blocks' cost, and the
one at the smallest budgets, run separately with more zero-shot items."""


def section_markers(section: str) -> tuple[str, str]:
    return (BEGIN, END) if section == "main" else markers(f"sublayers-{section}")


def write_page(path: Path, text: str, section: str = "main") -> None:
    """`text` between `section`'s markers on the page (appended under its heading the first
    time); the rest of the page as it was."""
    begin, end = section_markers(section)
    replace_section(path, begin, end, text, SECTIONS[section], "# Sub-layers, measured\n")
