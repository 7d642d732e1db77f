"""One model's page as data (`dashboards.model_view`): metric tables, cluster labels, repair
pairs, the memory plan; and the model page each becomes."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from dashboards.catalog_rows import judged_metric
from dashboards.intervals import UNKNOWN
from dashboards.model_view import (
    cluster_labels,
    domain_view,
    memory_view,
    metric_tables,
    model_view,
    repair_pairs,
)
from dashboards.site import build_site
from tests.helpers.dashboard_data import UI, row
from tests.helpers.dashboard_data import similarity_stats as _stats


def test_metric_tables_carry_intervals_for_every_task() -> None:
    rows = [row(method="dense", budget=0, acc_copa=60.0), row(acc_copa=55.0, n_copa=100.0)]
    t = metric_tables(rows, {}, UI)
    assert t["acc_cols"] == ["copa"]
    dense, lorp = (r["acc"][0] for r in t["rows"])
    assert dense["flag"] == UNKNOWN and dense["half"] is None
    assert lorp["half"] == pytest.approx(1.96 * 100 * math.sqrt(0.55 * 0.45 / 100))


def test_labels_from_the_column_else_from_S() -> None:
    from lorp import cluster_layers

    S = _stats(8).matrix()
    stored = [0, 0, 0, 1, 1, 1, 1, 1]  # not what clustering S at K = 3 gives
    rows = [row(labels=stored), row(method="shortgpt", labels=stored)]
    assert cluster_labels(rows, S) == stored
    assert cluster_labels(rows, None) == stored  # no S needed
    recomputed = cluster_layers(S, 3).tolist()
    assert recomputed != stored
    assert cluster_labels([row(labels=None)], S) == recomputed
    assert cluster_labels([row()], S) == recomputed  # column missing (old catalog)
    assert cluster_labels([row(labels=None, k=None)], S) is None  # RLS undefined


def test_repaired_variants_sit_beside_their_twins(tmp_path: Path) -> None:
    """A pair per repaired row: the twin's and its own perplexity, gain, gate verdicts."""
    rows = [row("m", "dense", 0, ppl_ptb=10.0)]
    for label, budget, ppl, bad, fix in [
        ("lorp", 2, 80.0, True, None),
        ("lorp+linear", 2, 20.0, False, "linear"),
        ("shortgpt", 2, 16.0, False, "none"),
        ("shortgpt+linear", 2, 12.5, False, "linear"),
        ("shortgpt", 4, 50.0, True, None),  # a twin without a repaired variant: no pair
    ]:
        extra = {"repair_residual": 0.25} if fix == "linear" else {}
        r = row("m", label.split("+")[0], budget, ppl_ptb=ppl, degraded=bad, repair=fix, **extra)
        rows.append(r | {"method_label": label, "grid_key": f"{label}-{budget}"})
    rows[4]["repair_kept"] = "1/1 runs, 1/1 followers; distilled, epoch 2 of 2"
    pairs = repair_pairs(rows[1:], "ppl_ptb")
    assert [(p["label"], p["budget"]) for p in pairs] == [("lorp", 2), ("shortgpt", 2)]
    lorp, short = pairs
    assert (lorp["pruned"], lorp["repaired"], lorp["gain"]) == (80.0, 20.0, 4.0)
    assert (lorp["pruned_degraded"], lorp["repaired_degraded"]) == (True, False)
    assert short["gain"] == pytest.approx(1.28) and short["residual"] == 0.25
    assert repair_pairs([r for r in rows if "+" not in r["method_label"]], "ppl_ptb") == []

    build_site(rows, tmp_path / "site")
    page = (tmp_path / "site" / "model-m.html").read_text()
    assert page.count('class="repair-pair"') == 2 and "Pruned vs repaired" in page
    assert "Dense: 10.00." in page and 'data-v="4.0"' in page
    assert '<td class="l kept">1/1 runs, 1/1 followers; distilled, epoch 2 of 2</td>' in page
    assert page.count('<td class="l kept">-</td>') == 1  # lorp+linear: nothing said


