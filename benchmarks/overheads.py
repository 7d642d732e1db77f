"""What lorp's own steps cost, sections 1 to 5b of `benchmarks/run.py`: the capture of S
against a bare forward and against the usual way of computing it, its memory as the
calibration set grows, the capture through the pipeline's Ray actors, every method's
selection, and the linear repair's statistics pass."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.timing import bare_forward, median_time
from lorp import SimilarityStats, available_methods, get_method, select_layers
from lorp.locality.capture import capture_stats
from lorp.locality.clustering import cluster_layers

ROOT = Path(__file__).resolve().parents[1]

# -- 1 and 2: capture cost -------------------------------------------------------------------


def usual_way(model: Any, batches: list[torch.Tensor], n_blocks: int) -> np.ndarray:
    """How S is usually computed: full LM with lm_head, all hidden states kept, normalised
    in the activation dtype, stacked, one einsum."""
    total, count = None, 0
    with torch.inference_mode():
        for b in batches:
            hs = model(input_ids=b, output_hidden_states=True, use_cache=False).hidden_states
            states = torch.stack(hs[:n_blocks])  # block inputs: [N, B, T, d]
            states = states / states.norm(dim=-1, keepdim=True)
            g = torch.einsum("ibtd,jbtd->ij", states, states).double()
            total = g if total is None else total + g
            count += b.numel()
    return (total / count).numpy()


def capture_benchmarks(
    model: Any, batches: list[torch.Tensor], repeats: int, label: str
) -> dict[str, float]:
    n = int(model.config.num_hidden_layers)
    t_bare = median_time(lambda: bare_forward(model, batches), repeats)
    t_capture = median_time(lambda: capture_stats(model, batches, progress=False), repeats)
    t_usual = median_time(lambda: usual_way(model, batches, n), repeats)
    ours = capture_stats(model, batches, progress=False).matrix()
    usual = usual_way(model, batches, n)
    return {
        f"{label}.bare_s": t_bare,
        f"{label}.capture_s": t_capture,
        f"{label}.usual_s": t_usual,
        f"{label}.capture_overhead": t_capture / t_bare,
        f"{label}.vs_usual_speedup": t_usual / t_capture,
        f"{label}.s_max_abs_diff_vs_usual": float(np.abs(ours - usual).max()),
    }


# -- 3: memory does not grow with the calibration set -----------------------------------------

MEMORY_CHILD = """
import resource, sys, torch
sys.path.insert(0, {root!r})
from lorp.models.loading import load_model
from lorp.locality.capture import capture_stats
from benchmarks.inputs import batches_of, ptb_calibration
torch.set_num_threads(2)
lm = load_model({model!r})
w = ptb_calibration(lm.tokenizer, {samples}, {seq_len})
capture_stats(lm.model, batches_of(w, 4), progress=False)
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""


def peak_rss_kib(samples: int, seq_len: int, model: str) -> int:
    code = MEMORY_CHILD.format(root=str(ROOT), model=model, samples=samples, seq_len=seq_len)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return int(out.stdout.strip().splitlines()[-1])


# -- 4: Ray costs little ------------------------------------------------------------------------


def ray_benchmark(model_path: str, windows: torch.Tensor, repeats: int) -> dict[str, float]:
    import ray

    from pipeline.cluster.model_source import ModelSource
    from pipeline.messages import CaptureTask
    from pipeline.spec.resources import Resources
    from pipeline.stages.capture import CaptureWorker, tree_reduce

    # A fresh local Ray of 2 CPUs, never a cluster this machine already runs.
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR")
    try:
        start = time.perf_counter()
        model = ModelSource(model_path, "dir")
        task = CaptureTask(model, "cal", Resources(num_cpus=1), batch_size=4)
        workers = [CaptureWorker.options(num_cpus=1).remote(task) for _ in range(2)]
        ray.get([w.ready.remote() for w in workers])
        load_s = time.perf_counter() - start
        shards = [ray.put(part) for part in np.array_split(windows.numpy(), 2)]

        def run() -> None:
            pairs = zip(workers, shards, strict=True)
            tree_reduce([w.capture.remote(s, f"shard-{i}") for i, (w, s) in enumerate(pairs)])

        t_ray = median_time(run, repeats)
    finally:
        ray.shutdown()
    return {"ray_load_s": load_s, "ray_capture_s": t_ray}


# -- 5: selection is free -----------------------------------------------------------------------


def selects_from_s_alone(method: str) -> bool:
    """Whether `method` chooses from S alone: scoring models (loss-guided), repairs
    (`window`) or running the model (Prune&Comp) is not a selection cost."""
    m = get_method(method)
    return not (m.needs_evaluator or m.needs_repair or m.needs_model)


def selection_benchmarks(repeats: int) -> dict[str, float]:
    out = {}
    rng = np.random.default_rng(0)
    for n in (32, 64, 128):
        s = SimilarityStats(n)
        x = np.cumsum(rng.normal(size=(n + 1, 64, 96)) * 0.3, axis=0) + 1.0
        s.update(x)
        budget = n // 4
        for method in filter(selects_from_s_alone, available_methods()):
            t = median_time(lambda m=method, s=s, b=budget: select_layers(s, b, m), repeats)
            out[f"select_ms.{method}.n{n}"] = t * 1000
        S = s.matrix()
        out[f"select_ms.spectral_clustering_k4.n{n}"] = (
            median_time(lambda S=S: cluster_layers(S, 4), repeats) * 1000
        )
    return out


# -- 5b: the linear repair's statistics pass -----------------------------------------------


def repair_benchmarks(model: Any, batches: list[torch.Tensor], repeats: int) -> dict[str, float]:
    """One pass of repair sums for every run the grid's selections need, against the S
    capture over the same tokens; the sums' memory at this width and at d = 4096."""
    from lorp.repair.capture import capture_repair_stats
    from lorp.repair.stats import bytes_per_pass, contiguous_runs

    stats = capture_stats(model, batches, progress=False)
    n = stats.n_blocks
    runs = sorted(
        {
            run
            for method in ("lorp", "shortgpt", "streamline")
            for budget in (4, 8)
            for run in contiguous_runs(select_layers(stats, budget, method).layers, n)
        }
    )
    d = int(model.config.hidden_size)
    t_capture = median_time(lambda: capture_stats(model, batches, progress=False), repeats)
    t_repair = median_time(
        lambda: capture_repair_stats(model, batches, runs, progress=False), repeats
    )
    return {
        "repair_runs": len(runs),
        "repair_starts": len({s for s, _ in runs}),
        "repair_capture_s": t_capture,
        "repair_pass_s": t_repair,
        "repair_ratio": t_repair / t_capture,
        "repair_sums_mib": bytes_per_pass(runs, d) / 2**20,
        "repair_sums_gib_at_d4096": bytes_per_pass(runs, 4096) / 2**30,
    }
