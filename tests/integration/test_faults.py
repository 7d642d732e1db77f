"""Faults on the real local Ray and sqlite MLflow: nothing lost, duplicated or half-written;
and a job stopped while it waits for a worker node that never joins."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from contextlib import suppress
from pathlib import Path

import numpy as np
import pytest
from mlflow.tracking import MlflowClient

from lorp import SimilarityStats
from pipeline.catalog.table import read_catalog
from pipeline.cluster.faults import FAULT_MARKER_ENV, FAULT_POINT_ENV, FAULT_SHARD_ENV
from pipeline.events.log import read_events
from pipeline.stages.calibration import read_shard
from tests.helpers import RAY_TEST_ENV
from tests.helpers.job_specs import tiny_job, write_job
from tests.helpers.local_servers import free_port, wait_for_port
from tests.helpers.processes import kill_started_by
from tests.helpers.ray_cluster import RAY_CLI
from tests.helpers.tiny_models import save_tiny_ptb

pytestmark = [pytest.mark.integration, pytest.mark.slow]
LORP = shutil.which("lorp") or str(Path(sys.executable).parent / "lorp")


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return save_tiny_ptb("llama", tmp_path_factory.mktemp("m") / "llama")


def perplexity_job(tmp_path: Path, model: Path, name: str, **extra) -> Path:  # type: ignore[no-untyped-def]
    """A tiny job judged on PTB perplexity, written as YAML."""
    evaluation = {"perplexity": ["ptb"], "seq_len": 48, "max_windows": 2, "speed": False}
    # checkpoints: full, since the saved variants are loaded below
    spec = tiny_job(
        tmp_path, model, name, evaluation=evaluation, ray={"num_cpus": 2}, checkpoints="full"
    )
    return write_job(tmp_path, spec | extra)


def stats_of(run_dir: Path) -> SimilarityStats:
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    return SimilarityStats.from_file(next(e["file"] for e in events if e["event"] == "capture"))


def test_workers_killed_mid_shard_and_mid_checkpoint_are_retried(
    model: Path, tmp_path: Path
) -> None:
    """One run loses a capture worker mid-shard and a grid worker mid-checkpoint; its S
    equals S captured here without Ray (the retried shard counted exactly once), and the
    retried point's checkpoint scores what an undisturbed evaluation of it does."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lorp.locality.capture import capture_stats
    from pipeline.evaluation.backends import TransformersBackend, evaluate
    from pipeline.plan.models import plan_models
    from pipeline.spec.parse import load_spec
    from pipeline.stages.statistics import calibration_shards, capture_task

    faulty = perplexity_job(tmp_path, model, "faulty", budgets=[2], methods=[{"name": "lorp"}])
    marker = tmp_path / "died-once"
    faults = {FAULT_SHARD_ENV: "shard-0001.parquet", FAULT_POINT_ENV: "lorp-b2"}
    env = dict(os.environ, **faults, **{FAULT_MARKER_ENV: str(marker)})
    out = subprocess.run(
        [LORP, "run", str(faulty)], capture_output=True, text=True, timeout=900, env=env
    )
    assert out.returncode == 0, out.stderr[-3000:]
    # The workers really died (os._exit): one mid-shard, one before writing the checkpoint.
    assert Path(f"{marker}.capture").is_file() and Path(f"{marker}.point").is_file()

    spec = load_spec(faulty)
    (plan,) = plan_models(spec)
    shards = calibration_shards(spec.calibration, plan, tmp_path / "faulty")  # the run's own files
    task = capture_task(spec.resources.capture, spec.calibration, plan, shards)
    dense = AutoModelForCausalLM.from_pretrained(model).eval()
    windows = torch.cat([read_shard(p) for p in shards.paths])
    size = spec.calibration.batch_size
    want = capture_stats(
        dense,
        [windows[i : i + size] for i in range(0, len(windows), size)],
        model_fingerprint=task.model.fingerprint,
        calibration_fingerprint=task.calibration,
        skip_prefix=task.skip_prefix,
        progress=False,
    )
    got = stats_of(tmp_path / "faulty")
    assert got.tokens == want.tokens == 12 * 48  # the retried shard counted exactly once
    np.testing.assert_allclose(got.gram, want.gram, rtol=1e-6)

    rows = read_catalog(tmp_path / "faulty" / "catalog")
    assert len(rows) == 2 and all(np.isfinite(r["ppl_ptb"]) for r in rows)
    pruned = next(r for r in rows if r["method"] == "lorp")
    assert (Path(pruned["checkpoint"]) / "model.safetensors").is_file()
    saved = AutoModelForCausalLM.from_pretrained(pruned["checkpoint"]).eval()
    tokenizer = AutoTokenizer.from_pretrained(pruned["checkpoint"])
    assert saved.config.num_hidden_layers == 6 - 2
    backend = TransformersBackend(saved, tokenizer, spec.evaluation.batch_size)
    metrics = evaluate(backend, tokenizer, spec.evaluation)
    assert pruned["ppl_ptb"] == pytest.approx(metrics["ppl_ptb"], rel=1e-5)


