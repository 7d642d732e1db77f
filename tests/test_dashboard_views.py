"""The dashboard's data shaping (views, links) and a whole site from a hand-made catalog:
no Ray, no browser. Numbers are checked against values worked out by hand."""

from __future__ import annotations

import ast
import math
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from dashboards.catalog_rows import group_pages, is_degraded, judged_metric
from dashboards.intervals import SMALL, UNKNOWN, accuracy_interval, average_interval
from dashboards.links import job_tracking, mlflow_command, run_url, tracking_view
from dashboards.markup import Markup, el
from dashboards.model_view import (
    cluster_labels,
    memory_view,
    metric_tables,
    model_view,
    repair_pairs,
    tradeoff_lines,
)
from dashboards.overview_view import best_per_budget, overview
from dashboards.site import build_site, legacy_tracking
from dashboards.speed import speed_bound, speed_view
from tests.helpers.paths import REPO
from tests.helpers.states import make_states

DASHBOARDS = REPO / "dashboards"
UI = "http://127.0.0.1:5000"


def row(model: str = "m", method: str = "lorp", budget: int = 1, **extra: Any) -> dict:
    """One catalog row with the core columns the dashboard reads."""
    return {
        "grid_key": f"{model}-{method}-{budget}",
        "job": "job-a",
        "model": model,
        "family": "Llama",
        "fingerprint": "f" * 8,
        "n_blocks": 8,
        "method": method,
        "method_label": method,
        "budget": budget,
        "pruned_layers": list(range(1, 1 + budget)),
        "rls": 0.9,
        "k": 3,
        "stats_file": None,
        "checkpoint": f"/ckpt/{method}-{budget}",
        "mlflow_run_id": f"run-{method}-{budget}",
        **extra,
    }


# -- zero-shot intervals -----------------------------------------------------------------


def test_accuracy_interval_numbers() -> None:
    # p = 0.40 over 50 items: SE = 100 sqrt(0.4 * 0.6 / 50) = 6.9282, half = 1.96 SE.
    small = accuracy_interval(40.0, 50.0)
    assert small["half"] == pytest.approx(13.579278, abs=1e-6)
    assert (small["lo"], small["hi"]) == pytest.approx((26.420722, 53.579278), abs=1e-6)
    assert small["flag"] == SMALL  # under 100 items: not comparable to the paper
    # p = 0.62 over 3270 items (BoolQ's validation split).
    large = accuracy_interval(62.0, 3270.0)
    assert large["half"] == pytest.approx(1.663680, abs=1e-6)
    assert large["flag"] is None
    # Exactly 100 items is comparable; p = 0.5 gives half = 1.96 * 5 = 9.8.
    assert accuracy_interval(50.0, 100.0)["half"] == pytest.approx(9.8)
    assert accuracy_interval(50.0, 100.0)["flag"] is None
    # Item count absent or NaN: value kept, no interval, flagged unknown.
    for n in (None, math.nan):
        unknown = accuracy_interval(55.0, n)
        assert unknown["value"] == 55.0 and unknown["half"] is None
        assert unknown["flag"] == UNKNOWN
    # Interval clipped to [0, 100] at the extremes.
    assert accuracy_interval(98.0, 20.0)["hi"] == 100.0


def test_average_interval_combines_task_errors() -> None:
    r = row(acc_arc_easy=40.0, n_arc_easy=50.0, acc_boolq=62.0, n_boolq=3270.0, acc_avg=51.0)
    avg = average_interval(r, ["arc_easy", "boolq"])
    # 1.96 * sqrt(6.9282^2 + 0.84882^2) / 2
    assert avg["half"] == pytest.approx(6.840406, abs=1e-6)
    assert avg["flag"] == SMALL and avg["n"] == 3320.0
    r.pop("n_boolq")
    assert average_interval(r, ["arc_easy", "boolq"])["flag"] == UNKNOWN
    assert average_interval(r, ["arc_easy", "boolq"])["half"] is None


def test_metric_tables_carry_intervals_for_every_task() -> None:
    rows = [row(method="dense", budget=0, acc_copa=60.0), row(acc_copa=55.0, n_copa=100.0)]
    t = metric_tables(rows, {}, UI)
    assert t["acc_cols"] == ["copa"]
    dense, lorp = (r["acc"][0] for r in t["rows"])
    assert dense["flag"] == UNKNOWN and dense["half"] is None
    assert lorp["half"] == pytest.approx(1.96 * 100 * math.sqrt(0.55 * 0.45 / 100))


