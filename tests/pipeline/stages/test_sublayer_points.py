"""A sub-layer grid point on its worker (`pipeline.stages.sublayer_points`): a family vLLM
cannot serve in the Nemotron-NAS form is judged in memory whatever the job's backend, its
result says which backend judged it, and its figure is the in-memory variant's."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from lorp.methods.registry import Selection
from pipeline.driver.tasks import TaskMaker
from pipeline.plan.grid import GridPoint, stored_at
from pipeline.plan.models import plan_model
from pipeline.spec.parse import parse_spec
from tests.helpers.job_specs import tiny_job
from tests.helpers.tiny_models import save_tiny_ptb

EVALUATION = {
    "backend": "vllm",
    "perplexity": ["ptb"],
    "seq_len": 48,
    "max_windows": 2,
    "batch_size": 2,
    "zero_shot": [],
    "speed": False,
}


def _point(tmp_path: Path, family: str):  # type: ignore[no-untyped-def]
    model = save_tiny_ptb(family, tmp_path / family)
    spec = tiny_job(
        tmp_path,
        model,
        "units",
        budgets=[2],
        methods=[{"name": "shortgpt"}],
        granularity=["attention"],
        evaluation=EVALUATION,
    )
    job = parse_spec(spec)
    plan = plan_model(job, 0, job.models[0])
    selection = Selection((4, 6), "shortgpt", 2, 12)  # attn.2 and attn.3
    point = GridPoint("k", plan, job.methods[0], selection, granularity="attention")
    point = replace(point, checkpoint=stored_at(point, job.saves_checkpoints))
    return job, TaskMaker.for_job(job, str(tmp_path / "units"), "vllm").point(point, {})


@pytest.mark.integration
def test_a_family_vllm_cannot_serve_is_judged_in_memory_and_says_so(tmp_path: Path) -> None:
    import torch

    from lorp.models.loading import load_model
    from lorp.models.sublayers import remove_sublayers
    from pipeline.evaluation.backends import TransformersBackend, evaluate, open_backend
    from pipeline.stages.points import execute_point

    job, task = _point(tmp_path, "gemma3_text")
    assert task.checkpoint is None and task.units == (4, 6) and task.backend == "vllm"
    result = execute_point(task)
    assert result.backend == "transformers"  # the row's eval_backend
    assert result.kept == list(range(6)) and result.params < result.params_dense
    lm = load_model(task.model.ref, dtype="float32")
    remove_sublayers(lm.model, [4, 6])
    with torch.no_grad(), open_backend(TransformersBackend(lm.model, lm.tokenizer, 2)) as be:
        want = evaluate(be, lm.tokenizer, job.evaluation)
    assert result.metrics["ppl_ptb"] == pytest.approx(want["ppl_ptb"], rel=1e-5)

    _, servable = _point(tmp_path, "llama")  # stored as Nemotron-NAS: vLLM judges it
    assert servable.checkpoint == "checkpoints/tiny/shortgpt-attention-b2"
