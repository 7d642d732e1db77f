"""`lorp plan`: what a job would do, printed without running a stage; every problem one line
and exit 2; the memory decisions the same whatever else holds memory when Ray starts."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline.cluster.capacity import largest_node
from pipeline.plan.memory import plan_memory
from pipeline.plan.models import plan_models
from pipeline.plan.report import plan_job
from pipeline.spec.parse import parse_spec
from tests.helpers.cli_runner import lorp
from tests.helpers.job_specs import tiny_job, write_job
from tests.helpers.ray_cluster import local_ray
from tests.helpers.tiny_models import save_tiny_ptb


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_ptb("llama", tmp_path_factory.mktemp("plan") / "tiny")


def test_the_plan_names_models_decisions_points_and_the_figure_it_used(
    model: Path, tmp_path: Path
) -> None:
    spec = tiny_job(
        tmp_path, model, "planned", repair=["none", "linear"], resources={"grid": {"memory_gib": 2}}
    )
    run = lorp("plan", str(write_job(tmp_path, spec)))
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert lines[0].startswith("job planned: backend none")  # evaluation is off
    assert lines[1].startswith("tiny: Llama, 6 blocks,")
    assert lines[2] == "  domains: calibrated on prose (ptb 100%); judged on nothing"
    capture, evaluate = lines[3], lines[4]
    assert capture.startswith("  capture: held whole,") and "this machine" in capture
    assert (
        evaluate.startswith("  evaluate: held whole,")
        and "(resources.grid.memory_gib: 2)" in evaluate
    )
    # 3 budgets x 3 methods x 2 repairs; no dense point with evaluation off
    assert "  points: 18 (lorp 3, lorp+linear 3, shortgpt 3," in run.stdout
    assert lines[-1] == "grid: 18 points, 0 already in the catalog"
    as_json = json.loads(lorp("plan", "--json", str(write_job(tmp_path, spec))).stdout)
    assert as_json["ok"] and as_json["models"][0]["stages"]["evaluate"]["worker_gib"] == 2.0


def test_the_plan_shows_each_models_domains_and_warns_of_one_it_is_not_calibrated_on(
    model: Path, tmp_path: Path
) -> None:
    spec = tiny_job(tmp_path, model, "domains")
    spec["evaluation"] = {
        "perplexity": ["ptb", "lee", "data/tickets.jsonl"],
        "seq_len": 64,
        "speed": False,
    }
    spec["domains"] = {"data/tickets.jsonl": "support"}
    spec["calibration"]["dataset"] = [{"name": "ptb", "weight": 3}, {"name": "code"}]
    run = lorp("plan", str(write_job(tmp_path, spec)))
    lines = run.stdout.splitlines()
    assert lines[2] == (
        "  domains: calibrated on prose (ptb 75%); code (code 25%); "
        "judged on prose (ptb, lee); support (data/tickets.jsonl)"
    ), run.stdout
    warnings = [line for line in lines if line.startswith("warning: ")]
    assert warnings == [
        "warning: tiny: judged on support text but calibrated on prose, code only; add a "
        "support corpus to its calibration (calibration.dataset, or models[].calibration)"
    ]
    spec["domains"] = {"lee": "code"}  # a packaged corpus keeps its domain
    run = lorp("plan", str(write_job(tmp_path, spec)))
    assert run.returncode == 2
    assert (
        run.stderr.strip()
        .splitlines()[-1]
        .endswith("domains.lee: 'lee' is packaged prose text, got 'code'")
    ), run.stderr


def test_every_problem_is_one_line_and_the_job_is_refused(model: Path, tmp_path: Path) -> None:
    spec = tiny_job(tmp_path, model, "refused", resources={"capture": {"memory_gib": 0.001}})
    spec["models"] = [{"ref": str(tmp_path / "missing")}, *spec["models"]]
    job = write_job(tmp_path, spec)
    run = lorp("plan", str(job))
    assert run.returncode == 2
    problems = [line for line in run.stdout.splitlines() if line.startswith("problem: ")]
    assert len(problems) == 2, run.stdout
    assert problems[0].startswith("problem: models[0].ref: ")
    assert "cannot run its capture even streamed" in problems[1]
    assert "set resources.capture.memory_gib: " in problems[1]  # the setting, and a value
    assert "tiny: Llama, 6 blocks" in run.stdout  # the other model is still planned
    refused = lorp("run", str(job))
    assert refused.returncode == 2  # the same problems, one line each, and nothing else
    assert refused.stderr.splitlines() == [p.removeprefix("problem: ") for p in problems]
    assert not (tmp_path / "refused" / "catalog.parquet").exists()  # nothing ran


def test_the_suggested_memory_makes_the_refused_stage_run(model: Path, tmp_path: Path) -> None:
    spec = tiny_job(tmp_path, model, "tight", resources={"capture": {"memory_gib": 0.001}})
    problem = plan_job(parse_spec(spec)).problems[0]
    value = float(problem.split("set resources.capture.memory_gib: ")[1].split()[0])
    spec["resources"] = {"capture": {"memory_gib": value}}
    assert plan_job(parse_spec(spec)).ok


HOLD = "import sys, time; b = bytearray(int(sys.argv[1])); b[::4096] = b'x' * len(b[::4096]); print('held', flush=True); time.sleep(600)"  # noqa: E501


def decisions(spec_dict: dict) -> list[dict]:
    """Every stage's decision and figures; where they came from (the node before Ray
    starts, or Ray's) aside."""
    spec = parse_spec(spec_dict)
    records = [plan_memory(spec, p).memory_record() for p in plan_models(spec)]
    return [{stage: d | {"source": None} for stage, d in r.items()} for r in records]


