"""What each stage sends to Ray (`pipeline.driver.tasks` and the capture, loss and point
tasks): the model as its reference, no path of the driver's, on a real local Ray."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pipeline.spec.parse import parse_spec
from tests.helpers.job_specs import tiny_job
from tests.helpers.ray_cluster import local_ray
from tests.helpers.tiny_models import save_tiny_ptb

EVALUATION = {"perplexity": ["ptb"], "seq_len": 48, "max_windows": 2, "speed": False}

CALIBRATION = {"dataset": "ptb", "samples": 8, "seq_len": 48, "shards": 2, "batch_size": 4}


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
    from lorp.models.variant_manifest import is_manifest, read_manifest
    from pipeline.driver.model_stages import Preparer
    from pipeline.driver.recorder import Recorder
    from pipeline.driver.tasks import TaskMaker
    from pipeline.events.progress import Progress
    from pipeline.plan.models import plan_models
    from pipeline.stages.calibration import heldout_windows
    from pipeline.stages.loss_evaluators import loss_task
    from pipeline.stages.points import run_point
    from pipeline.stages.statistics import calibration_shards, capture_task, load_shards

    methods = [{"name": "shortgpt"}]  # the loss task is built below, not run: no sleb
    spec = tiny_job(tmp_path, model, "paths", budgets=[1], methods=methods, evaluation=EVALUATION)
    spec = parse_spec(spec | {"storage": str(tmp_path / "shared"), "calibration": CALIBRATION})
    (plan,) = plan_models(spec)
    recorder = Recorder(spec, False, Progress(bar=False))
    preparer = Preparer(spec, False, recorder.open(), recorder.preparation, recorder.progress.note)
    points = preparer.prepare(plan, "transformers", lambda kind, what: None).points  # on Ray
    shards = load_shards(calibration_shards(spec.calibration, plan, spec.run_dir))
    tok = AutoTokenizer.from_pretrained(plan.path)
    where = recorder.storage.location

    tasks = TaskMaker.for_job(spec, where, "transformers")

    calls = [
        capture_task(
            spec.resources.capture,
            spec.calibration,
            plan,
            calibration_shards(spec.calibration, plan, spec.run_dir),
        ),
        *shards,
        loss_task(
            spec.evaluation,
            spec.resources.grid,
            plan,
            heldout_windows(tok, spec.calibration).windows,
        ),
        *[tasks.point(p, {}) for p in points],
        tasks.speed(points),
    ]
    assert all(isinstance(s.windows, np.ndarray) for s in shards)
    forbidden = [spec.run_dir, cache_root(), Path.home() / ".cache"]
    for call in calls:
        for text in strings(call):
            bad = [str(r) for r in forbidden if under(text, r)]
            assert not bad, f"{type(call).__name__} carries {text!r}, under {bad}"
    source = plan.source()
    assert source.ref == str(model) and source.kind == "dir" and source.revision is None
    assert {c.model for c in calls if hasattr(c, "model")} == {source}

    pruned = next(p for p in points if p.method_name == "shortgpt")
    result = ray.get(run_point.remote(tasks.point(pruned, {})))
    saved = tmp_path / "shared" / "checkpoints" / "tiny" / "shortgpt-b1"
    assert is_manifest(saved) and np.isfinite(result.metrics["ppl_ptb"])  # `checkpoints:`'s default
    assert read_manifest(saved)["base"]["ref"] == str(model)
    assert not (spec.run_dir / "checkpoints").exists()

    elsewhere = dataclasses.replace(source, ref=str(tmp_path / "gone"))
    gone = dataclasses.replace(tasks.point(pruned, {}), model=elsewhere)
    with pytest.raises(Exception, match=r"model '.*gone' is not on node \S+"):
        ray.get(run_point.remote(gone))
