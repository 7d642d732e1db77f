"""The Ray fleet pipeline on a real local Ray and a real sqlite MLflow store."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from mlflow.tracking import MlflowClient

from pipeline.catalog.table import Catalog, read_catalog, write_catalog
from pipeline.cluster.model_source import ModelSource
from pipeline.driver.run import run_job
from pipeline.events.log import EventLog
from pipeline.messages import CaptureTask
from pipeline.spec.calibration import CalibrationSpec
from pipeline.spec.parse import parse_spec
from pipeline.stages.calibration import read_shard, write_shards
from pipeline.stages.capture import distributed_capture, start_capture_workers
from pipeline.stages.statistics import load_shards
from tests.helpers.cli_runner import lorp
from tests.helpers.job_specs import tiny_job, write_job
from tests.helpers.progress_lines import progress_lines
from tests.helpers.tiny_models import save_tiny_ptb

pytestmark = [pytest.mark.integration]

LORP = shutil.which("lorp") or str(Path(sys.executable).parent / "lorp")


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {
        "llama": save_tiny_ptb("llama", root / "llama"),
        "qwen3": save_tiny_ptb("qwen3", root / "qwen3", n_blocks=8),
    }


def job(tmp_path: Path, model: Path, **overrides) -> dict:  # type: ignore[no-untyped-def]
    spec = tiny_job(tmp_path, model, **overrides)
    return spec | {"output_dir": str(tmp_path / "run"), "cache_dir": str(tmp_path / "cache")}


def mlflow_runs(run_dir: Path, experiment: str) -> list:  # type: ignore[no-untyped-def]
    client = MlflowClient(f"sqlite:///{run_dir / 'mlflow.db'}")
    exp = client.get_experiment_by_name(experiment)
    return client.search_runs([exp.experiment_id], max_results=1000)


def test_three_shards_through_ray_equal_one_pass_without_it(
    ray_cluster, models, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lorp.locality.capture import capture_stats

    tok = AutoTokenizer.from_pretrained(models["llama"])
    single = CalibrationSpec(samples=12, seq_len=48, shards=1)
    one_shard = write_shards(tok, single, tmp_path / "s1")
    windows = read_shard(one_shard.paths[0])
    model = AutoModelForCausalLM.from_pretrained(models["llama"]).eval()
    one = capture_stats(model, [windows[i : i + 2] for i in range(0, 12, 2)], progress=False)

    cal = CalibrationSpec(samples=12, seq_len=48, shards=3, batch_size=2)
    sh = write_shards(tok, cal, tmp_path / "s3")
    assert len(sh.paths) == 3
    task = CaptureTask(ModelSource(str(models["llama"]), "dir"), sh.fingerprint, batch_size=2)
    three = distributed_capture(task, load_shards(sh))
    assert one.tokens == three.tokens == 12 * 48
    # Workers started before the shards were cut (no calibration yet) get it with each
    # shard: the same S, carrying the shards' fingerprint.
    early = start_capture_workers(replace(task, calibration=""), 3, None)
    again = distributed_capture(task, load_shards(sh), actors=early)
    assert again.calibration_fingerprint == sh.fingerprint
    np.testing.assert_allclose(again.gram, three.gram, rtol=1e-6)
    # Other processes, other thread counts: equal to float32 rounding, not bit for bit.
    np.testing.assert_allclose(three.gram, one.gram, rtol=1e-6)
    # The shards hold exactly the one shard's windows, in order.
    assert np.array_equal(
        np.concatenate(
            [read_shard(p).numpy() for p in sorted((tmp_path / "s3").rglob("*.parquet"))]
        ),
        read_shard(next((tmp_path / "s1").rglob("*.parquet"))).numpy(),
    )


def test_grid_captures_once_records_everything_resumes_and_shares_S(
    ray_cluster, models, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    put, at_put = Catalog.put, []

    def spy(catalog: Catalog, row: dict) -> None:  # what the run holds as its row goes in
        run = MlflowClient(row["tracking_uri"]).get_run(row["mlflow_run_id"])
        at_put.append((run.info.status, run.data.metrics.get("params"), row["params"]))
        put(catalog, row)

    monkeypatch.setattr(Catalog, "put", spy)
    spec = parse_spec(job(tmp_path, models["llama"]))
    summary = run_job(spec)
    # A driver killed once a row is in leaves a run that holds the row's figures: each
    # run has them, still RUNNING, before its row goes into the catalog.
    assert len(at_put) == 9
    assert all(status == "RUNNING" and logged == params for status, logged, params in at_put)
    run_dir = tmp_path / "run"
    events = EventLog(run_dir / "events.jsonl").read()
    assert [e["source"] for e in events if e["event"] == "capture"] == ["computed"]
    assert summary.done == 9 and not summary.failed

    rows = read_catalog(run_dir / "catalog")
    assert len(rows) == 9
    assert Counter(r["method"] for r in rows) == {"lorp": 3, "shortgpt": 3, "streamline": 3}
    for r in rows:
        assert len(r["pruned_layers"]) == r["budget"] and len(r["kept_layers"]) == 6 - r["budget"]
        assert r["params"] < r["params_dense"] and np.isfinite(r["rls"]) and r["k"] in (2, 3, 4)
        assert Path(r["checkpoint"], "lorp_pruning.json").is_file()
        prov = json.loads(Path(r["checkpoint"], "lorp_pruning.json").read_text())
        assert prov["pruned"] == r["pruned_layers"] and prov["grid_key"] == r["grid_key"]

    runs = mlflow_runs(run_dir, "grid")
    points = [r for r in runs if r.data.tags["lorp.kind"] == "point"]
    parents = [r for r in runs if r.data.tags["lorp.kind"] == "model"]
    assert len(points) == 9 and len(parents) == 1
    assert {r.info.status for r in runs} == {"FINISHED"}
    by_id = {r.info.run_id: r for r in points}
    for row in rows:
        run = by_id[row["mlflow_run_id"]]
        assert run.data.params["method"] == row["method"]
        assert json.loads(run.data.params["pruned_layers"]) == row["pruned_layers"]
        assert run.data.tags["mlflow.parentRunId"] == parents[0].info.run_id
        assert run.data.metrics["params"] == row["params"]
    parent = parents[0]
    assert parent.data.metrics["rls"] == pytest.approx(rows[0]["rls"])
    assert {"lorp.version", "lorp.git_commit"} <= set(parent.data.tags)
    artifacts = {
        a.path for a in MlflowClient(summary.tracking_uri).list_artifacts(parent.info.run_id)
    }
    assert {"S.npy", "S.png", "clusters.json"} <= artifacts

    # A rerun captures nothing and adds no rows or runs.
    again = run_job(spec)
    assert (again.done, again.skipped, again.captured, again.cached) == (0, 9, 0, 1)
    # It knew S was cached before starting any capture worker, where the first start
    # had started its workers before cutting the shards (their model loads meanwhile).
    captures = [e for e in EventLog(run_dir / "events.jsonl").read() if e["event"] == "capture"]
    assert [(e["source"], e["early_workers"]) for e in captures] == [("computed", 1), ("cache", 0)]
    assert len(read_catalog(run_dir / "catalog")) == 9
    assert len(mlflow_runs(run_dir, "grid")) == 10

    # --force redoes every point, replacing (not duplicating) rows and runs.
    forced = run_job(spec, force=True)
    assert forced.done == 9 and forced.captured == 1
    rows2 = read_catalog(run_dir / "catalog")
    assert len(rows2) == 9 and {r["grid_key"] for r in rows2} == {r["grid_key"] for r in rows}
    live = [r for r in mlflow_runs(run_dir, "grid") if r.data.tags["lorp.kind"] == "point"]
    assert len(live) == 9 and {r.info.run_id for r in live} == {r["mlflow_run_id"] for r in rows2}

    # The same checkpoint under another name and path shares the cached S (content key).
    copy = tmp_path / "renamed"
    shutil.copytree(models["llama"], copy)
    other = job(tmp_path, copy, name="renamed", budgets=[1], methods=[{"name": "shortgpt"}])
    other["output_dir"] = str(tmp_path / "run2")
    renamed = run_job(parse_spec(other))
    assert (renamed.captured, renamed.cached) == (0, 1)


def test_lorp_run_talks_records_reevaluates_and_merges(ray_cluster, models, tmp_path: Path) -> None:
    """The product command in its own process (embedded Ray): a line per point while
    `lorp status` follows the run; dense and pruned variants evaluated, timed and
    recorded alike in the catalog and MLflow; a changed evaluation setting re-evaluates
    every point from the cached S; `lorp catalog merge` unions catalogs by grid key. The
    later commands run in this process (`lorp.cli:main`, on the module's Ray): their own
    process would add nothing the first run has not shown."""
    from pipeline.events.status import run_status

    ev = {"perplexity": ["ptb"], "seq_len": 48, "max_windows": 2, "speed": True}
    methods = [
        {"name": "lorp"},
        {"name": "lorp", "label": "lorp-rel", "options": {"variant": "released"}},
    ]
    spec = job(
        tmp_path,
        models["llama"],
        name="talk",
        budgets=[2],
        methods=methods,
        evaluation=ev,
        ray={"num_cpus": 2},
    )
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [LORP, "run", str(write_job(tmp_path, spec))],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    states = set()
    while proc.poll() is None:
        if (run_dir / "events.jsonl").is_file():
            states.add(run_status(run_dir).state)
        time.sleep(0.3)
    out, err = proc.communicate()
    assert proc.returncode == 0, err[-3000:]
    assert "running" in states
    assert "catalog" in out and "mlflow.db" in out and "checkpoints" in out
    lines = [ln for ln in err.splitlines() if re.search(r"\[\d/3\] tiny ", ln)]
    assert len(lines) == 3, err[-3000:]  # dense + 2 variants, each with its figure and ETA
    assert all("ppl_ptb" in ln and "left, ETA" in ln for ln in lines)
    assert "[3/3]" in lines[-1] and "0 left" in lines[-1]

    status = lorp("status", str(run_dir))
    assert status.returncode == 0, status.stderr
    assert "finished" in status.stdout and "3 done, 0 failed, 0 left of 3" in status.stdout

    rows = read_catalog(run_dir / "catalog")
    assert len(rows) == 1 + 2  # a dense row, then the two methods at budget 2
    assert all(np.isfinite(r["ppl_ptb"]) and r["ppl_ptb"] > 1 for r in rows)
    dense = next(r for r in rows if r["method"] == "dense")
    assert dense["budget"] == 0 and dense["params"] == dense["params_dense"]
    assert dense["speedup"] == 1.0 and all(r["latency_ms"] > 0 for r in rows)
    by_id = {r.info.run_id: r for r in mlflow_runs(run_dir, "talk")}
    for row in rows:  # the same figures in both records
        metrics = by_id[row["mlflow_run_id"]].data.metrics
        assert metrics["ppl_ptb"] == pytest.approx(row["ppl_ptb"])
        assert metrics["latency_ms"] == pytest.approx(row["latency_ms"])
        assert row["eval_backend"] == "transformers"
        assert by_id[row["mlflow_run_id"]].data.tags["eval_backend"] == "transformers"
    assert all(r["speed_runs"] >= 6 and r["speedup_low"] <= r["speedup_high"] for r in rows)

    # --force-speed: the points stay, their speed is timed again into the same rows/runs
    timed = lorp("run", "-q", "--force-speed", str(write_job(tmp_path, spec)))
    assert timed.returncode == 0, timed.stderr[-3000:]
    assert "0 done, 3 already done" in timed.stdout, timed.stdout
    retimed = {r["grid_key"]: r for r in read_catalog(run_dir / "catalog")}
    assert retimed.keys() == {r["grid_key"] for r in rows}
    by_id = {r.info.run_id: r for r in mlflow_runs(run_dir, "talk")}
    for row in rows:
        again_row = retimed[row["grid_key"]]
        assert again_row["mlflow_run_id"] == row["mlflow_run_id"]
        assert again_row["ppl_ptb"] == row["ppl_ptb"]
        assert again_row["latency_ms"] != row["latency_ms"]  # a new timing, not the old one
        metrics = by_id[row["mlflow_run_id"]].data.metrics
        assert metrics["latency_ms"] == pytest.approx(again_row["latency_ms"])
    rows = list(retimed.values())
    before = by_slot(run_dir)
    write_catalog(tmp_path / "before.parquet", read_catalog(run_dir / "catalog"))

    spec["evaluation"] = ev | {"max_windows": 3, "speed": False}
    again = lorp("run", "-q", str(write_job(tmp_path, spec)))
    assert again.returncode == 0, again.stderr[-3000:]
    assert "3 done, 0 already done" in again.stdout and "from cache 1" in again.stdout
    assert not re.search(r"\[\d/3\]", again.stderr)  # --quiet
    after = by_slot(run_dir)
    assert set(after) == set(before) and len(after) == 3  # replaced, not added
    for name, row in after.items():
        assert row["grid_key"] != before[name]["grid_key"]
        assert row["ppl_ptb"] != before[name]["ppl_ptb"]  # 3 windows, not 2
        assert json.loads(row["evaluation"])["max_windows"] == 3
        assert row.get("latency_ms") is None  # speed off: no figure, not 0
    runs = [r for r in mlflow_runs(run_dir, "talk") if r.data.tags["lorp.kind"] == "point"]
    assert {r.info.run_id for r in runs} == {r["mlflow_run_id"] for r in after.values()}

    merged = tmp_path / "org.parquet"
    out = lorp(
        "catalog",
        "merge",
        str(tmp_path / "before.parquet"),
        str(run_dir / "catalog"),
        str(run_dir / "catalog"),
        "--out",
        str(merged),
    )
    assert out.returncode == 0, out.stderr
    keys = [r["grid_key"] for r in read_catalog(merged)]
    assert sorted(keys) == sorted(r["grid_key"] for r in [*before.values(), *after.values()])


def by_slot(run_dir: Path) -> dict[str, dict]:
    return {f"{r['method_label']}-{r['budget']}": r for r in read_catalog(run_dir / "catalog")}


@pytest.mark.parametrize(
    ("method", "message"),
    [
        ({"name": "lorp", "options": {"variant": "latest"}}, r"methods\[0\].options: .*'latest'"),
        ({"name": "lorp", "options": {"k": 0}}, r"methods\[0\].options: .*'k'.*got 0"),
        ({"name": "lorp", "options": {"k": 7}}, r"methods\[0\].options: .*7 exceeds .*\(6\)"),
    ],
)
def test_bad_option_value_fails_before_any_file(  # type: ignore[no-untyped-def]
    models, tmp_path: Path, method, message, capsys
) -> None:
    from lorp.cli import main  # `lorp run` in this process: the spec fails before Ray

    spec = job(tmp_path, models["llama"], name="bad", methods=[method])
    assert main(["run", str(write_job(tmp_path, spec))]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and re.search(message, err), err
    assert not (tmp_path / "run").exists() and not (tmp_path / "cache").exists()


def test_loss_guided_methods_score_candidates_on_parallel_actors(
    ray_cluster, models, tmp_path: Path
) -> None:
    """sleb and lorp-loss get a `losses` callable served by 2 Ray actors at once; their
    selections are cached, so a rerun evaluates nothing. Each scored batch is a line."""
    methods = [{"name": "sleb"}, {"name": "lorp-loss"}]
    spec = job(tmp_path, models["llama"], name="loss", budgets=[2], methods=methods)
    with progress_lines() as lines:
        summary = run_job(parse_spec(spec))
    sleb_lines = [x for x in lines if " sleb-b2 step " in x]  # sleb runs first: no memo
    assert [x.split(" step ")[1].split(":")[0] for x in sleb_lines] == ["1", "2"], lines
    assert "4 candidates scored in " in sleb_lines[0] and "on 2 actors" in sleb_lines[0]
    assert any(x.startswith("selected ") and "sleb-b2: 7 evaluations" in x for x in lines)
    assert summary.done == 2 and not summary.failed
    rows = {r["method"]: r for r in read_catalog(tmp_path / "run" / "catalog")}
    assert rows["sleb"]["n_evals"] == 4 + 3  # N=6: blocks 1..4, then the 3 left
    assert 0 < rows["lorp-loss"]["n_evals"] <= rows["sleb"]["n_evals"]
    assert all(r["select_s"] > 0 for r in rows.values())
    events = EventLog(tmp_path / "run" / "events.jsonl").read()
    batches = [e for e in events if e["event"] == "losses"]
    assert (
        sum(e["candidates"] for e in batches)
        == rows["sleb"]["n_evals"] + rows["lorp-loss"]["n_evals"]
    )
    # Every batch is split over the two actors, shares as even as they can be (whether
    # the two shares then run at the same time is the scheduler's, not asserted here).
    for e in batches:
        shares = sorted(s["n"] for s in e["spans"])
        assert sum(shares) == e["evaluated"], e
        if e["evaluated"] >= 2:
            assert len({s["pid"] for s in e["spans"]}) == 2 and shares[1] - shares[0] <= 1, e
    assert any(e["evaluated"] >= 2 for e in batches)
    # lorp-loss asks for sets SLEB already scored: the memo serves them, nothing twice.
    evaluated = sum(e["evaluated"] for e in batches)
    assert 0 < evaluated < sum(e["candidates"] for e in batches)

    again = run_job(parse_spec(spec))
    assert again.skipped == 2
    events = EventLog(tmp_path / "run" / "events.jsonl").read()
    assert len([e for e in events if e["event"] == "losses"]) == len(batches)  # cached