# -- quality gate --------------------------------------------------------------------------


def test_best_per_budget_skips_degraded_rows() -> None:
    rows = [
        row(method="dense", budget=0, ppl_ptb=10.0),
        row(method="lorp", budget=1, ppl_ptb=11.0),
        row(method="shortgpt", budget=1, ppl_ptb=10.5, degraded=True),  # lowest, but failed
        row(method="streamline", budget=1, ppl_ptb=12.0, degraded=False),
        row(method="lorp", budget=2, ppl_ptb=30.0, degraded=True),
        row(method="shortgpt", budget=2, ppl_ptb=40.0, degraded=True),
    ]
    b1 = best_per_budget(rows, "ppl_ptb", 1)
    assert (b1["status"], b1["label"], b1["value"], b1["skipped"]) == ("ok", "lorp", 11.0, 1)
    b2 = best_per_budget(rows, "ppl_ptb", 2)
    assert b2["status"] == "all-degraded" and b2["label"] is None and b2["skipped"] == 2
    assert best_per_budget(rows, "ppl_ptb", 3)["status"] == "none"
    ov = overview(group_pages(rows), job_tracking(rows), UI)
    assert [b["status"] for b in ov["rows"][0]["best"]] == ["ok", "all-degraded"]
    assert ov["n_degraded"] == 3


def test_held_out_judgement_ranks_and_marks_what_fits_only_calibration_text() -> None:
    """Best ranks by the held-out ratio (`judged_on`), not the calibration corpus's
    perplexity, and a variant good only on its calibration text carries the badge."""
    from dashboards.model_page import perplexity_table

    judged = {"judged_on": "lee"}
    rows = [
        row(method="dense", budget=0, ppl_ptb=10.0, ppl_lee=20.0, ppl_ratio=1.0, **judged),
        row(method="lorp", budget=1, ppl_ptb=11.0, ppl_lee=60.0, ratio_ptb=1.1, ratio_lee=3.0,
            ppl_ratio=3.0, fits_calibration_only=True, **judged),
        row(method="shortgpt", budget=1, ppl_ptb=13.0, ppl_lee=30.0, ratio_ptb=1.3,
            ratio_lee=1.5, ppl_ratio=1.5, fits_calibration_only=False, **judged),
    ]  # fmt: skip
    ov = overview(group_pages(rows), job_tracking(rows), UI)
    line = ov["rows"][0]
    assert line["metric"] == "ppl_ratio" and line["best"][0]["label"] == "shortgpt"
    t = metric_tables(rows, {}, UI)
    assert t["ratio_cols"] == ["ratio_lee", "ratio_ptb"] and t["judged_on"] == ["lee"]
    html = str(perplexity_table(t))
    assert html.count("fits calibration only</span>") == 1
    assert "judged = the worst ratio on text the variants were not calibrated on (lee)" in html


def test_missing_degraded_column_means_not_degraded() -> None:
    rows = [row(budget=1, ppl_ptb=11.0), row(method="x", budget=1, ppl_ptb=9.0, degraded=None)]
    assert not any(is_degraded(r) for r in rows)
    assert best_per_budget(rows, "ppl_ptb", 1)["label"] == "x"


# -- speed -------------------------------------------------------------------------------


def test_speed_bound_and_flag() -> None:
    assert speed_bound(8, 2) == pytest.approx(8 / 6)
    assert speed_bound(6, 0) == 1.0
    ok = speed_view(row(n_blocks=6, budget=1, speedup=1.25, speedup_std=0.02))
    assert ok["bound"] == pytest.approx(1.2) and not ok["exceeds"]  # 4% above: noise
    assert ok["std"] == 0.02
    over = speed_view(row(n_blocks=6, budget=1, speedup=1.27))
    assert over["exceeds"] and over["std"] is None  # 5.8% above the bound: flagged
    assert not speed_view(row(n_blocks=6, budget=1))["exceeds"]  # no speed measured


