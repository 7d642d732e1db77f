"""The cluster path on one machine: a two-node Ray cluster whose nodes share no disk.

The head (started by the test, `--num-cpus=0`) runs nothing that needs a CPU, so every
capture worker, loss worker and grid point goes to the second node. That node runs in its
own mount namespace (`unshare --mount`) with empty tmpfs mounts over the driver's pytest
tmp dir (its run directories live there), the head's Ray session dir and ~/.cache (HF and
lorp caches), so nothing of the driver's reaches it but Ray's TCP connections, the code
(the repository and its venv) and the job's storage: a directory under /var/tmp that both
namespaces see (a shared filesystem), or a moto S3 server on 127.0.0.1. The tiny model
lives in that shared directory, as a local model path must exist on every node that
loads it. Each job's catalog must equal a single-node run's (an embedded local Ray,
`lorp run` in a subprocess, local storage).

Where `unshare` is refused (not root, or no mount namespaces in this container) the
module skips, naming the reason. Everything started here is stopped by its own process
group (never `ray stop`, which stops every Ray on the machine).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs
import pytest
import yaml

from tests.helpers import RAY_TEST_ENV
from tests.helpers.job_specs import tiny_job
from tests.helpers.local_servers import (
    AWS_TEST_ENV,
    create_bucket,
    free_port,
    s3_location,
    start_moto,
    wait_for_port,
)
from tests.helpers.paths import REPO
from tests.helpers.processes import kill_started_by
from tests.helpers.tiny_models import save_tiny_ptb

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = REPO
RAY = Path(sys.executable).with_name("ray")
LORP = Path(sys.executable).with_name("lorp")
BUCKET = "lorp"
EVALUATION = {"perplexity": ["ptb"], "seq_len": 48, "max_windows": 2, "speed": False}
CALIBRATION = {"dataset": "ptb", "samples": 8, "seq_len": 48, "shards": 2, "batch_size": 4}
METHODS = [{"name": "lorp"}, {"name": "shortgpt"}]
BUDGETS = [1, 2]
POINTS = 1 + len(METHODS) * len(BUDGETS)  # the dense model, then every variant
# Cache locations that could point outside ~/.cache: unset, so every cache is under the
# home cache that the second node's tmpfs hides.
CACHE_VARS = ("LORP_CACHE", "HF_HOME", "HF_HUB_CACHE", "HF_DATASETS_CACHE", "XDG_CACHE_HOME")


def unshare_refused() -> str | None:
    """Why this machine cannot give a process its own mount namespace (None: it can)."""
    if shutil.which("unshare") is None:
        return "no unshare binary"
    if os.geteuid() != 0:
        return "mount namespaces need root (unshare --mount)"
    probe = subprocess.run(
        [
            "unshare",
            "--mount",
            "--propagation",
            "private",
            "bash",
            "-c",
            "mount -t tmpfs tmpfs /mnt && umount /mnt",
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    if probe.returncode:
        return f"unshare --mount refused here: {(probe.stderr or probe.stdout).strip()[:200]}"
    return None


def stop_group(proc: subprocess.Popen[Any]) -> None:
    """Stop a process started in its own session, and everything it started (also what
    outlived it: a node whose raylet was killed leaves its workers behind)."""
    if proc.poll() is None:
        with suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        with suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=20)
    kill_started_by(proc.pid)  # by process id: its group, its session, its descendants
    proc.wait(timeout=30)


@dataclass
class Cluster:
    address: str
    shared: Path  # seen by both nodes: the model and the filesystem storage
    s3: str  # the moto bucket's URI template, `{prefix}` to fill
    hidden: list[Path]  # driver paths the second node must not see
    env: dict[str, str]  # the environment of every process started here
    base: Path
    procs: list[subprocess.Popen[Any]]  # stopped at teardown, last first
    worker: subprocess.Popen[Any] | None = None
    worker_node: str = ""  # the second node's Ray node id

    @property
    def node_temp(self) -> Path:
        """The second node's own Ray temp dir: a sibling of the head's (short socket
        paths), a private tmpfs in its namespace, removed at teardown."""
        return self.base.with_name(self.base.name + "w")

    def start_worker(self) -> None:
        """Start the second node (a fresh namespace, empty tmpfs mounts); return once it
        has joined."""
        import ray

        log = self.base / f"worker-{len(self.procs)}.log"
        port = int(self.address.rsplit(":", 1)[1])
        self.worker = subprocess.Popen(
            [
                "unshare",
                "--mount",
                "--propagation",
                "private",
                "bash",
                "-c",
                _worker_node_script(port, self.hidden, self.node_temp),
            ],
            env=self.env,
            stdout=log.open("w"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.procs.append(self.worker)
        deadline = time.time() + 120
        while True:
            alive = [n for n in ray.nodes() if n["Alive"] and n["NodeID"] != self.worker_node]
            workers = [n for n in alive if n["Resources"].get("worker_node")]
            if workers:
                break
            if time.time() > deadline or self.worker.poll() is not None:
                pytest.fail(f"the second node did not join: {log.read_text()[-3000:]}")
            time.sleep(0.5)
        assert workers[0]["Resources"]["CPU"] == 2
        self.worker_node = workers[0]["NodeID"]

    def kill_raylet(self) -> int:
        """SIGKILL the second node's raylet, found among its own process group."""
        assert self.worker is not None
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                pid = int(entry.name)
                if (
                    os.getpgid(pid) == self.worker.pid
                    and (entry / "comm").read_text().strip() == "raylet"
                ):
                    os.kill(pid, signal.SIGKILL)
                    return pid
            except (OSError, ProcessLookupError):
                continue
        raise AssertionError("no raylet in the second node's process group")


