"""A grid point's peak memory on its Ray worker is at most what its plan said
(`pipeline.plan.memory`, the `evaluate` decision): in float32 and in bfloat16 (a float32
file converted as it loads), unrepaired and linearly repaired (its runs' sums fetched
from the object store, fitted, gated on held-out windows, folded), each point's figure
as its `point` event records it (`pipeline.driver.point_records.point_memory`).

The model is wide enough (4 blocks of 512, 0.07 GiB in float32) that its weights and
the evaluation's logits, not the allocator's slack, make the figures; the points run in
one Ray worker in turn, as a demo's do, the dense model loaded once per dtype and copied
for each point."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import ray
import torch

from lorp.models.loading import load_model
from lorp.repair.capture import capture_repair_stats
from pipeline.driver.point_records import point_memory
from pipeline.driver.tasks import FOLLOWERS, TaskMaker
from pipeline.messages import FollowerWindows
from pipeline.plan.memory import plan_memory
from pipeline.plan.models import plan_model
from pipeline.spec.parse import parse_spec
from pipeline.stages.points import run_point
from tests.helpers.grid_points import selected
from tests.helpers.job_specs import tiny_job
from tests.helpers.ray_cluster import local_ray
from tests.helpers.tiny_models import save_tiny_ptb

pytestmark = [pytest.mark.integration, pytest.mark.slow]

EVALUATION = {
    "perplexity": ["ptb"],
    "seq_len": 255,
    "max_windows": 4,
    "batch_size": 2,
    "zero_shot": [],
    "speed": False,
}


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:  # type: ignore[no-untyped-def]
    return save_tiny_ptb("llama", tmp_path_factory.mktemp("wide") / "llama", n_blocks=4, width=512)


def _points(root: Path, model: Path, dtype: str) -> list[tuple[Any, Any]]:
    """(grid point, its task) of the job's unrepaired and repaired points removing blocks
    1-2, their runs' sums and held-out windows put in the object store."""
    spec = tiny_job(
        root,
        model,
        budgets=[2],
        methods=[{"name": "shortgpt"}],
        repair=["none", "linear"],
        evaluation=EVALUATION,
    )
    spec["models"][0]["dtype"] = dtype
    job = parse_spec(spec)
    plan = plan_memory(job, plan_model(job, 0, job.models[0]), "transformers")
    points = selected(job, plan, (1, 2))
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    tokens = np.random.default_rng(0).integers(0, vocab, (16, 65))
    refs: dict[tuple[str, Any], Any] = {
        (plan.label, FOLLOWERS): ray.put(
            FollowerWindows(tokens[:8].astype(np.int32), tokens[8:].astype(np.int32), 0, 2)
        )
    }
    dense = load_model(str(model), with_tokenizer=False).model
    for run in {r for p in points for r in p.runs}:
        batches = [torch.from_numpy(tokens[i : i + 4]) for i in range(0, 16, 4)]
        stats = capture_repair_stats(
            dense, batches[:2], [run], model_fingerprint=plan.fingerprint, progress=False
        )
        stats.held = capture_repair_stats(dense, batches[2:], [run], progress=False)
        refs[(plan.label, run)] = ray.put(stats)
    maker = TaskMaker.for_job(job, str(root / "store"), "transformers")
    return [(p, maker.point(p, refs)) for p in points]


def test_every_point_peaks_within_its_plan(model: Path, tmp_path: Path) -> None:
    with local_ray(num_cpus=1):
        for dtype in ("float32", "bfloat16"):
            for point, task in _points(tmp_path / dtype, model, dtype):
                result = ray.get(run_point.remote(task))
                figures = point_memory(point, result)
                peak, planned = figures["peak_gib"], figures["planned_gib"]
                assert 0 < peak <= planned, (dtype, point.repair, peak, planned)
                assert planned <= 1.5 * peak, (dtype, point.repair, peak, planned)