def test_unresolved_speed_is_shown_as_such_and_never_ranked_or_plotted() -> None:
    from dashboards.components import speed_tds
    from dashboards.model_page import speed_table

    nan = float("nan")
    # The estimator's row: speed-up NaN, the measured ratio (above 1.05 x 6/5) kept.
    over = row("m", "shortgpt", 1, n_blocks=6, speedup=nan, speedup_measured=1.4,
               speedup_std=0.02, speed_resolved=0.0, latency_ms=7.0, ppl_ptb=12.0)  # fmt: skip
    sv = speed_view(over)
    assert (sv["resolved"], sv["speedup"], sv["std"], sv["exceeds"]) == (False, None, None, False)
    assert sv["measured"] == 1.4 and sv["measured_exceeds"]
    # A settled-looking speed-up on a row marked unresolved is not shown either.
    stale = row("m", "lorp", 1, n_blocks=6, speedup=1.1, speed_resolved=0.0, latency_ms=9.0)
    assert speed_view(stale)["speedup"] is None
    # No `speed_resolved` column, but a measured ratio and no speed-up: unresolved too.
    bare = speed_view(row(n_blocks=6, speedup=nan, speedup_measured=1.1))
    assert not bare["resolved"] and not bare["measured_exceeds"]
    # A resolved row, and an old catalog's row (no new columns): a speed-up, as before.
    ok = row("m", "lorp", 2, n_blocks=6, speedup=1.3, speedup_std=0.01, speedup_measured=1.3,
             speed_resolved=1.0, latency_ms=8.0, ppl_ptb=15.0)  # fmt: skip
    assert speed_view(ok)["speedup"] == 1.3
    old = speed_view(row(n_blocks=6, speedup=1.25))
    assert old["resolved"] and old["speedup"] == 1.25 and old["measured"] is None

    cell = str(speed_tds(sv)[0])
    assert "not resolved" in cell and "(1.40 measured)" in cell and 'data-v=""' in cell
    assert "above N/(N-k)" in cell and "\u00b1" not in cell and "above bound" not in cell
    assert "did not settle" in str(speed_tds(bare)[0])
    assert "not resolved" not in str(speed_tds(speed_view(ok))[0])
    # All rows unresolved: the column is still drawn, every cell saying so.
    only = metric_tables([over], {}, UI)
    assert only["speed"] and str(speed_table(only)).count("not resolved</span>") == 1
    # The latency plot leaves unresolved timings out; the parameter plot keeps them.
    points = [over, stale, ok]
    assert tradeoff_lines(points, "ppl_ptb", "latency_ms") == {"lorp": [(8.0, 15.0, None, False)]}
    assert len(tradeoff_lines([dict(r, params=1.0) for r in points], "ppl_ptb", "params")) == 2


# -- clusters ----------------------------------------------------------------------------


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


# -- MLflow links ------------------------------------------------------------------------


def test_links_from_tracking_columns() -> None:
    uri = "sqlite:////runs/a/mlflow.db"
    r = row(tracking_uri=uri, experiment_id="7", mlflow_run_id="abc")
    tracking = job_tracking([r])
    assert tracking == {"job-a": {"tracking_uri": uri, "experiment_id": "7"}}
    assert run_url(r, tracking, UI) == f"{UI}/#/experiments/7/runs/abc"
    (job,) = tracking_view(tracking, UI)
    assert job["command"] == f"mlflow ui --host 127.0.0.1 --backend-store-uri {uri}"
    assert not job["redacted"]
    # A redacted database URI is shown as recorded, with a note.
    db = "postgresql://***@db:5432/ml"
    assert tracking_view(job_tracking([row(tracking_uri=db)]), UI)[0]["redacted"]
    # A tracking server serves its own run pages; the redacted user part is dropped.
    server = row(tracking_uri="https://***@mlflow.example.org/", experiment_id="3")
    assert run_url(server, job_tracking([server]), UI) == (
        "https://mlflow.example.org/#/experiments/3/runs/run-lorp-1"
    )
    assert mlflow_command("https://mlflow.example.org") is None


