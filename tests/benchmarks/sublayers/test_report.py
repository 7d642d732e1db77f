"""benchmarks/sublayers/report.py: the equal-cost comparison (the best sub-block variant no
costlier than the block's), the page it writes, and runs of one model merged."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest

from tests.helpers.paths import REPO

sys.path.insert(0, str(REPO))

from benchmarks.sublayers.report import (  # noqa: E402
    BEGIN,
    END,
    compare,
    merged,
    page,
    recosted,
    write_page,
)

DENSE = {
    "ppl": {"prose": 10.0, "code": 4.0},
    "zero_shot": {"acc_arc_easy": 50.0, "acc_copa": 60.0, "acc_avg": 55.0, "n_copa": 100.0},
}


def row(granularity: str, method: str, budget: int, prose: float, code: float, decode: float):  # type: ignore[no-untyped-def]
    return {
        "granularity": granularity,
        "method": method,
        "budget": budget,
        "sublayers": ["attn.1", "mlp.1"] if granularity == "block" else ["attn.2"],
        "ppl": {"prose": prose, "code": code},
        "unrepaired": {"prose": 2 * prose, "code": 2 * code},
        "kv_bytes_per_token": 256.0,
        "decode_bytes_4k": decode,
        "decode_bytes_4k_dense": 100.0,
    }


def test_the_comparison_takes_the_best_sub_block_variant_no_costlier_than_the_block() -> None:
    rows = [
        row("block", "shortgpt", 4, 35.0, 9.0, 80.0),
        row("block", "lorp", 4, 25.0, 12.0, 80.0),  # worst 3.0 (code): the best block
        row("attention", "shortgpt", 6, 14.0, 5.0, 79.0),  # worst 1.4: the best sub-block
        row("mixed", "lorp", 6, 11.0, 4.2, 81.0),  # better, but costlier: not compared
        row("block", "shortgpt", 8, 60.0, 20.0, 60.0),
        row("block", "lorp", 8, 70.0, 16.0, 60.0),
    ]
    result = {"rows": rows, "dense": DENSE}
    out = compare(result)
    assert len(out) == 1  # nothing sub-block is as cheap as 8 blocks here
    c = out[0]
    assert c["block"] == ["block", "lorp", 4] and c["sub_block"] == ["attention", "shortgpt", 6]
    assert (c["block_worst"], c["sub_block_worst"]) == (3.0, 1.4)
    assert (c["block_decode"], c["sub_block_decode"]) == (0.8, 0.79)
    c["block_zero_shot"] = {"acc_arc_easy": 40.0, "acc_copa": 60.0, "acc_avg": 50.0}  # 90%
    c["sub_block_zero_shot"] = {"acc_arc_easy": 50.0, "acc_copa": 54.0, "acc_avg": 52.0}  # 95%
    result |= {
        "model": "m",
        "n_blocks": 6,
        "dtype": "float32",
        "seconds": 1,
        "max_windows": 16,
        "loss_samples": 8,
        "comparison": out,
        "methods": ["shortgpt", "lorp"],
    }
    text = page([result], SimpleNamespace(zero_shot=["arc_easy", "copa"], zero_shot_limit=200))
    assert "--zero-shot-limit 200 --loss-samples 8 --methods shortgpt lorp`" in text
    line = next(x for x in text.splitlines() if x.startswith("| 4 blocks"))
    assert "| 3.000x | 90.0% |" in line and "| 1.400x | 95.0% | yes |" in line
    assert (
        "| attention | shortgpt | 6 | 1.400x | 1.250x | 2.800x | 256 B | 0.790 | 1.266x |" in text
    )


def test_a_mixed_variant_of_whole_blocks_competes_as_a_block_variant() -> None:
    """`window` or SLEB over units may remove both halves of blocks: that variant is a
    block variant, never the sub-block side's; it wins the block side where it is best."""
    whole = row("mixed", "window", 4, 10.5, 4.1, 80.0)  # worst 1.05
    whole["sublayers"] = ["attn.2", "mlp.2", "attn.3", "mlp.3"]
    halves = row("mixed", "sleb", 4, 12.0, 4.4, 80.0)  # worst 1.2: mlp.2 without attn.2
    halves["sublayers"] = ["mlp.2", "attn.3", "mlp.3", "attn.4"]
    rows = [row("block", "sleb", 2, 13.0, 4.0, 80.0), whole, halves]
    (c,) = compare({"rows": rows, "dense": DENSE})
    assert c["block"] == ["mixed", "window", 4] and c["block_worst"] == 1.05
    assert c["sub_block"] == ["mixed", "sleb", 4] and c["sub_block_worst"] == 1.2
    result = {
        "model": "m",
        "n_blocks": 6,
        "dtype": "float32",
        "max_windows": 16,
        "loss_samples": 8,
        "rows": rows,
        "dense": DENSE,
        "comparison": [c],
    }
    text = page([result], SimpleNamespace(zero_shot=["arc_easy", "copa"], zero_shot_limit=200))
    line = next(x for x in text.splitlines() if x.startswith("| 2 blocks"))
    assert "| window, mixed 4 units (decode 0.800) | 1.050x |" in line and "| no |" in line


