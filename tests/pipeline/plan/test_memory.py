"""Per model and stage, whole or streamed (`pipeline.plan.memory`): refusals while
planning, and vLLM's tensor-parallel size from the model's size and the GPUs."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import ray
import torch

from lorp.models.memory import GIB, weight_size
from lorp.models.safetensors_index import tensor_index
from lorp.models.shape import ModelShape
from pipeline.cluster.capacity import gpu_memory_bytes
from pipeline.driver.tasks import TaskMaker
from pipeline.plan.decisions import HEADROOM
from pipeline.plan.grid import GridPoint
from pipeline.plan.memory import plan_memory, repair_fit_bytes, tensor_parallel
from pipeline.plan.models import plan_models
from pipeline.spec.checks import SpecError
from pipeline.spec.parse import parse_spec
from pipeline.stages.pools import EvaluatorPool
from tests.helpers.job_specs import tiny_job
from tests.helpers.ray_cluster import local_ray
from tests.helpers.tiny_models import save_tiny_ptb
from tests.helpers.worker_memory import EVAL, between

pytestmark = [pytest.mark.integration]


def test_distillation_of_a_model_streamed_in_its_points_is_refused_while_planning(
    tmp_path: Path,
) -> None:
    """A backward pass through a streamed model would hold all its weights: the plan says
    so in one line, before the run directory exists; held whole, the same job plans."""
    model = save_tiny_ptb("llama", tmp_path / "llama", n_blocks=8)
    job = {
        "budgets": [2],
        "methods": [{"name": "shortgpt"}],
        "repair": ["linear"],
        "repair_distill": 2,
        "evaluation": EVAL,
    }
    parsed = parse_spec(tiny_job(tmp_path, model, **job))
    shape = ModelShape.from_config(json.loads((model / "config.json").read_text()))
    fit = repair_fit_bytes(
        parsed.repair_settings, plan_models(parsed)[0], shape, 4, distills=parsed.distills
    )
    ev = parsed.evaluation
    grid = {"memory_gib": between(model, "evaluate", ev.batch_size, ev.seq_len + 1, fit)}
    capture = {"memory_gib": 4}
    spec = parse_spec(
        tiny_job(tmp_path, model, resources={"grid": grid, "capture": capture}, **job)
    )
    (plan,) = plan_models(spec)
    with pytest.raises(SpecError, match=r"^repair_distill: tiny is streamed in its grid points"):
        plan_memory(spec, plan)
    assert not (tmp_path / "grid").exists()
    whole = {"grid": {"memory_gib": 4}, "capture": capture}
    held = parse_spec(tiny_job(tmp_path, model, resources=whole, **job))
    assert plan_memory(held, plan_models(held)[0]).streamed("evaluate") is False


def test_a_model_that_does_not_fit_even_streamed_is_refused(tmp_path: Path) -> None:
    model = save_tiny_ptb("llama", tmp_path / "llama")
    spec = parse_spec(tiny_job(tmp_path, model, resources={"capture": {"memory_gib": 1e-6}}))
    (plan,) = plan_models(spec)
    with pytest.raises(SpecError, match=r"model 'tiny' cannot run its capture even streamed"):
        plan_memory(spec, plan)
    assert not (tmp_path / "grid").exists()


def test_vllm_spans_as_many_gpus_as_the_model_needs(tmp_path: Path) -> None:
    """On GPUs, vLLM holds a whole variant: `tensor_parallel_size: auto` (the default)
    gives an engine the fewest GPUs that hold the model, the point's task asks Ray for
    them, and the evaluator pool starts an actor with them once idle actors of another
    size are gone (on a local Ray with two logical GPUs). A number that does not fit,
    or more shards than any node's GPUs, is refused while planning."""
    model = save_tiny_ptb("llama", tmp_path / "llama")
    size = weight_size(tensor_index(model), torch.float32)
    shape = ModelShape.from_config(json.loads((model / "config.json").read_text()))
    gpu_gib = 0.6 * size.total / HEADROOM / GIB  # 60% of the weights per GPU
    grid = {"num_gpus": 1, "memory_gib": gpu_gib}
    job = {
        "checkpoints": "full",
        "evaluation": EVAL | {"backend": "vllm"},
        "resources": {"grid": grid},
    }
    spec = parse_spec(tiny_job(tmp_path, model, **job))
    (plan,) = plan_models(spec)
    assert spec.evaluation.tensor_parallel_size == "auto"
    assert (
        tensor_parallel(
            spec.resources.grid,
            spec.evaluation.tensor_parallel_size,
            plan,
            size,
            shape,
            node_gpus=2,
        )
        == 2
    )
    with pytest.raises(
        SpecError,
        match=r"^model 'tiny' needs vLLM over 2 GPUs "
        r"\(tensor_parallel_size\) and the largest node has 1$",
    ):
        tensor_parallel(
            spec.resources.grid,
            spec.evaluation.tensor_parallel_size,
            plan,
            size,
            shape,
            node_gpus=1,
        )
    one = parse_spec(
        tiny_job(
            tmp_path,
            model,
            **(job | {"evaluation": EVAL | {"backend": "vllm", "tensor_parallel_size": 1}}),
        )
    )
    refusal = (
        r"^model 'tiny': its .* GiB of weights do not fit vLLM on 1 GPU\(s\) .*: "
        r"set evaluation.tensor_parallel_size: 2 \(or auto\)$"
    )
    with pytest.raises(SpecError, match=refusal):
        tensor_parallel(
            one.resources.grid, one.evaluation.tensor_parallel_size, plan, size, shape, node_gpus=2
        )
    with pytest.raises(
        SpecError,
        match=r"^evaluation.tensor_parallel_size: 2 needs as many GPUs "
        r"per vLLM evaluator, and resources.grid.num_gpus is 1$",
    ):
        parse_spec(
            tiny_job(
                tmp_path,
                model,
                **(job | {"evaluation": EVAL | {"backend": "vllm", "tensor_parallel_size": 2}}),
            )
        )
    # The point's task: two GPUs, and an engine over both.
    wide = replace(plan, tensor_parallel=2)
    task = TaskMaker.for_job(spec, str(tmp_path), "vllm").point(
        GridPoint("dense", wide, None, None), {}
    )
    assert (task.resources.num_gpus, task.evaluation.tensor_parallel_size) == (2, 2)
    assert wide.memory_record() == {}  # no stage decided: nothing to add it to
    with local_ray(num_cpus=2, num_gpus=2):
        pool = EvaluatorPool(2, spec.resources.grid)
        narrow = pool.actor_for(spec.resources.grid)
        assert len(ray.get(narrow.__ray_call__.remote(lambda self: ray.get_gpu_ids()))) == 1
        pool.idle.append((narrow, (1, 1)))
        # The idle one-GPU actor must go first: two GPUs in all, so the wide one could not
        # start beside it.
        both = pool.actor_for(task.resources)
        ids = ray.get(both.__ray_call__.remote(lambda self: ray.get_gpu_ids()), timeout=120)
        assert len(ids) == 2 and pool.idle == []
        pool.idle.append((both, (1, 2)))
        assert pool.actor_for(task.resources) is both  # an idle actor of its size is reused
        ray.kill(both)  # its GPUs free for the probe below
        # Planning without a GPU memory given asks a GPU worker (the driver has no GPU);
        # these logical GPUs have no CUDA, so the plan asks for the figure in one line.
        with pytest.raises(
            SpecError,
            match=r"^resources.grid.memory_gib: the grid runs on "
            r"GPUs and no GPU worker reported its memory within 120 s; set it "
            r"to one GPU's memory$",
        ):
            gpu_memory_bytes("grid")
