"""Helpers for tests that start local servers (Ray nodes, moto S3) on 127.0.0.1."""

from __future__ import annotations

import socket
import subprocess
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
