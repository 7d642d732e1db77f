"""The fleet scheduler on a real local Ray: models' stages overlap (read from the job's own
timeline, not from timing), one model at a time does not, and the timeline's figures
follow from its spans."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.driver.run import run_job
from pipeline.events.log import read_events
from pipeline.events.status import format_status, run_status
from pipeline.events.timeline import spans_of, summarise
from pipeline.spec.parse import parse_spec
from tests.helpers.job_specs import tiny_job
from tests.helpers.tiny_models import save_tiny_ptb

RAY_CPUS = 4
"""The fleet's points and a capture worker side by side."""

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {
        "a": save_tiny_ptb("llama", root / "a", n_blocks=6),
        "b": save_tiny_ptb("qwen3", root / "b", n_blocks=8),
    }


def fleet_job(tmp_path: Path, models: dict[str, Path], name: str, **resources) -> dict:  # type: ignore[no-untyped-def]
    spec = tiny_job(tmp_path, models["a"], name, budgets=[1, 2])
    spec["models"] = [{"ref": str(p), "name": n} for n, p in models.items()]
    spec["methods"] = [{"name": "lorp"}]
    spec["resources"] = {"max_concurrent_points": 2, "capture_workers": 2, **resources}
    return spec


def worker_spans(run_dir: Path, model: str) -> list[dict]:  # type: ignore[type-arg]
    spans = spans_of(read_events(run_dir / "events.jsonl"))
    return [s for s in spans if s.get("model") == model and s.get("slots")]


def overlap(a: list[dict], b: list[dict]) -> bool:  # type: ignore[type-arg]
    """Some unit of `a` and some unit of `b` ran at the same time."""
    return any(x["start"] < y["end"] and y["start"] < x["end"] for x in a for y in b)


def test_two_models_stages_overlap_and_one_at_a_time_does_not(
    ray_cluster, models: dict[str, Path], tmp_path: Path
) -> None:
    together = parse_spec(fleet_job(tmp_path, models, "together"))
    summary = run_job(together)
    assert summary.done == 2 * 2 and not summary.failed
    run_dir = tmp_path / "together"
    a, b = worker_spans(run_dir, "a"), worker_spans(run_dir, "b")
    # every stage a worker ran is on the timeline, with where it ran and what it held
    assert {s["stage"] for s in a} >= {"load", "capture", "point"}, {s["stage"] for s in a}
    assert sum(s["stage"] == "point" for s in a + b) == 4
    assert all(s["node"] and s["worker"].startswith("pid ") for s in a + b)
    assert all(s["slots"] == {"CPU": 1.0} for s in a + b)
    assert overlap(a, b), "model b's stages waited for model a's"

    serial = parse_spec(fleet_job(tmp_path, models, "serial", max_models_in_flight=1))
    assert run_job(serial).done == 4
    run_dir = tmp_path / "serial"
    a, b = worker_spans(run_dir, "a"), worker_spans(run_dir, "b")
    assert a and b and max(s["end"] for s in a) <= min(s["start"] for s in b)

    # the figures follow from the spans: busy slot-seconds, makespan, the bound
    events = read_events(tmp_path / "together" / "events.jsonl")
    u = summarise(events)
    assert u is not None and u.kind == "CPU" and u.slots == 4.0
    spans = [s for s in spans_of(events) if s.get("slots")]
    busy = sum(s["slots"]["CPU"] * (s["end"] - s["start"]) for s in spans)
    assert u.busy == pytest.approx(busy)
    assert u.makespan == pytest.approx(
        max(s["end"] for s in spans_of(events)) - min(s["start"] for s in spans_of(events))
    )
    assert u.lower_bound <= u.makespan and 0 < u.utilisation <= 1.0
    fleet = [e for e in events if e["event"] == "fleet"][-1]
    assert fleet["points"] == 4 and fleet["driver_ms_per_point"] > 0

    lines = format_status(run_status(tmp_path / "together"))
    busy_line = next(x for x in lines if x.startswith("busy"))
    assert "of 4 CPU slot(s)" in busy_line and f"{u.utilisation:.0%}" in busy_line, lines
    assert not any(x.startswith("now") for x in lines)  # finished: nothing runs


BROKEN = "broken-after-points"


@pytest.fixture
def broken_method(tmp_path: Path):  # type: ignore[no-untyped-def]
    """A method whose selection fails once the job has finished a point: its model fails
    in preparation after some of its points ended."""
    import time

    from lorp.methods.registry import register_method, unregister_method

    events = tmp_path / "broken" / "events.jsonl"

    @register_method(BROKEN)
    def broken(stats, budget):  # type: ignore[no-untyped-def]
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if events.is_file() and '"event": "point"' in events.read_text():
                raise RuntimeError("selection broke after points finished")
            time.sleep(0.2)
        raise AssertionError("no point finished within 300 s")

    yield BROKEN
    unregister_method(BROKEN)


