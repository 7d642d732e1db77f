"""What the cluster's nodes offer, asked of Ray: a whole node's request for a speed task,
whether any node could ever hold a request (`unmet`: what the driver says while a stage
waits on a cluster with no such node), and the one-line cause of a Ray task's error."""

from __future__ import annotations

from typing import Any

import ray

from pipeline.spec.resources import Resources


def first_line(exc: BaseException) -> str:
    """The cause of a Ray task error, as one line."""
    text = str(exc).strip()
    return text.splitlines()[-1] if text else repr(exc)


def alive_nodes() -> list[dict[str, Any]]:
    return [n for n in ray.nodes() if n.get("Alive")]


def whole_node(resources: Resources | None, gpus: float) -> Resources:
    """A speed task's request: the spec's, else every CPU of the largest node (and a GPU
    where the grid uses GPUs), so nothing else of the job shares its cores."""
    if resources is not None:
        return resources
    cpus = max((n["Resources"].get("CPU", 1) for n in alive_nodes()), default=1)
    return Resources(num_cpus=cpus, num_gpus=1 if gpus > 0 else 0)


def request(resources: Resources) -> dict[str, float]:
    """A `Resources` as Ray's resource names, zeros left out."""
    need = {"CPU": resources.num_cpus, "GPU": resources.num_gpus}
    return {k: float(v) for k, v in need.items() if v}


def unmet(need: dict[str, float], nodes: list[dict[str, Any]] | None = None) -> str | None:
    """None when some alive node has at least `need` in total (busy or not: Ray queues the
    task until it frees); else one line saying what the largest nodes offer, which a
    waiting stage reports (an autoscaler may still add the node)."""
    nodes = alive_nodes() if nodes is None else nodes
    for n in nodes:
        have = n.get("Resources", {})
        if all(have.get(k, 0.0) >= v for k, v in need.items()):
            return None
    offers = sorted({_offer(n.get("Resources", {})) for n in nodes}) or ["no alive node"]
    return f"no node offers {_offer(need)} (nodes: {'; '.join(offers)})"


def _offer(res: dict[str, float]) -> str:
    cpu, gpu = res.get("CPU", 0.0), res.get("GPU", 0.0)
    return f"{cpu:g} CPU" + (f", {gpu:g} GPU" if gpu else "")