def test_fallback_only_fills_what_rows_lack() -> None:
    fallback = {"job-a": {"tracking_uri": "sqlite:///old.db", "experiment_id": "1"}}
    old = row()  # an older catalog: no tracking columns
    assert job_tracking([old], fallback)["job-a"] == fallback["job-a"]
    assert (
        run_url(old, job_tracking([old], fallback), UI) == f"{UI}/#/experiments/1/runs/run-lorp-1"
    )
    new = row(tracking_uri="sqlite:///new.db", experiment_id="9")
    assert job_tracking([new], fallback)["job-a"]["experiment_id"] == "9"
    assert run_url(old, job_tracking([old]), UI) is None  # nothing known: no link
    assert legacy_tracking("/nonexistent", [new]) == {}  # rows name their store: no query


# -- markup ------------------------------------------------------------------------------


def test_markup_escapes_text_and_attributes() -> None:
    html = el("td", "<b>&", Markup("<i>ok</i>"), class_="l", data_v='"x"', hidden=True)
    assert html == '<td class="l" data-v="&quot;x&quot;" hidden>&lt;b&gt;&amp;<i>ok</i></td>'


# -- a whole site, without Ray -----------------------------------------------------------


def _stats(n_blocks: int, seed: int = 0):  # type: ignore[no-untyped-def]
    from lorp import SimilarityStats

    states = make_states(n_states=n_blocks + 1, tokens=40, d=32, seed=seed)
    stats = SimilarityStats(n_blocks=n_blocks, model_fingerprint="m", calibration_fingerprint="c")
    stats.update(torch.tensor(states[:, None]))  # [L, batch 1, tokens, d]
    return stats


def _catalog(stats_file: Path) -> list[dict]:
    """Two models; the new columns on one of them, an older catalog's columns on the other."""
    new: dict[str, Any] = dict(
        stats_file=str(stats_file),
        tracking_uri="sqlite:////r/mlflow.db",
        experiment_id="5",
        labels=[0, 0, 1, 1, 1, 1, 2, 2],
    )
    rows = [row("new<m>", "dense", 0, ppl_ptb=10.0, speedup=1.0, ppl_ratio=1.0, **new)]
    acc = dict(acc_copa=55.0, n_copa=60.0, acc_boolq=62.0, n_boolq=3270.0, speedup_std=0.01)
    for method, budget, ppl, speed, bad in [
        ("lorp", 1, 11.0, 1.1, False),
        ("shortgpt", 1, 10.5, 1.6, True),  # over the 8/7 bound, and degraded
        ("lorp", 2, 30.0, 1.2, True),
        ("shortgpt", 2, 40.0, 1.3, True),
    ]:
        measured = dict(ppl_ptb=ppl, ppl_ratio=ppl / 10, speedup=speed, degraded=bad)
        rows.append(row("new<m>", method, budget, **measured, **acc, **new))
    rows += [
        row("old", m, b, ppl_ptb=20.0 + b, acc_copa=50.0) for m, b in [("dense", 0), ("lorp", 1)]
    ]
    return rows


def test_site_from_hand_made_catalog(tmp_path: Path) -> None:
    stats_file = _stats(8).to_file(tmp_path / "s.npz")
    index = build_site(_catalog(stats_file), tmp_path / "site")
    assert sorted(p.name for p in index.parent.iterdir()) == [
        "index.html",
        "model-new_m_.html",
        "model-old.html",
    ]
    text = index.read_text()
    assert "new&lt;m&gt;" in text and "<m>" not in text  # names are escaped
    assert "none (all degraded)" in text  # budget 2 of new<m>
    assert "lorp: " in text and "shortgpt: 10.50" not in text  # degraded never best
    assert "mlflow ui --host 127.0.0.1 --backend-store-uri sqlite:////r/mlflow.db" in text
    assert f'href="{UI}/#/experiments/5/runs/run-dense-0"' in text
    assert not re.findall(r'(?:src|href)="https?://(?!127\.0\.0\.1)', text)
    page = (tmp_path / "site" / "model-new_m_.html").read_text()
    # Three degraded variants: a badge in the layer maps, the three tables and the run list.
    assert page.count('class="badge degraded"') == 3 * 5
    assert page.count('<tr class="degraded">') == 3 * 4
    assert page.count('data-degraded="true"') == 3
    assert '55.00 \u00b1 12.59<span class="mark small">\u2020</span>' in page
    assert "62.00 \u00b1 1.66</td>" in page  # 3270 items: no mark
    assert page.count("above bound</span>") == 1 and "1.60 \u00b1 0.01" in page
    assert "from the catalog" in page and "<svg" in page
    old = (tmp_path / "site" / "model-old.html").read_text()
    assert '50.00<span class="mark unknown">\u2021</span>' in old
    assert "degraded</span>" not in old and "No cached S" in old


