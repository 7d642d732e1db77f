"""Joining or starting Ray: `init_ray`.

With no address (spec `ray.address` or RAY_ADDRESS) `lorp run` starts its own local Ray
(`address="local"`), whatever cluster this machine last recorded: a stale
ray_current_cluster file must never hang a laptop run. With an address, something must
answer on its port within a bounded time (`connect_timeout_s`), else one line naming the
address: `ray.init` on its own retries a dead GCS for many minutes without a word.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import time
from pathlib import Path

import ray

from pipeline.cluster.capacity import local_node
from pipeline.spec.resources import RaySpec

# Joining a named cluster may take this long (env LORP_RAY_CONNECT_TIMEOUT_S overrides):
# `ray.init(address=...)` on its own retries a dead GCS for many minutes without a word.
CONNECT_TIMEOUT_S = 30.0


def init_ray(ray_spec: RaySpec) -> None:
    """Join the cluster named by RAY_ADDRESS or the spec; otherwise start a fresh local Ray
    (`address="local"`), whatever other cluster this machine knows of."""
    if ray.is_initialized():
        return
    env = os.environ.get("RAY_ADDRESS")
    address = env or ray_spec.address
    if address and address != "local":
        check_reachable("RAY_ADDRESS" if env else "ray.address", address)
        ray.init(address=address, logging_level=logging.WARNING)
        return
    # Embedded local Ray; its dashboard (when installed) binds to loopback only. Worker
    # output (library warnings, progress bars) stays in Ray's session logs unless lorp
    # runs verbose: the driver's own lines are the job's voice, errors come back raised.
    # Its memory from the machine's total, not from what is free at this moment (Ray's
    # default): the plan's decisions (`pipeline.plan.memory`) must not depend on
    # whether another job just finished or the page cache is full.
    node = local_node(ray_spec.num_cpus)
    ray.init(
        address="local",
        num_cpus=ray_spec.num_cpus,
        object_store_memory=int(node["object_store_memory"]),
        _memory=int(node["memory"]),
        include_dashboard=False,
        dashboard_host="127.0.0.1",
        logging_level=logging.WARNING,
        log_to_driver=logging.getLogger().isEnabledFor(logging.INFO),
    )


def connect_timeout_s() -> float:
    raw = os.environ.get("LORP_RAY_CONNECT_TIMEOUT_S")
    try:
        return float(raw) if raw else CONNECT_TIMEOUT_S
    except ValueError:
        raise ValueError(f"LORP_RAY_CONNECT_TIMEOUT_S must be seconds, got {raw!r}") from None


def check_reachable(field: str, address: str) -> None:
    """Return once something answers on the address's port within the connect timeout;
    else a one-line ValueError naming `field` and the address. For "auto" that is the
    cluster the last `ray start` on this machine recorded (Ray's ray_current_cluster file);
    `ray.init("auto")` then resolves the same file, and turns token auth on as Ray does
    for "auto" only (RAY_AUTH_MODE=token is needed with an explicit host:port)."""
    target = _recorded_cluster(field) if address == "auto" else address
    scheme, _, rest = target.rpartition("://")
    if scheme not in {"", "ray"}:
        raise ValueError(
            f"{field} {address!r}: ray.init takes host:port, 'auto' or ray://host:port "
            "(an http:// address is the dashboard's, for `ray job submit`)"
        )
    host, _, port = rest.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"{field} {address!r}: not host:port, 'auto' or ray://host:port")
    timeout = connect_timeout_s()
    reason = _probe(host.strip("[]"), int(port), timeout)
    if reason is not None:
        via = f" (recorded at {target})" if address == "auto" else ""
        raise ValueError(
            f"{field} {address!r}{via}: no Ray cluster answers there within {timeout:g} s "
            f"({reason})"
        )


def ray_address_file() -> Path:
    """Where `ray start` records its cluster: Ray's temp dir (RAY_TMPDIR, else TMPDIR on
    Linux, else /tmp) / ray / ray_current_cluster, as ray._common.utils has it."""
    base = os.environ.get("RAY_TMPDIR")
    if not base and sys.platform.startswith("linux"):
        base = os.environ.get("TMPDIR")
    return Path(base or "/tmp") / "ray" / "ray_current_cluster"


def _recorded_cluster(field: str) -> str:
    path = ray_address_file()
    recorded = path.read_text().strip() if path.is_file() else ""
    if not recorded:
        raise ValueError(
            f"{field} 'auto': no Ray cluster recorded in {path} (start one with "
            "`ray start --head`, or name its host:port)"
        )
    return recorded


def _probe(host: str, port: int, timeout: float) -> str | None:
    """None once a TCP connection to host:port succeeds before `timeout`; else the last
    error. Retried each second: a head the autoscaler is still starting may answer late."""
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        try:
            with socket.create_connection((host, port), timeout=max(0.1, min(left, 5.0))):
                return None
        except OSError as exc:
            reason = exc.strerror or str(exc) or type(exc).__name__
        if left <= 1.0:
            return reason
        time.sleep(1.0)
