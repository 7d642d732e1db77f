"""Joining a Ray cluster: bounded, one line when nothing answers, and "no address" always
means a fresh local Ray. A real Ray starts in a subprocess, so no Ray state leaks into
other tests; the failures are checked in this process, since they fail before
`ray.init`. Ray's temp dir (RAY_TMPDIR) is a private one, so the machine's own
/tmp/ray/ray_current_cluster is never read or written. A hang of a real start fails
through the subprocess timeout instead of stalling the suite.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import suppress
from pathlib import Path

import pytest

from tests.helpers.local_servers import free_port, wait_for_port
from tests.helpers.paths import REPO
from tests.helpers.processes import kill_started_by

pytestmark = [pytest.mark.integration]

ROOT = REPO
# Ray 2.60 turns token auth on when ~/.ray/auth_token exists (and writes one for a new
# local Ray): off here, so the tests neither depend on nor touch the home directory.
AUTH_OFF = {"RAY_AUTH_MODE": "disabled"}
RAY = Path(sys.executable).with_name("ray")
# Prints "nodes <n> <gcs address>" once joined or started, "ValueError: ..." otherwise.
DRIVER = """
import sys
import ray
from pipeline.cluster.connect import init_ray
from pipeline.spec.parse import parse_spec

data = {"name": "connect", "models": [{"ref": "unused"}], "budgets": [1],
        "methods": [{"name": "lorp"}], "ray": {"num_cpus": 1}}
if sys.argv[1]:
    data["ray"]["address"] = sys.argv[1]
try:
    init_ray(parse_spec(data).ray)
except ValueError as exc:
    print(f"ValueError: {exc}")
    sys.exit(3)
print("nodes", len(ray.nodes()), ray.get_runtime_context().gcs_address)
ray.shutdown()
"""


@pytest.fixture
def ray_tmp() -> Iterator[Path]:
    """A private Ray temp root, short: Ray's unix socket paths must fit in 107 bytes."""
    root = Path(tempfile.mkdtemp(prefix="lorpc", dir="/tmp"))
    yield root
    shutil.rmtree(root, ignore_errors=True)