def test_no_dashboard_function_over_50_lines() -> None:
    long = []
    for path in sorted(DASHBOARDS.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and node.end_lineno - node.lineno >= 50:
                long.append(f"{path.name}:{node.name}")
    assert long == []


def test_empty_catalog_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="empty"):
        build_site([], tmp_path)


@pytest.mark.integration
def test_legacy_catalog_links_from_the_run_sqlite_store(tmp_path: Path) -> None:
    """A catalog from before the tracking columns: the experiment comes from RUN_DIR's store."""
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{(tmp_path / 'mlflow.db').resolve()}"
    client = MlflowClient(uri)
    exp = client.create_experiment("job-a", artifact_location=str(tmp_path / "art"))
    run = client.create_run(exp).info.run_id
    old = row(mlflow_run_id=run)
    fallback = legacy_tracking(tmp_path, [old])
    assert fallback == {"job-a": {"tracking_uri": uri, "experiment_id": exp}}
    assert run_url(old, job_tracking([old], fallback), UI) == f"{UI}/#/experiments/{exp}/runs/{run}"
    assert legacy_tracking(tmp_path / "elsewhere", [old]) == {}  # no store there: no links


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


def test_the_memory_plan_and_why_speed_is_absent_are_on_the_model_page(tmp_path: Path) -> None:
    """A streamed model's page says how each stage held it and why its speed is absent;
    a page of rows without a plan (older catalogs) says nothing about it."""
    import json

    plan = {
        "capture": {"mode": "streamed", "batch": 8, "need_gib": 6.368, "worker_gib": 7.96,
                    "memory_gib": 56.779, "kept_gib": 3.98},
        "evaluate": {"mode": "memory", "batch": 2, "need_gib": 1.5, "worker_gib": 7.96,
                     "memory_gib": 1.5, "kept_gib": 0.0},
    }  # fmt: skip
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


# -- the job's timeline ------------------------------------------------------------------


def _span(stage: str, model: str, start: float, end: float, node: str, worker: str, **kw: Any):  # type: ignore[no-untyped-def]
    slots = {} if worker == "driver" else {"CPU": 1.0}
    return dict(event="span", stage=stage, model=model, start=start, end=end, node=node,
                worker=worker, slots=slots, **kw)  # fmt: skip


def timeline_events() -> list[dict]:
    """An earlier attempt (ignored), then 4 CPU slots: workers n1/pid 1 and n1/pid 2, one
    on n2, the driver (preparing a and b at once); b's point failed; one unit running."""
    t = 1000.0
    return [
        {"event": "start", "job": "old"},
        _span("load", "a", 900.0, 950.0, "old", "pid 9"),
        {"event": "start", "job": "tl<job>"},
        {"event": "cluster", "kind": "CPU", "slots": {"CPU": 4.0, "GPU": 0.0}, "models": 2},
        {"event": "begin", "unit": "u1", "stage": "point", "model": "b", "point": "p2"},
        {"event": "begin", "unit": "u0", "stage": "point", "model": "b", "point": "p1"},
        {"event": "finish", "unit": "u0"},
        _span("prepare", "a", t, t + 1, "driver", "driver"),
        _span("prepare", "b", t + 0.5, t + 3, "driver", "driver"),  # overlaps: a 2nd lane
        _span("load", "a", t, t + 10, "n1", "pid 1", of="capture"),
        _span("capture", "a", t + 10, t + 30, "n1", "pid 1", shard="shard-0000.parquet"),
        _span("load", "b", t + 2, t + 12, "n1", "pid 2", of="point"),
        _span("point", "b", t + 12, t + 40, "n1", "pid 2", point="p1", failed=True),
        _span("losses", "a", t + 30, t + 40, "n2", "pid 7", selection="lorp", step=2),
        _span("gate", "a", t + 40, t + 42, "driver", "driver"),
        {"event": "span", "stage": "load", "model": "c", "start": None, "end": t},  # cut
    ]