def test_the_repair_table_judges_on_the_held_out_corpus(tmp_path: Path) -> None:
    """Rows the gate judged on held-out text pair their figures on that corpus, not on the
    first perplexity column by name; rows judged on calibration text keep that column."""
    rows = [row("m", "dense", 0, ppl_ptb=10.0, ppl_wiki=20.0)]
    for label, fix, ptb, wiki in [
        ("window", "none", 40.0, 80.0),
        ("window+linear", "linear", 20.0, 25.0),
    ]:
        r = row("m", "window", 2, ppl_ptb=ptb, ppl_wiki=wiki, repair=fix, judged_on="wiki")
        rows.append(r | {"method_label": label, "grid_key": f"{label}-2"})
    assert judged_metric(rows) == "ppl_wiki"
    [pair] = model_view("m", rows, None, {}, "")["repairs"]
    assert (pair["pruned"], pair["repaired"], pair["gain"]) == (80.0, 25.0, 3.2)
    calib = [r | {"judged_on": "ptb (calibration text)"} for r in rows]
    assert judged_metric(calib) == "ppl_ptb"
    build_site(rows, tmp_path / "site")
    page = (tmp_path / "site" / "model-m.html").read_text()
    assert "Perplexity on wiki; gain" in page and "Dense: 20.00." in page


def test_every_variant_shows_each_domain_beside_its_repaired_twin(tmp_path: Path) -> None:
    """Quality per domain: every unrepaired variant's ratio on prose and code, its
    repaired twin's beside it, the worst domain and what the repair gate kept."""
    rows = [row("m", "dense", 0, ratio_domain_prose=1.0, ratio_domain_code=1.0)]
    for label, budget, fix, prose, code, gate in [
        ("window", 2, "none", 1.8, 4.4, None),
        ("window+linear", 2, "linear", 1.4, 4.3, "unrepaired"),
        ("shortgpt", 4, "none", 3.6, 3.7, None),  # no repaired twin: its pruned figures only
    ]:
        extra = {"repair_gate": gate} if gate else {}
        r = row(
            "m",
            label.split("+")[0],
            budget,
            repair=fix,
            ratio_domain_prose=prose,
            ratio_domain_code=code,
            worst_domain="code",
            **extra,
        )
        rows.append(r | {"method_label": label, "grid_key": f"{label}-{budget}"})
    dv = domain_view(rows[1:])
    assert dv is not None and dv["domains"] == ["code", "prose"]
    window, short = dv["rows"]
    assert window["label"] == "window" and window["pruned"] == [4.4, 1.8]
    assert window["repaired"] == [4.3, 1.4] and window["gate"] == "unrepaired"
    assert short["repaired"] == [None, None] and short["worst"] == "code"
    assert domain_view([row()]) is None  # rows from before domains
    build_site(rows, tmp_path / "site")
    page = (tmp_path / "site" / "model-m.html").read_text()
    assert "Quality per domain" in page and page.count('class="domain-row"') == 2
    assert "code pruned" in page and "prose repaired" in page and 'data-v="4.3"' in page


