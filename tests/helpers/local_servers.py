"""Helpers for tests that start local servers (Ray nodes, moto S3) on 127.0.0.1."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest


def free_port() -> int:
    """A port nothing listens on: bound, then released."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_port(
    port: int, proc: subprocess.Popen[Any], log: Path, what: str, timeout: float = 90
) -> None:
    """Return once 127.0.0.1:`port` accepts a connection; fail the test with the tail of
    `log` when `proc` exits or `timeout` passes first."""
    deadline = time.time() + timeout
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            if time.time() > deadline or proc.poll() is not None:
                proc.kill()
                pytest.fail(f"{what} did not start: {log.read_text()[-3000:]}")
            time.sleep(0.2)


AWS_TEST_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
}
"""Dummy credentials moto accepts; no test reaches a real AWS endpoint."""


def start_moto(port: int, log: Path) -> subprocess.Popen[Any]:
    """moto's S3 server on 127.0.0.1:`port` (its own session: kill its group to stop it),
    returned once it accepts connections."""
    import moto.server  # noqa: F401  (make test installs it: a missing one fails)

    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    wait_for_port(port, proc, log, "moto server", timeout=60)
    return proc


def s3_location(port: int, bucket: str, prefix: str) -> str:
    """A storage URI of `bucket`/`prefix` on the moto server at `port`."""
    return f"s3://{bucket}/{prefix}?endpoint_override=127.0.0.1:{port}&scheme=http&region=us-east-1"


def create_bucket(port: int, bucket: str) -> None:
    import pyarrow.fs as pafs

    options = {"endpoint_override": f"127.0.0.1:{port}", "scheme": "http"}
    pafs.S3FileSystem(**options, allow_bucket_creation=True).create_dir(bucket)