def test_driver_sigkill_mid_grid_then_rerun_lands_every_point_once(tmp_path: Path) -> None:
    """2 models x 2 budgets x 2 methods, 4 points in flight at once; the driver is
    SIGKILLed mid-grid and rerun: every point lands once in the catalog and once FINISHED
    in MLflow, row for row the same point, and no checkpoint is left half-written."""
    root = tmp_path / "models"
    a = save_tiny_ptb("llama", root / "a", n_blocks=8)
    b = save_tiny_ptb("qwen3", root / "b", n_blocks=8)
    methods = [{"name": m} for m in ("lorp", "shortgpt")]
    job = perplexity_job(
        tmp_path,
        a,
        "killed",
        models=[{"ref": str(a), "name": "a"}, {"ref": str(b), "name": "b"}],
        budgets=[1, 3],
        methods=methods,
        resources={"max_concurrent_points": 4, "grid": {"num_cpus": 0.5}},
    )
    points = 2 * (1 + 2 * 2)  # per model: the dense model, then budgets x methods
    run_dir = tmp_path / "killed"
    proc = subprocess.Popen(
        [LORP, "run", str(job)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.time() + 600
    while time.time() < deadline:  # kill once some, not all, points are done
        events = run_dir / "events.jsonl"
        done = events.is_file() and events.read_text().count('"event": "point"') >= 4
        if done or proc.poll() is not None:
            break
        time.sleep(0.2)
    assert proc.poll() is None, "the job ended before it could be killed"
    # The driver and its embedded Ray (which would outlive it) are killed together: every
    # process it started, found by process id; no other Ray on this machine is touched.
    kill_started_by(proc.pid)
    proc.wait()
    before = read_catalog(run_dir / "catalog")
    assert 4 <= len(before) < points

    out = subprocess.run([LORP, "run", str(job)], capture_output=True, text=True, timeout=1200)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = read_catalog(run_dir / "catalog")
    assert len(rows) == points and len({r["grid_key"] for r in rows}) == points
    assert {r["grid_key"] for r in before} <= {r["grid_key"] for r in rows}  # kept, not redone
    client = MlflowClient(f"sqlite:///{run_dir / 'mlflow.db'}")
    exp = client.get_experiment_by_name("killed")
    runs = client.search_runs([exp.experiment_id], max_results=1000)
    point_runs = [r for r in runs if r.data.tags["lorp.kind"] == "point"]
    finished = {r.info.run_id: r for r in point_runs if r.info.status == "FINISHED"}
    per_point = Counter(r.data.tags["lorp.grid_key"] for r in finished.values())
    assert per_point == {r["grid_key"]: 1 for r in rows}  # one FINISHED run per point
    assert {r.info.status for r in point_runs} <= {"FINISHED", "FAILED"}  # none RUNNING
    for row in rows:  # row for row: the same point, the same layers, the same size
        run = finished[row["mlflow_run_id"]]
        assert run.data.tags["lorp.grid_key"] == row["grid_key"]
        assert json.loads(run.data.params["pruned_layers"]) == row["pruned_layers"]
        assert int(run.data.params["budget"]) == row["budget"]
        assert run.data.metrics["params"] == row["params"]
        assert np.isfinite(row["ppl_ptb"])
    # No half-written checkpoint: every directory is complete, no partial left behind.
    for model in ("a", "b"):
        assert not list((run_dir / "checkpoints" / model).glob(".*partial"))
    for r in rows:
        if r["checkpoint"]:
            assert (Path(r["checkpoint"]) / "model.safetensors").is_file()
            assert (Path(r["checkpoint"]) / "lorp_pruning.json").is_file()


def test_unwritable_output_directory(model: Path, tmp_path: Path) -> None:
    """An output path that cannot be a directory (a file stands in its way): one line,
    exit 2, before any work. chmod would not do: CI runs as root, which ignores modes."""
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file")
    job = perplexity_job(tmp_path, model, "blocked", output_dir=str(blocker / "run"))
    out = subprocess.run([LORP, "run", str(job)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr == (
        f"output_dir: {str(blocker / 'run')!r} cannot be written: {str(blocker)!r} is a file, "
        "not a directory\n"
    )
    assert blocker.read_text() == "a file"


def test_sigterm_mid_grid_stops_cleanly_beside_a_second_job(model: Path, tmp_path: Path) -> None:
    """A scheduler's SIGTERM mid-grid: the driver ends its points in flight as KILLED, says
    in one line what was done and that a rerun resumes, exits 143; a second job on the
    same machine (its own local Ray) finishes untouched; the rerun lands every point once."""
    job = perplexity_job(
        tmp_path,
        model,
        "stopped",
        budgets=[1, 2, 3],
        methods=[{"name": m} for m in ("lorp", "shortgpt", "streamline", "angular")],
        resources={"max_concurrent_points": 2},
    )
    beside = perplexity_job(tmp_path, model, "beside", budgets=[1, 2], methods=[{"name": "lorp"}])
    run_dir, points = tmp_path / "stopped", 1 + 3 * 4
    logs = {name: (tmp_path / f"{name}.err").open("w+") for name in ("stopped", "beside")}
    proc, other = (
        subprocess.Popen([LORP, "run", str(j)], stderr=logs[n], start_new_session=True)
        for n, j in (("stopped", job), ("beside", beside))
    )
    try:
        deadline = time.time() + 600
        while time.time() < deadline and proc.poll() is None:  # stop with a point in flight
            events = read_events(run_dir / "events.jsonl")
            begun = {e["unit"] for e in events if e["event"] == "begin" and e["stage"] == "point"}
            ended = {e["unit"] for e in events if e["event"] == "finish"}
            if sum(e["event"] == "point" for e in events) >= 3 and begun - ended:
                break
            time.sleep(0.1)
        assert proc.poll() is None, "the job ended before it could be stopped"
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
        assert other.wait(timeout=900) == 0, (tmp_path / "beside.err").read_text()[-3000:]
    finally:
        kill_started_by(proc.pid)  # whatever the stop left (nothing, when it works)
        kill_started_by(other.pid)
    stderr = (tmp_path / "stopped.err").read_text()
    assert proc.returncode == 143, stderr[-3000:]
    said = [x for x in stderr.splitlines() if x.startswith("stopped by SIGTERM")]
    assert len(said) == 1 and "resumes" in said[0] and "point(s) done" in said[0], stderr
    assert "logging.cc" not in stderr and "Traceback" not in stderr, stderr[-3000:]
    before = read_catalog(run_dir / "catalog")
    assert 3 <= len(before) < points
    client = MlflowClient(f"sqlite:///{run_dir / 'mlflow.db'}")
    exp = client.get_experiment_by_name("stopped")
    runs = [
        r for r in client.search_runs([exp.experiment_id]) if r.data.tags["lorp.kind"] == "point"
    ]
    status = Counter(r.info.status for r in runs)
    assert status["KILLED"] >= 1 and status["RUNNING"] == 0, status
    assert status["FINISHED"] == len(before)

    assert len(read_catalog(tmp_path / "beside" / "catalog")) == 1 + 2

    out = subprocess.run([LORP, "run", str(job)], capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = read_catalog(run_dir / "catalog")
    assert len({r["grid_key"] for r in rows}) == len(rows) == points
    assert {r["grid_key"] for r in before} <= {r["grid_key"] for r in rows}


# -- a job on a cluster that never offers what it needs ---------------------------------


@pytest.mark.slow
def test_a_stop_while_waiting_for_a_worker_node_exits_143_with_one_line(
    ray_tmp: Path, tmp_path: Path
) -> None:
    """`lorp run` on a cluster whose head offers 0 CPUs and no worker node has joined: its
    capture waits, the driver says so itself (and `lorp status` does), and a SIGTERM
    then exits 143 with the one stop line (it died of a segmentation fault, rc 139)."""
    from tests.helpers.job_specs import tiny_job, write_job
    from tests.helpers.tiny_models import save_tiny_ptb

    port, log = free_port(), tmp_path / "head.log"
    env = {k: v for k, v in os.environ.items() if k not in {"RAY_ADDRESS", "TMPDIR"}}
    env |= {"RAY_TMPDIR": str(ray_tmp)} | RAY_TEST_ENV
    head = subprocess.Popen(
        [
            str(RAY_CLI),
            "start",
            "--head",
            f"--port={port}",
            "--num-cpus=0",
            "--block",
            "--include-dashboard=false",
            f"--temp-dir={ray_tmp / 'ray'}",
        ],
        env=env,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    model = save_tiny_ptb("llama", tmp_path / "model")
    job = write_job(tmp_path, tiny_job(tmp_path, model, "waits", budgets=[1]))
    err = (tmp_path / "waits.err").open("w+")
    env |= {"RAY_ADDRESS": f"127.0.0.1:{port}", "LORP_WAITING_NOTE_S": "5"}
    lorp = Path(sys.executable).with_name("lorp")
    driver = None
    try:
        wait_for_port(port, head, log, "ray start --head")
        driver = subprocess.Popen(
            [str(lorp), "run", str(job)],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=err,
            start_new_session=True,
        )
        said = "waiting: capture of tiny: no node offers 1 CPU (nodes: 0 CPU)"
        deadline = time.monotonic() + 240
        while said not in (tmp_path / "waits.err").read_text() and driver.poll() is None:
            assert time.monotonic() < deadline, (tmp_path / "waits.err").read_text()[-3000:]
            time.sleep(0.5)
        status = subprocess.run(
            [str(lorp), "status", str(tmp_path / "waits")],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert "waiting      capture of tiny: no node offers 1 CPU" in status.stdout, status
        driver.send_signal(signal.SIGTERM)
        driver.wait(timeout=120)
    finally:
        if driver is not None:
            kill_started_by(driver.pid)
        os.killpg(head.pid, signal.SIGTERM)
        with suppress(subprocess.TimeoutExpired):
            head.wait(timeout=60)
        kill_started_by(head.pid)
    stderr = (tmp_path / "waits.err").read_text()
    assert driver.returncode == 143, stderr[-3000:]
    stops = [x for x in stderr.splitlines() if x.startswith("stopped by SIGTERM")]
    assert len(stops) == 1 and "1 model(s) not yet prepared" in stops[0], stderr[-3000:]
    assert "Traceback" not in stderr and "Segmentation" not in stderr, stderr[-3000:]