def test_the_memory_plan_and_why_speed_is_absent_are_on_the_model_page(tmp_path: Path) -> None:
    """A streamed model's page says how each stage held it and why its speed is absent;
    a page of rows without a plan (older catalogs) says nothing about it."""
    import json

    plan = {
        "capture": {
            "mode": "streamed",
            "batch": 8,
            "need_gib": 6.368,
            "worker_gib": 7.96,
            "memory_gib": 56.779,
            "kept_gib": 3.98,
        },
        "evaluate": {
            "mode": "memory",
            "batch": 2,
            "need_gib": 1.5,
            "worker_gib": 7.96,
            "memory_gib": 1.5,
            "kept_gib": 0.0,
        },
    }
    reason = "not timed: the model is streamed a module at a time"
    rows = [
        row("big", "dense", 0, ppl_ptb=10.0, memory_plan=json.dumps(plan), speed_skipped=reason),
        row("big", "lorp", 2, ppl_ptb=12.0, memory_plan=json.dumps(plan), speed_skipped=reason),
        row("small", "dense", 0, ppl_ptb=10.0),
        row("small", "lorp", 2, ppl_ptb=12.0),
    ]
    m = memory_view(rows[:2])
    assert m is not None and m["speed_skipped"] == reason
    assert [s["text"] for s in m["stages"]] == [
        "capture streamed (8 windows per pass, plans 6.37 GiB of a worker's 7.96 GiB; "
        "held whole it needs 56.8 GiB)",
        "evaluate memory (2 windows per pass, plans 1.5 GiB of a worker's 7.96 GiB; "
        "held whole it needs 1.5 GiB)",
    ]
    assert memory_view(rows[2:]) is None
    build_site(rows, tmp_path / "site")
    big = (tmp_path / "site" / "model-big.html").read_text()
    assert big.count('class="memory-plan"') == 1
    assert '<span data-stage="capture" data-mode="streamed">capture streamed (8' in big
    assert f"Speed: {reason}." in big
    assert 'class="memory-plan"' not in (tmp_path / "site" / "model-small.html").read_text()


def test_sub_layer_lines_meet_block_lines_on_the_decode_cost_at_4k() -> None:
    """The model page's Pareto figure by granularity: quality against predicted decode
    bytes at 4k, a line per method label (granularity in it), its front across them."""
    from dashboards.model_view import tradeoffs

    def row(label: str, budget: int, ppl: float, decode: float) -> dict:  # type: ignore[type-arg]
        return {
            "method_label": label,
            "method": "shortgpt",
            "budget": budget,
            "ppl_ptb": ppl,
            "decode_bytes_per_token_4k": decode,
        }

    points = [
        row("shortgpt", 4, 30.0, 80.0),
        row("shortgpt", 8, 60.0, 60.0),
        row("shortgpt-attention", 9, 25.0, 80.0),
        row("shortgpt-attention", 17, 70.0, 60.0),
    ]
    fig = next(f for f in tradeoffs(None, points) if f["cost"] == "decode_bytes_per_token_4k")
    assert sorted(fig["lines"]) == ["shortgpt", "shortgpt-attention"]
    assert [(p["label"], p["x"]) for p in fig["front"]] == [
        ("shortgpt", 60.0),
        ("shortgpt-attention", 80.0),
    ]


def test_a_mixtures_expert_and_depth_cuts_meet_on_active_parameters() -> None:
    """A mixture's page offers active parameters and decode bytes at the evaluation's
    context as costs, where an expert cut (fewer parameters, as many active) and a depth
    cut (fewer of both) are told apart; a dense model's page does not (its active
    parameters are its parameters)."""
    from dashboards.model_view import tradeoffs

    def row(label: str, budget: int, ppl: float, params: float, active: float) -> dict:  # type: ignore[type-arg]
        return {
            "method_label": label,
            "method": label.split("-")[0],
            "budget": budget,
            "ppl_ptb": ppl,
            "params": params,
            "active_params": active,
            "decode_bytes_per_token": 2 * active,
            "experts": 6 if "experts" in label else 8,
        }

    points = [row("reap-experts", 2, 21.0, 70.0, 40.0), row("shortgpt", 1, 25.0, 90.0, 35.0)]
    costs = {f["cost"]: f for f in tradeoffs(None, points)}
    assert {"params", "active_params", "decode_bytes_per_token"} <= set(costs)
    active = costs["active_params"]
    assert sorted(active["lines"]) == ["reap-experts", "shortgpt"]
    assert [p["label"] for p in active["front"]] == ["shortgpt", "reap-experts"]
    dense_model = [{**r, "experts": None} for r in points]
    assert not {"active_params", "decode_bytes_per_token"} & {
        f["cost"] for f in tradeoffs(None, dense_model)
    }
