"""Joining or starting Ray (`pipeline.cluster.connect.init_ray`): bounded, one line when
nothing answers, and "no address" always a fresh local Ray."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from contextlib import suppress
from pathlib import Path

import pytest

from tests.helpers import RAY_TEST_ENV
from tests.helpers.local_servers import free_port
from tests.helpers.paths import REPO
from tests.helpers.processes import kill_started_by
from tests.helpers.ray_cluster import RAY_CLI

pytestmark = [pytest.mark.integration]

ROOT = REPO


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


def drive(
    ray_tmp: Path, address: str = "", timeout: float = 180, **env: str
) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if k not in {"RAY_ADDRESS", "TMPDIR"}}
    base |= {"RAY_TMPDIR": str(ray_tmp), "LORP_RAY_CONNECT_TIMEOUT_S": "3"} | RAY_TEST_ENV | env
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
    data = {
        "name": "connect",
        "models": [{"ref": "unused"}],
        "budgets": [1],
        "methods": [{"name": "lorp"}],
        "ray": {"num_cpus": 1},
    }
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
    env |= {"RAY_TMPDIR": str(ray_tmp)} | RAY_TEST_ENV
    head = subprocess.Popen(
        [
            str(RAY_CLI),
            "start",
            "--head",
            f"--port={port}",
            "--num-cpus=1",
            "--block",
            "--include-dashboard=false",
            f"--temp-dir={ray_tmp / 'ray'}",
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
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