def test_timeline_view_rows_bars_and_figures() -> None:
    from dashboards.timeline_view import timeline_view
    from pipeline.records.timeline import summarise

    events = timeline_events()
    tv = timeline_view(events)
    assert tv is not None and tv["job"] == "tl<job>"
    # One row per worker, by node then first start; the driver's row last.
    assert [r["key"] for r in tv["rows"]] == ["n1/pid 1", "n1/pid 2", "n2/pid 7", "driver"]
    assert tv["rows"][1]["busy"] == 38.0 and tv["rows"][3]["busy"] == 0.0
    assert tv["makespan"] == 42.0 and tv["t0"] == 1000.0
    # Bars: seconds since the attempt's first span, on their worker's row.
    bars = {(b["stage"], b["model"]): b for b in tv["bars"]}
    assert len(tv["bars"]) == 8  # the earlier attempt's span and the cut one are not drawn
    assert (bars["point", "b"]["row"], bars["point", "b"]["start"], bars["point", "b"]["end"]) == (
        1, 12.0, 40.0)  # fmt: skip
    assert bars["point", "b"]["failed"] and not bars["load", "b"]["failed"]
    assert (bars["gate", "a"]["row"], bars["losses", "a"]["row"]) == (3, 2)
    # Overlapping spans on one row (the driver's prepares) take a lane each; a later span
    # goes back to the first free lane.
    assert [r["lanes"] for r in tv["rows"]] == [1, 1, 1, 2]
    lanes = [bars[k]["lane"] for k in [("prepare", "a"), ("prepare", "b"), ("gate", "a")]]
    assert lanes == [0, 1, 0]
    tip = bars["point", "b"]["tip"]
    assert tip.startswith("b p1: point, 28.00 s (from 12.00 s) on n1/pid 2") and "FAILED" in tip
    assert "selection lorp, step 2" in bars["losses", "a"]["tip"]
    assert tv["stages"] == ["load", "capture", "losses", "point", "prepare", "gate"]
    # Headline figures are summarise's: busy 78 slot-s over 4 slots x 42 s; chain a = 40 s.
    u = summarise(events[:-1])  # summarise itself expects every span to have its times
    h = tv["headline"]
    assert h["utilisation"] == u.utilisation == pytest.approx(78 / 168)
    assert (h["slots"], h["kind"], h["busy"], h["lower_bound"]) == (4.0, "CPU", 78.0, 40.0)
    assert (h["chain"], h["chain_model"], h["ratio"]) == (40.0, "a", pytest.approx(42 / 40))
    a, b = tv["models"]
    assert (a["model"], a["first"], a["last"], a["busy"], a["spans"]) == ("a", 0.0, 42.0, 40.0, 5)
    assert a["stages"] == ["prepare", "load", "capture", "losses", "gate"]
    assert (b["first"], b["last"], b["busy"], b["failed"]) == (0.5, 40.0, 38.0, 1)
    assert b["stages"] == ["prepare", "load", "point"]
    assert [r["unit"] for r in tv["running"]] == ["u1"]
    # No span in the latest attempt (an old run, or one just started): no view.
    assert timeline_view(events[:2] + [{"event": "start"}]) is None
    assert timeline_view([]) is None