def _worker_node_script(port: int, hidden: list[Path], temp_dir: Path) -> str:
    """The second node's shell: empty tmpfs over every driver path it must not see (the
    driver's pytest tmp files and run directories, the head's Ray session, the caches)
    and over its own Ray temp dir, then `ray start`. Only those paths: the repository and
    its venv may live anywhere, /tmp included (a CI checkout does)."""
    home_cache = Path.home() / ".cache"
    mounts = [*hidden, home_cache]
    return (
        "set -e; "
        # Private mounts: nothing here propagates back to the driver's namespace.
        + "".join(f"mkdir -p {p}; mount -t tmpfs tmpfs {p}; " for p in mounts)
        + f"mkdir -p {temp_dir}; mount -t tmpfs tmpfs {temp_dir}; "
        f"exec {RAY} start --address=127.0.0.1:{port} --node-ip-address=127.0.0.1 "
        "--num-cpus=2 --resources='{\"worker_node\": 4}' --block "
        f"--temp-dir={temp_dir} --disable-usage-stats"
    )


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    reason = unshare_refused()
    assert reason is None, f"the two-node test needs its own mount namespaces: {reason}"
    import ray

    from lorp.cache import cache_root

    # Ray's socket paths must fit in 107 bytes: a short temp dir for the head.
    base = Path(tempfile.mkdtemp(prefix="lorp2n", dir="/tmp"))
    # Not under any of the second node's tmpfs mounts: the "shared filesystem".
    shared = Path(tempfile.mkdtemp(prefix="lorp2n-shared", dir="/var/tmp"))
    procs: list[subprocess.Popen[Any]] = []
    drop = {"RAY_ADDRESS", "TMPDIR", *CACHE_VARS}
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env |= RAY_TEST_ENV | {"RAY_TMPDIR": str(base)}
    mp = pytest.MonkeyPatch()
    try:
        moto_port = free_port()
        procs.append(start_moto(moto_port, base / "moto.log"))
        aws = AWS_TEST_ENV | {"MLFLOW_S3_ENDPOINT_URL": f"http://127.0.0.1:{moto_port}"}
        env |= aws
        for key, value in aws.items():
            mp.setenv(key, value)
        for key in ("RAY_ADDRESS", *CACHE_VARS):
            mp.delenv(key, raising=False)
        create_bucket(moto_port, BUCKET)
        s3 = s3_location(moto_port, BUCKET, "{prefix}")

        port = free_port()
        head_log = base / "head.log"
        head = subprocess.Popen(
            [
                str(RAY),
                "start",
                "--head",
                "--num-cpus=0",
                "--node-ip-address=127.0.0.1",
                f"--port={port}",
                "--block",
                "--include-dashboard=false",
                f"--temp-dir={base / 'h'}",
                "--disable-usage-stats",
            ],
            env=env,
            stdout=head_log.open("w"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        procs.append(head)
        wait_for_port(port, head, head_log, "Ray head")

        ray.init(address=f"127.0.0.1:{port}", logging_level="WARNING", log_to_driver=False)
        head_id = ray.get_runtime_context().get_node_id()
        (head_node,) = [n for n in ray.nodes() if n["NodeID"] == head_id]
        assert head_node["Resources"].get("CPU", 0) == 0  # nothing needing a CPU runs there
        # The driver's tmp files and run directories, the head's Ray session, the caches.
        # Each holds something for the driver, whatever ran before in this test process (a
        # first test here would otherwise see an empty basetemp): an empty directory
        # hidden or not looks the same from the second node.
        (tmp_path_factory.mktemp("driver-only") / "here").write_text("the driver's file\n")
        caches = [cache_root(), Path.home() / ".cache" / "huggingface"]
        caches = [p for p in caches if p.is_dir() and any(p.iterdir())]
        hidden = [tmp_path_factory.getbasetemp(), base, *caches]
        node = Cluster(f"127.0.0.1:{port}", shared, s3, hidden, env, base, procs)
        node.start_worker()
        yield node
    finally:
        ray.shutdown()
        mp.undo()
        for proc in reversed(procs):  # the second node, the head, moto
            stop_group(proc)
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(base.with_name(base.name + "w"), ignore_errors=True)
        shutil.rmtree(shared, ignore_errors=True)


@pytest.fixture(scope="module")
def model(cluster: Cluster) -> Path:
    return save_tiny_ptb("llama", cluster.shared / "model" / "llama")


@pytest.fixture(scope="module")
def reference(model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[tuple, dict]:
    """The same job on one node: `lorp run` on an embedded local Ray, local storage."""
    from pipeline.catalog.table import read_catalog

    root = tmp_path_factory.mktemp("single")
    spec = job(root, model, "single")
    path = root / "single.yaml"
    path.write_text(yaml.safe_dump(spec))
    ray_tmp = Path(tempfile.mkdtemp(prefix="lorp1n", dir="/tmp"))
    env = {k: v for k, v in os.environ.items() if k not in {"RAY_ADDRESS", "TMPDIR"}}
    env |= RAY_TEST_ENV | {"RAY_TMPDIR": str(ray_tmp)}
    try:
        out = subprocess.run(
            [str(LORP), "run", "-q", str(path)],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = read_catalog(Path(spec["output_dir"]) / "catalog")
    assert len(rows) == POINTS
    return {(r["method_label"], r["budget"]): r for r in rows}


def job(root: Path, model: Path, name: str, **overrides: Any) -> dict[str, Any]:
    spec = tiny_job(root, model, name, budgets=BUDGETS, methods=METHODS)
    spec |= {"evaluation": EVALUATION, "calibration": CALIBRATION, "ray": {"num_cpus": 2}}
    return spec | overrides


def test_the_second_node_sees_none_of_the_drivers_paths(cluster: Cluster, model: Path) -> None:
    import ray

    def holds(path: str) -> bool:
        """Something is there: a file, or a directory with entries (a hidden path is an
        empty tmpfs mount point on the second node)."""
        return os.path.isfile(path) or (os.path.isdir(path) and any(os.scandir(path)))

    def look(paths: list[str]) -> tuple[str, dict[str, bool]]:
        node = ray.get_runtime_context().get_node_id()
        return node, {p: holds(p) for p in paths}

    paths = [str(p) for p in cluster.hidden] + [str(model), str(cluster.shared)]
    assert all(holds(p) for p in paths)  # all there, with content, for the driver
    # A CPU task can only run on the second node: the head has none.
    node, seen = ray.get(ray.remote(num_cpus=1)(look).remote(paths))
    assert node == cluster.worker_node
    assert seen == {p: p in (str(model), str(cluster.shared)) for p in paths}


def test_a_job_on_the_second_node_matches_one_node_and_resumes_from_s3(
    cluster: Cluster, model: Path, reference: dict[tuple, dict], tmp_path: Path
) -> None:
    """`lorp run` joins the cluster; everything runs on the second node against S3
    storage; the catalog equals the one-node run's, the checkpoints are in the bucket; a
    rerun from a driver whose run directory is gone resumes from the storage alone.

    The driver is a `lorp run` process, as under Ray Jobs: a pytest process that has
    already started and stopped other local Rays saw its first actor on this cluster
    destroyed as out of scope before it started (Ray 2.60), which is a property of that
    long-lived test process, not of the product."""
    from pipeline.catalog.shared import open_catalog
    from pipeline.storage.store import Storage

    location = cluster.s3.format(prefix=f"jobs/{tmp_path.name}")
    spec = job(tmp_path, model, "twonodes", storage=location, ray={"address": cluster.address})
    spec.pop("cache_dir")  # S is cached in the storage, for every node
    path = tmp_path / "twonodes.yaml"
    path.write_text(yaml.safe_dump(spec))
    run = [str(LORP), "run", "-q", str(path)]
    out = subprocess.run(
        run, cwd=ROOT, env=cluster.env, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert f"{POINTS} done, 0 already done, 0 failed; S captured 1" in out.stdout, out.stdout

    store = Storage(location)
    rows = {(r["method_label"], r["budget"]): r for r in open_catalog(store.location)}
    assert set(rows) == set(reference)
    for slot, row in rows.items():
        assert row["pruned_layers"] == reference[slot]["pruned_layers"], slot
        assert row["ppl_ptb"] == pytest.approx(reference[slot]["ppl_ptb"], rel=1e-6), slot
        if slot[1]:  # a variant: its checkpoint was written by the second node, into storage
            where = store.uri(f"checkpoints/tiny/{slot[0]}-b{slot[1]}")
            assert row["checkpoint"] == where and Storage(where).complete()
    assert not (tmp_path / "twonodes" / "checkpoints").exists()  # nothing on the driver
    events = store.read_bytes("events.jsonl").decode()
    assert events.count('"event": "point"') == POINTS and '"event": "end"' in events
    stats = f"s3://{BUCKET}/jobs/{tmp_path.name}/stats/"
    assert all(r["stats_file"].startswith(stats) for r in rows.values())
    found = store.fs.get_file_info(pafs.FileSelector(f"{store.root}/mlartifacts", recursive=True))
    assert {"S.npy", "S.png"} <= {f.base_name for f in found}  # MLflow's artifacts in S3

    # A fresh driver directory resumes from the storage: every point skipped, S from it.
    tracking = f"sqlite:///{tmp_path / 'twonodes' / 'mlflow.db'}"  # a shared tracking store
    again = spec | {"output_dir": str(tmp_path / "driver2"), "tracking": {"mlflow_uri": tracking}}
    path.write_text(yaml.safe_dump(again))
    out = subprocess.run(
        run, cwd=ROOT, env=cluster.env, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert f"0 done, {POINTS} already done, 0 failed; S captured 0, from cache 1" in out.stdout

    from pipeline.tracking.registry_loading import pull

    pulled, version = pull("models:/lorp-tiny@best-2", tmp_path / "pulled", tracking_uri=tracking)
    assert version.source.startswith("s3://") and (pulled / "model.safetensors").is_file()
    assert not (pulled / "_LORP_COMPLETE").exists()


def test_losing_the_second_node_mid_grid_then_rerunning_finishes_every_point_once(
    cluster: Cluster, model: Path, reference: dict[tuple, dict], tmp_path: Path
) -> None:
    """The second node's raylet dies after the first points; a new node joins (empty disks
    again); a rerun of the job completes it, and the catalog holds every point once."""
    from pipeline.catalog.shared import open_catalog
    from pipeline.storage.store import Storage

    location = str(cluster.shared / "jobs" / tmp_path.name)
    spec = job(tmp_path, model, "lost", storage=location, ray={"address": cluster.address})
    spec.pop("cache_dir")
    path = tmp_path / "lost.yaml"
    path.write_text(yaml.safe_dump(spec))
    store = Storage(location)
    run = [str(LORP), "run", "-q", str(path)]
    log = tmp_path / "first.log"
    first = subprocess.Popen(
        run,
        cwd=ROOT,
        env=cluster.env,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        deadline = time.time() + 300
        while (store.read_bytes("events.jsonl") or b"").count(b'"event": "point"') < 2:
            assert first.poll() is None, log.read_text()[-3000:]
            assert time.time() < deadline, "no point finished in time"
            time.sleep(0.5)
        cluster.kill_raylet()
        cluster.worker.wait(timeout=120)  # `ray start --block` ends with its raylet
        cluster.start_worker()
        try:
            first.wait(timeout=240)  # it finishes on the new node, or fails some points
        except subprocess.TimeoutExpired:
            stop_group(first)
    finally:
        stop_group(first)
    again = subprocess.run(
        run, cwd=ROOT, env=cluster.env, capture_output=True, text=True, timeout=300
    )
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    counts = re.search(r"(\d+) done, (\d+) already done, (\d+) failed", again.stdout)
    assert counts, again.stdout[-3000:]
    done, skipped, failed = map(int, counts.groups())
    assert done + skipped == POINTS and not failed
    rows = open_catalog(store.location)  # the job's table, read in its storage
    slots = [(r["method_label"], r["budget"]) for r in rows]
    assert len(slots) == len(set(slots)) == POINTS, slots
    for row in rows:  # what a one-node run of the same job selects and scores
        slot = (row["method_label"], row["budget"])
        assert row["pruned_layers"] == reference[slot]["pruned_layers"], slot
        assert row["ppl_ptb"] == pytest.approx(reference[slot]["ppl_ptb"], rel=1e-6), slot
        assert not row["budget"] or Storage(row["checkpoint"]).complete()
