"""A finished point's catalog row (`pipeline.driver.rows`): its columns are the job's, the
model's, the point's and its result's values; its figures hold the selection's cost, the
measured metrics (NaN left out), the repair's residuals and the serving costs; a repaired
point's verdict is read from its fit records; the row goes into a typed table."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import asdict

import pyarrow as pa
import pytest

import lorp
from lorp.locality.profile import Profile
from lorp.models.memory import Decision
from pipeline.catalog.protocol import calibration_id, protocol_id
from pipeline.catalog.row import CORE_SCHEMA, CatalogRow
from pipeline.catalog.table import to_table
from pipeline.driver.rows import (
    JobColumns,
    RowContext,
    catalog_row,
    cost_seq_len,
    memory_plan,
    model_facts,
    repair_columns,
    repair_validation,
    sublayer_labels,
)
from pipeline.messages import PointResult
from pipeline.plan.grid import GridPoint, ModelPlan
from pipeline.plan.models import plan_models
from pipeline.spec.calibration import CalibrationSpec
from pipeline.spec.evaluation import EvaluationSpec
from pipeline.spec.job import JobSpec
from pipeline.spec.parse import parse_spec
from tests.helpers.grid_points import model_grid, selected
from tests.helpers.job_specs import tiny_job
from tests.helpers.tiny_models import save_tiny_ptb

EVALUATION = {"perplexity": ["ptb"], "seq_len": 48, "max_windows": 2, "speed": False}
PROFILE = Profile(rls=0.75, k=3, labels=(0, 0, 1, 1, 2, 2), n_blocks=6)
CHECKPOINT = "/store/checkpoints/tiny/shortgpt-b2"
PARAMS, PARAMS_DENSE = 1_500_000, 2_000_000
"""A variant's parameters and its dense model's, as a point reports them."""
FLOAT32 = 4
"""Bytes per value: the tiny model is float32."""
KV_PER_BLOCK = 2 * 1 * 32 * FLOAT32
"""K and V of one token in one block of the tiny model: one KV head of 32 dimensions."""


@pytest.fixture(scope="module")
def spec(tmp_path_factory: pytest.TempPathFactory) -> JobSpec:
    root = tmp_path_factory.mktemp("rows")
    model = save_tiny_ptb("llama", root / "llama")
    methods = [{"name": "shortgpt"}]
    job = tiny_job(root, model, budgets=[2], methods=methods, evaluation=EVALUATION)
    return parse_spec(job | {"repair": ["none", "linear"]})


@pytest.fixture(scope="module")
def plan(spec: JobSpec) -> ModelPlan:
    (plan,) = plan_models(spec)
    return plan


def job_columns(spec: JobSpec, evaluation: EvaluationSpec | None = None) -> JobColumns:
    ev = evaluation or spec.evaluation
    return JobColumns("grid", "run-1", "sqlite:///m.db", "7", "/store", ev, True)


def result(point: GridPoint, **fields) -> PointResult:  # type: ignore[no-untyped-def]
    kept = [b for b in range(6) if b not in point.layers]
    return PointResult(point.key, kept, PARAMS, PARAMS_DENSE, **fields)


def row_of(spec: JobSpec, plan: ModelPlan, point: GridPoint, res: PointResult) -> CatalogRow:
    facts = model_facts(PROFILE, "/cache/S.npz", plan.path, plan.calibration)
    ctx = RowContext("mlflow-run", CHECKPOINT, "transformers")
    return catalog_row(point, res, facts, job_columns(spec), ctx)


def test_a_rows_columns_are_the_jobs_the_models_the_points_and_its_results(
    spec: JobSpec, plan: ModelPlan
) -> None:
    point, _ = selected(spec, plan, (2, 3), seconds=0.5)
    row = row_of(spec, plan, point, result(point))
    expected = {
        "grid_key": point.key,
        "job": "grid",
        "run_id": "run-1",
        "model": "tiny",
        "model_ref": plan.spec.ref,
        "family": plan.family,
        "fingerprint": plan.fingerprint,
        "dtype": "float32",
        "n_blocks": 6,
        "method": "shortgpt",
        "method_label": "shortgpt",
        "variant": None,
        "options": "{}",
        "budget": 2,
        "pruned_layers": [2, 3],
        "kept_layers": [0, 1, 4, 5],
        "granularity": "block",
        "sublayers": None,
        "stages": None,
        "memory_plan": None,
        "repair": "none",
        "repair_fits": None,
        "repair_kept": None,
        "rls": 0.75,
        "k": 3,
        "labels": [0, 0, 1, 1, 2, 2],
        "reference_claim": True,
        "stats_file": "/cache/S.npz",
        "params": PARAMS,
        "params_dense": PARAMS_DENSE,
        "checkpoint": CHECKPOINT,
        "storage": "/store",
        "eval_backend": "transformers",
        "tracking_uri": "sqlite:///m.db",
        "experiment_id": "7",
        "mlflow_run_id": "mlflow-run",
        "lorp_version": lorp.__version__,
        "degraded": None,
        "model_uri": None,
    }
    assert {k: getattr(row, k) for k in expected} == expected
    assert json.loads(row.calibration or "") == asdict(plan.calibration)
    assert row.calibration_id == calibration_id(asdict(plan.calibration))
    assert row.evaluation == json.dumps(asdict(spec.evaluation), sort_keys=True)
    assert json.loads(row.evaluation)["perplexity"] == ["ptb"]
    assert row.protocol == protocol_id(asdict(spec.evaluation), "float32")
    assert row.protocol and row.protocol.startswith("ptb48-")
    assert row.created_at and row.created_at.endswith("+00:00")


def test_the_dense_row_has_no_method_granularity_or_repair(spec: JobSpec, plan: ModelPlan) -> None:
    dense = model_grid(spec, plan).dense()
    assert dense is not None
    row = row_of(spec, plan, dense, result(dense))
    assert (row.method, row.method_label, row.budget, row.options) == ("dense", "dense", 0, "{}")
    assert row.pruned_layers == [] and row.kept_layers == list(range(6))
    assert (row.granularity, row.repair, row.k) == (None, None, 3)


def test_a_methods_own_k_and_stages_come_from_its_selection(spec: JobSpec, plan: ModelPlan) -> None:
    stages = {"2": "stage1", "3": "fallback"}
    point, _ = selected(spec, plan, (2, 3), k=5, stages=stages)
    row = row_of(spec, plan, point, result(point))
    assert row.k == 5  # LoRP's own K over the model's 3
    assert row.stages is not None and json.loads(row.stages) == stages


def test_per_window_losses_and_per_item_answers_are_json_columns_not_figures(
    spec: JobSpec, plan: ModelPlan
) -> None:
    """What the paired tests between two variants need (benchmarks/peers.py)."""
    from pipeline.stages.point_evaluation import split_records, zero_shot_info

    point, _ = selected(spec, plan, (2, 3))
    measured = {"ppl_ptb": 30.0, "n_copa": 3.0, "window_nll": {"ptb": [3.1, 3.4]}}
    metrics, windows, items = split_records(measured | {"zero_shot_items": {"copa": "101"}})
    ev = dataclasses.replace(spec.evaluation, zero_shot=("copa",))
    res = result(
        point, metrics=metrics, window_nll=windows, zero_shot=zero_shot_info(ev, metrics, items)
    )
    row = row_of(spec, plan, point, res)
    assert json.loads(row.window_nll or "") == {"ptb": [3.1, 3.4]}
    assert json.loads(row.zero_shot or "")["copa"] == {
        "split": "validation",
        "n": 3,
        "correct": "101",
    }
    assert "window_nll" not in row.figures and "zero_shot_items" not in row.figures


def test_figures_hold_the_selections_cost_the_metrics_and_the_serving_costs(
    spec: JobSpec, plan: ModelPlan
) -> None:
    point, _ = selected(spec, plan, (2, 3), seconds=0.5, n_evals=12)
    metrics = {"ppl_ptb": 31.5, "acc_avg": math.nan, "ppl_lee": None}
    figures = row_of(spec, plan, point, result(point, metrics=metrics)).figures
    assert (figures["n_evals"], figures["select_s"]) == (12.0, 0.5)
    assert figures["ppl_ptb"] == 31.5 and isinstance(figures["ppl_ptb"], float)
    assert "acc_avg" not in figures  # NaN: not measured
    assert "ppl_lee" in figures and figures["ppl_lee"] is None
    assert figures["weight_bytes"] == PARAMS * FLOAT32
    assert figures["kv_bytes_per_token"] == 4 * KV_PER_BLOCK  # 4 blocks kept
    # the evaluation's seq_len (48), then 4k and 32k tokens of context
    decode = [figures[f"decode_bytes_per_token{s}"] for s in ("", "_4k", "_32k")]
    assert decode[1] - decode[0] == (4096 - 48) * 4 * KV_PER_BLOCK
    assert decode[2] - decode[1] == (32768 - 4096) * 4 * KV_PER_BLOCK
    assert figures["predicted_prefill_speedup"] > 1.0
    assert not {"repair_residual", "repair_kept"} & set(figures)  # not repaired


def test_costs_are_counted_at_the_evaluations_seq_len_else_the_calibrations(
    spec: JobSpec, plan: ModelPlan
) -> None:
    cal = CalibrationSpec(seq_len=48)
    assert cost_seq_len(EvaluationSpec(seq_len=4096), cal) == 4096
    assert cost_seq_len(EvaluationSpec(enabled=False, seq_len=4096), cal) == 48
    point, _ = selected(spec, plan, (2, 3))
    facts = model_facts(PROFILE, None, plan.path, plan.calibration)
    ctx = RowContext("run", None, "transformers")
    at_4k = job_columns(spec, EvaluationSpec(seq_len=4096))
    figures = catalog_row(point, result(point), facts, at_4k, ctx).figures
    assert figures["prefill_flops_per_token"] == figures["prefill_flops_per_token_4k"]
    unevaluated = job_columns(spec, EvaluationSpec(enabled=False, seq_len=4096))
    figures = catalog_row(point, result(point), facts, unevaluated, ctx).figures
    assert figures["prefill_flops_per_token"] < figures["prefill_flops_per_token_4k"]


FITS = [
    {
        "residual": 0.2,
        "held_residual": 0.25,
        "kept": "fit",
        "distilled": {"best_epoch": 2, "epochs": 3},
        "gate": {
            "kept": "least squares",
            "worst_loss_ratio": 0.9,
            "tried": ["distilled", "least squares"],
        },
    },
    {
        "residual": 0.4,
        "held_residual": 0.5,
        "kept": "unrepaired",
        "held_by_domain": {
            "code": {"residual": 1.1, "unrepaired": 1.0},
            "prose": {"residual": 0.3, "unrepaired": 1.0},
        },
    },
    {"follower": 4, "residual": 0.9, "held_residual": 0.8, "kept": "fit"},
]
"""Two runs (one kept, one refused on held-out code) and a follower; distilled (epoch 2
kept), then the gate fell back from distilled to least squares."""


def test_the_repair_columns_are_the_worst_runs_and_what_was_kept() -> None:
    assert repair_columns(FITS) == {
        "repair_residual": 0.4,  # the follower's 0.9 counts in `repair_kept` only
        "repair_held_residual": 0.5,
        "repair_kept": "1/2 runs, 1/1 followers (not kept: worse on held-out code); "
        "distilled, epoch 2 of 3; gate kept least squares (held-out loss per domain)",
        "repair_gate": "least squares",
        "repair_held_loss_ratio": 0.9,
    }


def test_the_repair_verdict_without_a_fallback_distillation_or_validation() -> None:
    one = {"residual": 0.3, "held_residual": 0.35, "kept": "distilled"}
    gated = one | {"gate": {"kept": "distilled", "worst_loss_ratio": 1.0, "tried": ["distilled"]}}
    assert repair_validation([gated]) == {
        "repair_held_residual": 0.35,
        "repair_kept": "1/1 runs",
        "repair_gate": "distilled",
        "repair_held_loss_ratio": 1.0,
    }
    unkept = one | {"distilled": {"best_epoch": 0, "epochs": 2}}
    assert repair_validation([unkept])["repair_kept"] == "1/1 runs; distillation not kept"
    unvalidated = {"residual": 0.3}
    assert repair_columns([unvalidated]) == {"repair_residual": 0.3}
    assert repair_columns([FITS[2]]) == {} and repair_columns([]) == {}  # a follower only


def test_a_repaired_row_carries_its_fits_and_their_verdict(spec: JobSpec, plan: ModelPlan) -> None:
    _, repaired = selected(spec, plan, (2, 3))
    row = row_of(spec, plan, repaired, result(repaired, repair=FITS))
    assert (row.repair, row.method_label) == ("linear", "shortgpt+linear")
    assert json.loads(row.repair_fits or "") == FITS
    verdict = repair_columns(FITS)
    assert row.repair_kept == verdict["repair_kept"]
    assert (row.repair_gate, row.repair_held_loss_ratio) == ("least squares", 0.9)
    assert (row.figures["repair_residual"], row.figures["repair_held_residual"]) == (0.4, 0.5)
    assert not {"repair_kept", "repair_gate", "repair_held_loss_ratio"} & set(row.figures)


def test_a_rows_memory_plan_and_sub_layers(spec: JobSpec, plan: ModelPlan) -> None:
    point, _ = selected(spec, plan, (2, 3))
    assert memory_plan(point) is None and sublayer_labels(point) is None
    decision = Decision("evaluate", "streamed", 2**30, 3 * 2**30, 2 * 2**30, batch=8)
    streamed = dataclasses.replace(plan, memory=(("evaluate", decision),))
    planned = dataclasses.replace(point, model=streamed)
    record = json.loads(memory_plan(planned) or "")
    assert record["evaluate"]["mode"] == "streamed" and record["evaluate"]["batch"] == 8
    assert (record["evaluate"]["need_gib"], record["evaluate"]["worker_gib"]) == (1.0, 2.0)
    units = dataclasses.replace(point, granularity="mixed")  # units 2 and 3: attn.1, mlp.1
    assert sublayer_labels(units) == ["attn.1", "mlp.1"]


def test_a_rows_record_goes_into_a_table_with_the_core_columns_typed(
    spec: JobSpec, plan: ModelPlan
) -> None:
    point, repaired = selected(spec, plan, (2, 3))
    rows = [
        row_of(spec, plan, point, result(point, metrics={"ppl_ptb": 31.5})).record(),
        row_of(spec, plan, repaired, result(repaired, repair=FITS)).record(),
    ]
    table = to_table(rows)
    for field in CORE_SCHEMA:
        assert table.schema.field(field.name).type == field.type, field.name
    assert table.schema.field("ppl_ptb").type == pa.float64()
    assert table.schema.field("repair_residual").type == pa.float64()
    assert table.column("pruned_layers").to_pylist() == [[2, 3], [2, 3]]
    assert table.column("ppl_ptb").to_pylist() == [31.5, None]
    assert table.column("repair").to_pylist() == ["none", "linear"]


@pytest.mark.integration
def test_an_expert_cuts_row_counts_its_experts_and_what_a_token_still_reads(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """Qwen3-MoE with 4 experts, top-2, in blocks 1-3: cutting 2 per layer leaves the
    experts a token runs through, so its active parameters and decode bytes are the dense
    model's less the parameters the cut took from the routers only; its weight bytes
    fall by what the cut freed."""
    from lorp.experts.selection import ExpertSelection
    from pipeline.plan.points import ModelGrid
    from tests.helpers.family_models import save_family_ptb

    root = tmp_path_factory.mktemp("moe-rows")
    model = save_family_ptb("qwen3_moe", root / "moe")
    job = tiny_job(root, model, budgets=[1], methods=[{"name": "shortgpt"}])
    spec = parse_spec(job | {"evaluation": EVALUATION, "experts": {"budgets": [2]}})
    (plan,) = plan_models(spec)
    grid = ModelGrid(plan, "key", {"seq_len": 48}, spec.repair_settings, True)
    cut = ExpertSelection("reap", {1: (0, 1), 2: (2, 3), 3: (0, 3)}, 4)
    (alone,) = grid.expert_points(cut, 0, [])
    dense = grid.dense()
    assert dense is not None
    facts = model_facts(PROFILE, None, plan.path, plan.calibration)
    shape = facts.shape
    assert shape is not None and shape.experts == (0, 4, 4, 4) and shape.top_k == 2
    freed = 3 * 2 * shape.expert_params
    router_rows = 3 * 2 * shape.hidden
    n = shape.n_blocks
    ctx = RowContext("run", None, "transformers")
    rows = [
        catalog_row(
            p, PointResult(p.key, list(range(n)), params, 10**6), facts, job_columns(spec), ctx
        )
        for p, params in ((dense, 10**6), (alone, 10**6 - freed - router_rows))
    ]
    d, c = rows[0], rows[1]
    assert (d.experts, d.expert_budget, d.expert_method, d.granularity) == (4, 0, None, None)
    assert (c.experts, c.expert_budget, c.expert_method, c.granularity) == (2, 2, "reap", "experts")
    assert json.loads(c.experts_removed or "") == {"1": [0, 1], "2": [2, 3], "3": [0, 3]}
    assert d.figures["active_params"] - c.figures["active_params"] == router_rows
    assert d.figures["weight_bytes"] - c.figures["weight_bytes"] == (freed + router_rows) * 4
    assert d.figures["decode_bytes_per_token"] - c.figures["decode_bytes_per_token"] == (
        router_rows * 4
    )
    assert c.figures["predicted_decode_speedup"] == pytest.approx(
        d.figures["decode_bytes_per_token"] / c.figures["decode_bytes_per_token"]
    )
