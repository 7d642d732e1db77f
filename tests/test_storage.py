"""The job's storage (`pipeline.storage`) on a local directory, a file:// URI and a real
S3-compatible server (moto in server mode on 127.0.0.1), and a job whose results live in
S3: what Ray tasks receive, what lands where, and a rerun that resumes from storage."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.fs as pafs
import pytest

from pipeline.records.catalog import Catalog
from pipeline.records.shared_catalog import SharedCatalog
from pipeline.spec.checks import SpecError
from pipeline.spec.parse import parse_spec
from pipeline.stages.capture import capture_workers
from pipeline.storage import MARKER, Storage
from tests.helpers.job_specs import tiny_job
from tests.helpers.local_servers import free_port, wait_for_port
from tests.helpers.ray_cluster import local_ray
from tests.helpers.tiny_models import save_tiny_ptb

BUCKET = "lorp"
EVALUATION = {"perplexity": ["ptb"], "seq_len": 48, "max_windows": 2, "speed": False}
CALIBRATION = {"dataset": "ptb", "samples": 8, "seq_len": 48, "shards": 2, "batch_size": 4}


@pytest.fixture(scope="module")
def s3(tmp_path_factory) -> Any:  # type: ignore[no-untyped-def]
    """A moto S3 server on a free loopback port, a bucket, and dummy credentials in the
    environment (Ray workers started later inherit them). Yields the URI of the bucket."""
    pytest.importorskip("moto")
    port = free_port()
    log = tmp_path_factory.mktemp("moto") / "moto.log"
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
    )
    wait_for_port(port, server, log, "moto server", timeout=60)
    env = {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true",
        "MLFLOW_S3_ENDPOINT_URL": f"http://127.0.0.1:{port}",  # MLflow's artifacts (boto3)
    }
    with pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        options = {"endpoint_override": f"127.0.0.1:{port}", "scheme": "http"}
        pafs.S3FileSystem(**options, allow_bucket_creation=True).create_dir(BUCKET)
        yield f"s3://{BUCKET}/{{prefix}}?endpoint_override=127.0.0.1:{port}&scheme=http&region=us-east-1"
    server.terminate()
    server.wait(timeout=30)


@pytest.fixture(params=["local", "file", "s3"])
def store(request, tmp_path: Path) -> Storage:  # type: ignore[no-untyped-def]
    if request.param == "local":
        return Storage(tmp_path / "store")
    if request.param == "file":
        return Storage((tmp_path / "store").as_uri())
    uri = request.getfixturevalue("s3")
    return Storage(uri.format(prefix=f"unit/{tmp_path.name}"))


def make_tree(root: Path, tag: str) -> dict[str, bytes]:
    files = {"config.json": b'{"a": 1}', "model.safetensors": tag.encode() * 1000}
    files["sub/deep.txt"] = f"deep {tag}".encode()
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    return files


def read_tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


# -- Storage, on every backend -----------------------------------------------------------


def test_put_and_get_a_directory(store: Storage, tmp_path: Path) -> None:
    files = make_tree(tmp_path / "src", "one")
    uri = store.put_dir(tmp_path / "src", "checkpoints/m/a")
    assert uri == store.uri("checkpoints/m/a") and store.complete("checkpoints/m/a")
    assert store.list("checkpoints/m") == ["a"] and store.list("nothing") == []
    assert read_tree(store.get_dir("checkpoints/m/a", tmp_path / "back")) == files
    with store.fetched("checkpoints/m/a") as local:
        assert read_tree(local) == files  # a local copy, or the directory itself
    # A rewrite replaces the directory whole: no file of the old one is left.
    (tmp_path / "src" / "sub" / "deep.txt").unlink()
    store.put_dir(tmp_path / "src", "checkpoints/m/a")
    again = read_tree(store.get_dir("checkpoints/m/a", tmp_path / "back"))
    assert again == {k: v for k, v in files.items() if k != "sub/deep.txt"}


def test_single_files_are_replaced_whole(store: Storage, tmp_path: Path) -> None:
    assert store.read_bytes("catalog.parquet") is None
    assert not store.get_file("catalog.parquet", tmp_path / "x")
    store.write_bytes("catalog.parquet", b"old")
    with pytest.raises(RuntimeError), store.writer("catalog.parquet") as fh:
        fh.write(b"half of the new")
        raise RuntimeError("the writer dies")
    assert store.read_bytes("catalog.parquet") == b"old"  # untouched by the failed write
    (tmp_path / "new").write_bytes(b"new")
    store.put_file(tmp_path / "new", "catalog.parquet")
    assert store.get_file("catalog.parquet", tmp_path / "got")
    assert (tmp_path / "got").read_bytes() == b"new"
    assert store.list() == ["catalog.parquet"]  # no temporary left behind


def shared_row(job: str, i: int) -> dict[str, Any]:
    return {
        "grid_key": f"k{i:03d}", "job": job, "model": "m", "method_label": f"x{i}",
        "budget": i, "created_at": f"2026-12-01T00:00:{i:02d}", "ppl_ptb": 10.0 + i,
    }  # fmt: skip


def test_a_shared_catalog_takes_many_jobs_at_once(store: Storage, tmp_path: Path) -> None:
    """Three jobs publish into one shared catalog at once, each compacting (snapshot
    replaced, its parts deleted) every few rows, while a reader folds it again and again:
    the reader never sees a job's row count drop (a compaction under it is read again),
    and at the end every row is there exactly once. A rerun replaces its own rows only."""
    shared = SharedCatalog(store)
    jobs = ["team-a", "team-b", "team-c"]
    counts: dict[str, list[int]] = {j: [] for j in jobs}
    stop = threading.Event()

    def write(job: str) -> None:
        cat = Catalog(tmp_path / job / Catalog.NAME, publish=shared, job=job)
        for i in range(20):
            cat.put(shared_row(job, i))
            cat.update(f"k{i:03d}", {"speedup": 1.0 + i})
            if i % 2:
                cat.compact()

    failures: list[BaseException] = []

    def read() -> None:
        try:
            while not stop.is_set():
                rows = shared.read()
                for j in jobs:
                    counts[j].append(sum(r["job"] == j for r in rows))
        except BaseException as exc:  # the test fails on it, not a dead thread
            failures.append(exc)

    reader = threading.Thread(target=read)
    reader.start()
    writers = [threading.Thread(target=write, args=(j,)) for j in jobs]
    for t in writers:
        t.start()
    for t in writers:
        t.join()
    stop.set()
    reader.join()
    assert failures == []
    rows = shared.read()
    assert sorted((r["job"], r["grid_key"]) for r in rows) == sorted(
        (j, f"k{i:03d}") for j in jobs for i in range(20)
    )
    assert all(r["speedup"] == 1.0 + r["budget"] for r in rows)
    for j in jobs:
        assert counts[j] == sorted(counts[j]), j  # never a row lost to a compaction
    assert len(counts["team-a"]) > 3
    shared.replace_rows("team-b", [shared_row("team-b", 0)])  # a rerun with one point
    after = shared.read()
    assert sum(r["job"] == "team-b" for r in after) == 1
    assert sum(r["job"] != "team-b" for r in after) == 40


def test_locations_for_records_and_workers(s3: str, tmp_path: Path) -> None:
    local = Storage(tmp_path / "a" / ".." / "b")
    assert local.uri("x/y") == str((tmp_path / "b" / "x" / "y").resolve())
    assert local.location == str((tmp_path / "b").resolve())
    assert Storage((tmp_path / "b").as_uri()).uri("x") == local.uri("x")
    remote = Storage(s3.format(prefix="p").replace("s3://", "s3://testing:testing@"))
    uri = remote.uri("checkpoints/m")
    assert uri.startswith(f"s3://{BUCKET}/p/checkpoints/m?endpoint_override=")
    assert "testing" not in uri  # records carry no credentials
    assert "testing:testing@" in remote.location  # workers get every parameter
    assert remote.mlflow_uri("mlartifacts") == f"s3://{BUCKET}/p/mlartifacts"
    assert remote.sub("stats").uri("k.npz") == remote.uri("stats/k.npz")
    assert Storage(uri).uri() == uri


def test_a_bad_storage_fails_at_the_spec(tmp_path: Path) -> None:
    spec = tiny_job(tmp_path, tmp_path / "model")
    with pytest.raises(SpecError, match=r"^storage: 'xx://a' cannot be opened: .*xx://a"):
        parse_spec(spec | {"storage": "xx://a"})
    assert parse_spec(spec | {"storage": str(tmp_path / "shared")}).storage
    with pytest.raises(SpecError, match=r"^catalog: 'yy://b' cannot be opened: .*yy://b"):
        parse_spec(spec | {"catalog": "yy://b"})
    with pytest.raises(SpecError, match=r"^tracking.reference: expected true or false, got str"):
        parse_spec(spec | {"tracking": {"reference": "yes"}})


# -- the marker, on S3 -------------------------------------------------------------------


class Recording(Storage):
    """Records every object written, in order; `fail_at` makes the n-th write fail, as a
    node dying mid-upload would."""

    def __init__(self, location: str, fail_at: int | None = None) -> None:
        super().__init__(location)
        self.written: list[str] = []
        self.fail_at = fail_at

    def _write(self, path: str, data: Any) -> None:
        if self.fail_at is not None and len(self.written) == self.fail_at:
            raise OSError("the node died mid-upload")
        super()._write(path, data)
        self.written.append(path.rsplit("/", 1)[1])


def test_the_marker_is_written_last_and_guards_readers(s3: str, tmp_path: Path) -> None:
    files = make_tree(tmp_path / "src", "x")
    uri = s3.format(prefix=f"marker/{tmp_path.name}")
    rec = Recording(uri)
    rec.put_dir(tmp_path / "src", "ckpt")
    assert rec.written[-1] == MARKER and sorted(rec.written[:-1]) == sorted(
        n.rsplit("/", 1)[-1] for n in files
    )
    # A rewrite that dies midway: the old marker went first, so readers see nothing.
    dying = Recording(uri, fail_at=1)
    with pytest.raises(OSError, match="mid-upload"):
        dying.put_dir(tmp_path / "src", "ckpt")
    store = Storage(uri)
    assert dying.written and not store.complete("ckpt")
    assert store.list() == []  # ignored by listings
    with pytest.raises(FileNotFoundError, match=MARKER):
        store.get_dir("ckpt", tmp_path / "never")
    assert not (tmp_path / "never").exists()
    # Files written without any marker (a writer still at work) are not a directory yet.
    with store.writer("other/model.safetensors") as fh:
        fh.write(b"partial")
    assert not store.complete("other") and store.list() == []
    store.put_dir(tmp_path / "src", "ckpt")
    assert store.list() == ["ckpt"]


# -- capture workers ---------------------------------------------------------------------


def test_capture_workers_come_from_the_spec() -> None:
    assert capture_workers(3, None) == 3  # one per shard, whatever the cluster holds now
    assert capture_workers(3, 8) == 3 and capture_workers(3, 2) == 2


# -- jobs on a real local Ray ------------------------------------------------------------


@pytest.fixture(scope="module")
def ray_s3(s3: str):  # type: ignore[no-untyped-def]
    """A local Ray started after the S3 environment is set, so its workers have it."""

    with local_ray():
        yield s3


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return save_tiny_ptb("llama", tmp_path_factory.mktemp("model") / "llama")


def strings(value: Any) -> list[str]:
    """Every string inside a task (dataclasses, tuples, dicts); a Path anywhere fails."""
    assert not isinstance(value, os.PathLike), f"a path crosses Ray: {value!r}"
    if dataclasses.is_dataclass(value):
        return [s for f in dataclasses.fields(value) for s in strings(getattr(value, f.name))]
    if isinstance(value, dict):
        return [s for kv in value.items() for item in kv for s in strings(item)]
    if isinstance(value, list | tuple):
        return [s for item in value for s in strings(item)]
    return [value] if isinstance(value, str) else []


def under(text: str, root: Path) -> bool:
    return os.path.isabs(text) and Path(text).resolve().is_relative_to(root.resolve())


@pytest.mark.integration
def test_remote_calls_get_no_driver_paths(ray_s3, model: Path, tmp_path: Path) -> None:
    """Every argument of every capture, loss, point and speed call of a job: the model
    as its reference, windows as arrays, checkpoints as storage locations; nothing under
    the driver's run directory or caches. A point task really runs from it."""
    import ray
    from transformers import AutoTokenizer

    from lorp.cache import cache_root
    from pipeline.cluster.model_source import model_source
    from pipeline.plan import plan_models
    from pipeline.prepare import Preparer
    from pipeline.recorder import Recorder
    from pipeline.records.progress import Progress
    from pipeline.stages.calibration import heldout_windows
    from pipeline.stages.loss_evaluators import loss_task
    from pipeline.stages.points import run_point
    from pipeline.stages.statistics import calibration_shards, capture_task, load_shards
    from pipeline.stages.tasks import point_task, speed_task

    methods = [{"name": "shortgpt"}]  # the loss task is built below, not run: no sleb
    spec = tiny_job(tmp_path, model, "paths", budgets=[1], methods=methods, evaluation=EVALUATION)
    spec = parse_spec(spec | {"storage": str(tmp_path / "shared"), "calibration": CALIBRATION})
    (plan,) = plan_models(spec)
    recorder = Recorder(spec, False, Progress(bar=False))
    preparer = Preparer(spec, False, recorder.open(), recorder, recorder.progress.note)
    points = preparer.prepare(plan, "transformers", lambda kind, what: None).points  # on Ray
    shards = load_shards(calibration_shards(spec.calibration, plan, spec.run_dir))
    tok = AutoTokenizer.from_pretrained(plan.path)
    where = recorder.storage.location

    def task(point: Any) -> Any:
        return point_task(spec, where, point, "transformers", {})

    calls = [
        capture_task(
            spec.resources.capture,
            spec.calibration,
            plan,
            calibration_shards(spec.calibration, plan, spec.run_dir),
        ),
        *shards,
        loss_task(
            spec.evaluation, spec.resources.grid, plan, heldout_windows(tok, spec.calibration)[0]
        ),
        *[task(p) for p in points],
        speed_task(
            spec.evaluation, spec.resources, where, points, save_checkpoints=spec.save_checkpoints
        ),
    ]
    assert all(isinstance(s.windows, np.ndarray) for s in shards)
    forbidden = [spec.run_dir, cache_root(), Path.home() / ".cache"]
    for call in calls:
        for text in strings(call):
            bad = [str(r) for r in forbidden if under(text, r)]
            assert not bad, f"{type(call).__name__} carries {text!r}, under {bad}"
    source = model_source(plan)
    assert source.ref == str(model) and source.kind == "dir" and source.revision is None
    assert {c.model for c in calls if hasattr(c, "model")} == {source}

    pruned = next(p for p in points if p.method_name == "shortgpt")
    result = ray.get(run_point.remote(task(pruned)))
    saved = tmp_path / "shared" / "checkpoints" / "tiny" / "shortgpt-b1"
    assert (saved / "model.safetensors").is_file() and np.isfinite(result.metrics["ppl_ptb"])
    assert not (spec.run_dir / "checkpoints").exists()

    elsewhere = dataclasses.replace(source, ref=str(tmp_path / "gone"))
    gone = dataclasses.replace(task(pruned), model=elsewhere)
    with pytest.raises(Exception, match=r"model '.*gone' is not on node \S+"):
        ray.get(run_point.remote(gone))