def test_runs_at_other_block_budgets_merge_into_one_model_result() -> None:
    settings = {
        "model": "m",
        "dtype": "float32",
        "max_windows": 8,
        "loss_samples": 8,
        "sequential": False,
        "distill_epochs": 0,
        "zero_shot_limit": 50,
        "dense": DENSE,
        "seconds": 5,
    }
    a = settings | {
        "rows": [row("block", "lorp", 4, 25.0, 12.0, 80.0)],
        "comparison": [{"blocks": 4}],
    }
    b = settings | {
        "rows": [
            row("block", "lorp", 4, 99.0, 99.0, 80.0),
            row("block", "lorp", 2, 15.0, 6.0, 90.0),
        ],
        "comparison": [{"blocks": 4, "x": 1}, {"blocks": 2}],
    }
    out = merged(a, b, "b")
    assert [(r["budget"], r["ppl"]["prose"]) for r in out["rows"]] == [(4, 25.0), (2, 15.0)]
    assert out["comparison"] == [{"blocks": 2}, {"blocks": 4}] and out["seconds"] == 10
    assert out["parts"] == [[4], [2, 4]]  # each run's block budgets, for its command line
    near = {**b, "dense": {**DENSE, "ppl": {"prose": 10.0000001, "code": 4.0}}}
    assert merged(a, near, "b")["dense"] == DENSE  # the 7th digit: the same run
    far = {**b, "dense": {**DENSE, "ppl": {"prose": 10.01, "code": 4.0}}}
    with pytest.raises(SystemExit, match="dense differs"):
        merged(a, far, "b")


def test_each_section_of_the_page_is_rewritten_alone(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "sublayers.md"
    path.write_text(f"# Sub-layers\n\nprose\n\n{BEGIN}\nold tables\n{END}\n\nafter\n")
    write_page(path, "small tables", "small")
    write_page(path, "new tables")
    write_page(path, "smaller tables", "small")
    text = path.read_text()
    assert text.startswith(f"# Sub-layers\n\nprose\n\n{BEGIN}\nnew tables\n{END}\n\nafter\n")
    assert text.endswith(
        "## At one and two blocks' cost\n\n<!-- sublayers-small:begin -->\nsmaller tables\n"
        "<!-- sublayers-small:end -->\n"
    )
    assert "old tables" not in text and "small tables" not in text
    fresh = tmp_path / "new.md"
    write_page(fresh, "tables")
    text = fresh.read_text()
    assert text.startswith("# Sub-layers, measured\n") and f"{BEGIN}\ntables\n{END}" in text


def test_a_rendered_run_is_recosted_by_today_s_decode_count(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A run keeps the decode bytes of the code that measured it; the page counts them
    again from each row's units. Tiny Gemma 3: window 16 on blocks 0, 1, 3, 4, 5, full
    attention on block 2. At 4k a sliding attention reads 16 keys, not 4096: two of them
    save less than a block, where the whole-context count said eight times more."""
    from lorp.models.shape import ModelShape
    from lorp.models.sublayers import block_units, parse_unit_label, sublayer_parameters
    from lorp.serving_cost import decode_bytes_per_token
    from tests.helpers.tiny_models import save_tiny, tiny_model

    path = save_tiny("gemma3_text", tmp_path / "gemma")
    model = tiny_model("gemma3_text")
    shape = ModelShape.from_config(model.config.to_dict())
    dense = sum(p.numel() for p in model.parameters())

    def decode(units: list[int]) -> float:
        kept = [b for b in range(6) if 2 * b not in units]
        params = dense - sublayer_parameters(model, units)
        return float(decode_bytes_per_token(shape, kept, params, 4, 4096))

    stale = row("attention", "shortgpt", 2, 12.0, 4.4, 70.0)  # the best sub-block, once
    stale["sublayers"] = ["attn.1", "attn.3"]
    rows = [
        row("block", "shortgpt", 1, 15.0, 5.0, 80.0),
        stale,
        row("mlp", "shortgpt", 2, 20.0, 6.0, 79.0),
    ]
    rows[0]["zero_shot"] = {"acc_arc_easy": 45.0, "acc_copa": 60.0}
    got = recosted({"model": str(path), "dtype": "float32", "rows": rows, "dense": DENSE})
    for r in got["rows"]:
        assert r["decode_bytes_4k"] == decode([parse_unit_label(x) for x in r["sublayers"]])
        assert r["decode_bytes_4k_dense"] == decode([])
        assert (
            r["ppl"]
            == next(
                x
                for x in rows
                if x["method"] == r["method"] and x["granularity"] == r["granularity"]
            )["ppl"]
        )
    block = decode(block_units([1]))
    assert decode([2, 6]) > block  # two sliding attentions save less than a block
    c = got["comparison"][0]
    assert c["sub_block"] == ["mlp", "shortgpt", 2] and c["sub_block_worst"] == 2.0
    assert c["block_zero_shot"] == rows[0]["zero_shot"] and c["sub_block_zero_shot"] is None