@pytest.mark.slow
def test_decisions_are_equal_with_another_jobs_memory_held(model: Path, tmp_path: Path) -> None:
    """A local Ray started while another process holds 3 GiB plans exactly as one
    started on an idle machine, and as the plan made before Ray started."""
    spec = tiny_job(tmp_path, model, "same")
    before = decisions(spec)
    with local_ray():
        idle_node, idle = largest_node()[0], decisions(spec)
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(3 * 2**30)], stdout=subprocess.PIPE, text=True
    )  # noqa: E501
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        time.sleep(0.5)
        with local_ray():
            busy_node, busy = largest_node()[0], decisions(spec)
    finally:
        holder.kill()
    assert idle_node["memory"] == busy_node["memory"]
    assert before == idle == busy


def test_the_plan_counts_sub_layer_points_and_says_how_their_variants_are_kept(
    model: Path, tmp_path: Path
) -> None:
    """Sub-layer granularities add their own slots (`<label>-<granularity>`), and each
    model says whether vLLM serves its variants."""
    from tests.helpers.tiny_models import save_tiny_ptb as save

    gemma = save("gemma3_text", tmp_path / "gemma3")
    spec = tiny_job(
        tmp_path,
        model,
        "units",
        budgets=[1, 0.5],
        methods=[{"name": "shortgpt"}],
        granularity=["block", "attention"],
    )
    spec["models"].append({"ref": str(gemma), "name": "g"})
    outline = plan_job(parse_spec(spec))
    assert outline.ok, outline.problems
    tiny, g = outline.models
    # blocks: 1 and round(0.5 x 6) = 3; attentions: 1 and round(0.5 x 6) = 3
    assert tiny.points == {"shortgpt": 2, "shortgpt-attention": 2}
    assert tiny.sublayers.startswith("stored as Nemotron-NAS")
    assert g.sublayers.startswith("judged in transformers, not stored (model_type 'gemma3")
    assert plan_job(parse_spec({**spec, "granularity": ["block"]})).models[0].sublayers == ""


def test_a_plan_hashes_no_weight_and_a_second_plan_builds_no_model(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`lorp plan` reads configs and headers: the fingerprint's hashing is the run's, and
    the model built on the meta device (once for the model and its memory decisions) is
    read back from lorp's cache by the next plan, which says the same."""
    import lorp.models.fingerprint as fingerprint
    import pipeline.plan.reads as reads

    monkeypatch.setenv("LORP_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(fingerprint, "_hash_checkpoint", lambda *a: pytest.fail("hashed"))
    builds: list[Path] = []
    real = reads.build_read
    monkeypatch.setattr(reads, "build_read", lambda p, t=False: builds.append(p) or real(p, t))
    spec = parse_spec(tiny_job(tmp_path, model, "twice", repair=["none", "linear"]))
    first = plan_job(spec)
    assert first.ok and builds == [model]
    assert plan_job(spec) == first and builds == [model]