def test_gantt_bars_sit_where_their_times_say() -> None:
    import xml.etree.ElementTree as ET

    from dashboards.figures import Gantt, gantt_svg, stage_colour, time_ticks
    from dashboards.timeline_view import timeline_view

    tv = timeline_view(timeline_events())
    svg = ET.fromstring(gantt_svg(tv))
    assert (svg.get("data-bars"), svg.get("data-rows")) == ("8", "4")
    rects = [r for r in svg.iter("rect") if r.get("data-stage")]
    assert len(rects) == 8
    g = Gantt(42.0, (1, 1, 1, 2))  # the driver's overlapping spans take two lanes
    assert float(svg.get("height")) == 5 * g.row_h + g.axis_h
    px = g.plot / 42.0
    for r in rects:
        start, end, row = (
            float(r.get("data-start")),
            float(r.get("data-end")),
            int(r.get("data-row")),
        )
        assert float(r.get("x")) == pytest.approx(g.label + start * px, abs=0.01)
        assert float(r.get("width")) == pytest.approx((end - start) * px, abs=0.01)
        lane = int(r.get("data-lane"))
        top = min(row, 3) * g.row_h + lane * g.row_h  # rows above: one lane each
        assert float(r.get("y")) == pytest.approx(top + (g.row_h - g.bar_h) / 2)
        assert r.get("fill") == stage_colour(r.get("data-stage"))
        assert r.find("title").text  # a tooltip on every bar
    point = next(r for r in rects if r.get("data-stage") == "point")
    assert float(point.get("x")) == pytest.approx(170 + 12 * 880 / 42, abs=0.01)  # 421.43
    assert float(point.get("width")) == pytest.approx(28 * 880 / 42, abs=0.01)  # 586.67
    assert point.get("data-row") == "1" and point.get("data-failed") == "true"
    assert point.get("stroke") == "#b3263a"
    prep_b = next(
        r for r in rects if r.get("data-stage") == "prepare" and r[0].text.startswith("b:")
    )
    assert float(prep_b.get("y")) == pytest.approx(4 * 18 + 2.5)  # the driver's 2nd lane
    assert sum(r.get("fill") == "url(#gantt-failed)" for r in svg.iter("rect")) == 1  # hatched
    # Row labels, bottom to top the driver last; tick labels in s under a 2-minute span.
    labels = [t.find("title").tail for t in svg.iter("text") if t.get("class") == "worker"]
    assert labels == ["n1/pid 1", "n1/pid 2", "n2/pid 7", "driver"]
    ticks = [t.text for t in svg.iter("text") if t.get("class") == "tick"]
    assert ticks == ["0 s", "5 s", "10 s", "15 s", "20 s", "25 s", "30 s", "35 s", "40 s"]
    assert time_ticks(600.0)[1] == (60, "1 min") and time_ticks(4 * 3600.0)[1] == (1800, "0.5 h")


def test_timeline_page_in_the_site(tmp_path: Path) -> None:
    import json

    from pipeline.records.timeline import summarise

    rows = [row("a", "dense", 0, ppl_ptb=10.0), row("a", "lorp", 1, ppl_ptb=11.0)]
    events = tmp_path / "run" / "events.jsonl"
    events.parent.mkdir()
    events.write_text("".join(json.dumps(e) + "\n" for e in timeline_events()) + '{"cut')
    index = build_site(rows, tmp_path / "site", events_file=events)
    assert sorted(p.name for p in index.parent.iterdir()) == [
        "index.html",
        "model-a.html",
        "timeline.html",
    ]
    assert '<nav class="pages">Pages: <a href="timeline.html">job timeline</a></nav>' in (
        index.read_text()
    )
    page = (tmp_path / "site" / "timeline.html").read_text()
    assert "<h1>Timeline: tl&lt;job&gt;</h1>" in page  # names escaped
    # The utilisation printed is summarise's, to 0.1%: 78 / 168 = 46.4%.
    shown = f"{100 * summarise(timeline_events()[:-1]).utilisation:.1f}%"
    assert shown == "46.4%"
    assert f'<td class="l" data-figure="utilisation">{shown} ' in page
    assert '<td class="l" data-figure="slots">4 CPU</td>' in page
    assert "makespan / bound 1.05" in page and "40.0 s (a)" in page
    assert page.count("data-stage=") == 8 and page.count('data-failed="true"') == 1
    assert "Running now (1): b p2 point" in page
    assert '<td data-v="38.0"><span>38.0</span></td>' in page  # b's busy slot-seconds
    assert not re.findall(r'(?:src|href)="https?://', page)
    # An old run: events without spans; no events file at all. The site builds either way.
    events.write_text(json.dumps({"event": "start"}) + "\n")
    index = build_site(rows, tmp_path / "old", events_file=events)
    old = (tmp_path / "old" / "timeline.html").read_text()
    assert "No timeline: no span recorded in events.jsonl" in old and "<svg" not in old
    assert 'href="timeline.html"' in index.read_text()  # it has events: linked, says why
    index = build_site(rows, tmp_path / "none", events_file=tmp_path / "missing.jsonl")
    assert (
        "No timeline: no events.jsonl in the run directory"
        in (tmp_path / "none" / "timeline.html").read_text()
    )
    assert "timeline.html" not in index.read_text() and "<nav" not in index.read_text()