def drive(
    ray_tmp: Path, address: str = "", timeout: float = 180, **env: str
) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if k not in {"RAY_ADDRESS", "TMPDIR"}}
    base |= {"RAY_TMPDIR": str(ray_tmp), "LORP_RAY_CONNECT_TIMEOUT_S": "3"} | AUTH_OFF | env
    return subprocess.run(
        [sys.executable, "-c", DRIVER, address],
        cwd=ROOT,
        env=base,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def stale_cluster_file(ray_tmp: Path) -> str:
    """A ray_current_cluster left by a head that has died: its port answers nothing."""
    stale = f"127.0.0.1:{free_port()}"
    (ray_tmp / "ray").mkdir(parents=True, exist_ok=True)
    (ray_tmp / "ray" / "ray_current_cluster").write_text(stale)
    return stale


def failure_line(
    monkeypatch: pytest.MonkeyPatch, ray_tmp: Path, address: str = "", **env: str
) -> str:
    """`init_ray`'s error, in this process: every failure comes from the reachability
    check before `ray.init` runs, so no Ray state is created; the probe's 3 s bound (not
    Ray's retries) is what keeps a failure from hanging."""
    from pipeline.cluster.connect import init_ray
    from pipeline.spec.parse import parse_spec

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.delenv("TMPDIR", raising=False)
    for key, value in (
        {"RAY_TMPDIR": str(ray_tmp), "LORP_RAY_CONNECT_TIMEOUT_S": "3"} | env
    ).items():
        monkeypatch.setenv(key, value)
    data = {"name": "connect", "models": [{"ref": "unused"}], "budgets": [1],
            "methods": [{"name": "lorp"}], "ray": {"num_cpus": 1}}  # fmt: skip
    if address:
        data["ray"]["address"] = address
    with pytest.raises(ValueError) as err:
        init_ray(parse_spec(data).ray)
    line = f"ValueError: {err.value}"
    assert "\n" not in line
    return line


def test_no_address_starts_a_local_ray_despite_a_stale_cluster_file(ray_tmp: Path) -> None:
    stale = stale_cluster_file(ray_tmp)
    out = drive(ray_tmp)
    assert out.returncode == 0, out.stdout + out.stderr
    nodes, gcs = out.stdout.split("nodes ", 1)[1].split()
    assert nodes == "1"
    assert gcs != stale


def test_auto_with_only_a_stale_cluster_file_fails_in_one_line(
    monkeypatch: pytest.MonkeyPatch, ray_tmp: Path
) -> None:
    stale = stale_cluster_file(ray_tmp)
    line = failure_line(monkeypatch, ray_tmp, "auto")
    assert line.startswith(f"ValueError: ray.address 'auto' (recorded at {stale}): ")
    assert "no Ray cluster answers there within 3 s" in line


def test_auto_with_no_cluster_recorded_fails_in_one_line(
    monkeypatch: pytest.MonkeyPatch, ray_tmp: Path
) -> None:
    line = failure_line(monkeypatch, ray_tmp, "auto")
    assert line.startswith("ValueError: ray.address 'auto': no Ray cluster recorded in ")
    assert str(ray_tmp / "ray" / "ray_current_cluster") in line


@pytest.mark.parametrize("via", ["spec", "env"])
def test_a_dead_port_fails_within_the_bound_naming_the_address(
    monkeypatch: pytest.MonkeyPatch, ray_tmp: Path, via: str
) -> None:
    address = f"127.0.0.1:{free_port()}"
    if via == "spec":
        line, field = failure_line(monkeypatch, ray_tmp, address), "ray.address"
    else:
        line, field = failure_line(monkeypatch, ray_tmp, RAY_ADDRESS=address), "RAY_ADDRESS"
    assert line.startswith(f"ValueError: {field} '{address}': no Ray cluster answers there")
    assert "within 3 s (Connection refused)" in line


def test_a_dead_ray_client_address_fails_naming_it(
    monkeypatch: pytest.MonkeyPatch, ray_tmp: Path
) -> None:
    address = f"ray://127.0.0.1:{free_port()}"
    line = failure_line(monkeypatch, ray_tmp, address)
    assert line.startswith(f"ValueError: ray.address '{address}': no Ray cluster answers")


def test_a_dashboard_address_is_refused_before_any_connection(
    monkeypatch: pytest.MonkeyPatch, ray_tmp: Path
) -> None:
    line = failure_line(monkeypatch, ray_tmp, "http://127.0.0.1:8265")
    assert "ray.address 'http://127.0.0.1:8265': ray.init takes host:port" in line


@pytest.mark.slow
def test_auto_joins_the_head_that_ray_start_recorded(ray_tmp: Path) -> None:
    """A real `ray start --head`: "auto" joins it, as one node, at the recorded port."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in {"RAY_ADDRESS", "TMPDIR"}}
    env |= {"RAY_TMPDIR": str(ray_tmp), "RAY_USAGE_STATS_ENABLED": "0"} | AUTH_OFF
    head = subprocess.Popen(
        [str(RAY), "start", "--head", f"--port={port}", "--num-cpus=1", "--block",
         "--include-dashboard=false", f"--temp-dir={ray_tmp / 'ray'}"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    recorded = ray_tmp / "ray" / "ray_current_cluster"
    try:
        # `ray start` records the head once it is up; "auto" means that record.
        while not recorded.is_file() and head.poll() is None:
            time.sleep(0.5)
        assert head.poll() is None, head.stdout.read() if head.stdout else ""
        joined = drive(ray_tmp, "auto")
        assert joined.returncode == 0, joined.stdout + joined.stderr
        nodes, gcs = joined.stdout.split("nodes ", 1)[1].split()
        assert nodes == "1"
        assert gcs.endswith(f":{port}")
        assert recorded.read_text().strip() == gcs  # host:port: the two-node test joins so
    finally:
        # Only the head this test started: its own session, stopped by its process group.
        os.killpg(head.pid, signal.SIGTERM)
        with suppress(subprocess.TimeoutExpired):
            head.wait(timeout=60)
        kill_started_by(head.pid)  # whatever outlived it: its GCS, raylet and workers
        head.wait(timeout=30)


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
    env |= {"RAY_TMPDIR": str(ray_tmp), "RAY_USAGE_STATS_ENABLED": "0"} | AUTH_OFF
    head = subprocess.Popen(
        [str(RAY), "start", "--head", f"--port={port}", "--num-cpus=0", "--block",
         "--include-dashboard=false", f"--temp-dir={ray_tmp / 'ray'}"],
        env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    model = save_tiny_ptb("llama", tmp_path / "model")
    job = write_job(tmp_path, tiny_job(tmp_path, model, "waits", budgets=[1]))
    err = (tmp_path / "waits.err").open("w+")
    env |= {"RAY_ADDRESS": f"127.0.0.1:{port}", "LORP_WAITING_NOTE_S": "5"}
    lorp = Path(sys.executable).with_name("lorp")
    driver = None
    try:
        wait_for_port(port, head, log, "ray start --head")
        driver = subprocess.Popen(
            [str(lorp), "run", str(job)], env=env, stdout=subprocess.DEVNULL, stderr=err,
            start_new_session=True,
        )  # fmt: skip
        said = "waiting: capture of tiny: no node offers 1 CPU (nodes: 0 CPU)"
        deadline = time.monotonic() + 240
        while said not in (tmp_path / "waits.err").read_text() and driver.poll() is None:
            assert time.monotonic() < deadline, (tmp_path / "waits.err").read_text()[-3000:]
            time.sleep(0.5)
        status = subprocess.run(
            [str(lorp), "status", str(tmp_path / "waits")], capture_output=True, text=True,
            timeout=120,
        )  # fmt: skip
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