def test_a_model_failing_after_points_finished_still_gates_and_registers_them(
    ray_cluster, models: dict[str, Path], tmp_path: Path, broken_method: str
) -> None:
    """The model's preparation fails (a selection raises) after its first points ended:
    the failure is recorded, and the points it had handed over are recorded, gated and
    registered like any other model's."""
    from mlflow.tracking import MlflowClient

    from pipeline.catalog.table import read_catalog

    spec = tiny_job(tmp_path, models["a"], "broken", budgets=[1])
    spec["methods"] = [{"name": "shortgpt"}, {"name": broken_method}]
    ev = {"perplexity": ["ptb", "lee"], "seq_len": 48, "max_windows": 2, "speed": False}
    spec["evaluation"] = ev  # calibrated on a mix of PTB and Wikipedia, judged on news
    spec["calibration"] |= {"dataset": [{"name": "ptb", "weight": 2}, {"name": "wiki"}]}
    summary = run_job(parse_spec(spec))
    assert summary.failed == ["tiny: selection broke after points finished"]

    rows = {r["method"]: r for r in read_catalog(tmp_path / "broken" / "catalog")}
    assert set(rows) == {"dense", "shortgpt"} and summary.done == 2
    dense, pruned = rows["dense"], rows["shortgpt"]
    # judged on the held-out news (calibrated on PTB), with both ratios kept
    assert pruned["ratio_ptb"] == pytest.approx(pruned["ppl_ptb"] / dense["ppl_ptb"])
    assert pruned["ratio_lee"] == pytest.approx(pruned["ppl_lee"] / dense["ppl_lee"])
    assert pruned["ppl_ratio"] == pruned["ratio_lee"] and pruned["judged_on"] == "lee"
    assert json.loads(pruned["calibration"])["dataset"] == [
        {"name": "ptb", "weight": 2},
        {"name": "wiki", "weight": 1.0},
    ] and pruned["calibration_id"].startswith("mix-")
    assert pruned["degraded"] == (pruned["ppl_ratio"] > 3.0)
    assert pruned["fits_calibration_only"] == (pruned["ratio_lee"] > 1.5 * pruned["ratio_ptb"])
    client = MlflowClient(tracking_uri=summary.tracking_uri, registry_uri=summary.tracking_uri)
    by_version = {
        f"models:/lorp-tiny/{v.version}": v.tags["lorp.grid_key"]
        for v in client.search_model_versions("name = 'lorp-tiny'")
    }
    assert by_version == {
        dense["model_uri"]: dense["grid_key"],
        pruned["model_uri"]: pruned["grid_key"],
    }
    aliases = client.get_registered_model("lorp-tiny").aliases
    assert f"models:/lorp-tiny/{aliases['dense']}" == dense["model_uri"]
    if not pruned["degraded"]:
        assert f"models:/lorp-tiny/{aliases['best-1']}" == pruned["model_uri"]
    # the cost columns, on every row (lorp.serving_cost; counted by hand in
    # tests/lorp/test_serving_cost.py)
    for row in (dense, pruned):
        assert row["weight_bytes"] == row["params"] * 4  # float32
    assert dense["predicted_prefill_speedup"] == dense["predicted_decode_speedup"] == 1.0
    kept = len(pruned["kept_layers"])
    assert kept == 5 and pruned["kv_bytes_per_token"] == dense["kv_bytes_per_token"] * kept / 6
    for what in ("prefill", "decode"):  # 1 of 6 blocks: the head and embeddings stay
        assert 1.0 < pruned[f"predicted_{what}_speedup"] < 6 / 5
    lines = format_status(run_status(tmp_path / "broken"))
    assert any(x.startswith("predicted    prefill") and "not timed" in x for x in lines), lines
    events = read_events(tmp_path / "broken" / "events.jsonl")
    kinds = [e["event"] for e in events]
    assert kinds.index("model_failed") < kinds.index("register") and "model_done" in kinds

    # resumed with a second budget: dense and shortgpt-b1 are done, shortgpt-b2 runs, the
    # model fails again; its gate and registry see the rows already there too: one new
    # version (b2), the dense one kept (no second dense version from the parent run)
    again = run_job(parse_spec(spec | {"budgets": [1, 2]}))
    assert (again.done, again.skipped, again.failed) == (1, 2, summary.failed)
    rows = {r["budget"]: r for r in read_catalog(tmp_path / "broken" / "catalog")}
    assert rows[2]["ppl_ratio"] == pytest.approx(rows[2]["ppl_lee"] / dense["ppl_lee"])
    assert len(client.search_model_versions("name = 'lorp-tiny'")) == 3
    now = client.get_registered_model("lorp-tiny").aliases
    assert now["dense"] == aliases["dense"] and now.get("best-1") == aliases.get("best-1")
    assert rows[2]["model_uri"] and rows[0]["model_uri"] == dense["model_uri"]
