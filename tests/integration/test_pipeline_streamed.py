"""A job whose workers have less memory than the model: the plan streams its capture and
evaluation a module at a time, on a real local Ray and sqlite MLflow, and the figures are the
ones the same job computes with the model held whole, for whole blocks and for attention
sub-layers alike."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient
from transformers import AutoModelForCausalLM

from lorp import SimilarityStats
from lorp.models.shape import ModelShape
from pipeline.catalog.table import read_catalog
from pipeline.driver.run import run_job
from pipeline.events.log import read_events
from pipeline.events.status import format_status, run_status
from pipeline.plan.memory import repair_fit_bytes
from pipeline.plan.models import plan_models
from pipeline.spec.parse import parse_spec
from tests.helpers.job_specs import tiny_job
from tests.helpers.ray_cluster import local_ray
from tests.helpers.tiny_models import save_tiny_ptb
from tests.helpers.worker_memory import EVAL, between

pytestmark = [pytest.mark.integration]


def test_a_model_larger_than_its_workers_runs_streamed(tmp_path: Path) -> None:
    model = save_tiny_ptb("llama", tmp_path / "llama", n_blocks=8)
    common = {
        "budgets": [2],
        "granularity": ["block", "attention"],
        "methods": [{"name": "shortgpt"}],
        "repair": ["none", "linear"],
        "evaluation": EVAL,
        "ray": {"num_cpus": 2},
        "checkpoints": "full",  # both variants loaded as standard checkpoints below
    }
    # Held whole, the job is the reference for the figures; its speed pass is not needed.
    whole = tiny_job(
        tmp_path, model, name="whole", **(common | {"evaluation": EVAL | {"speed": False}})
    )
    parsed = parse_spec(whole)
    cal, ev = parsed.calibration, parsed.evaluation
    shape = ModelShape.from_config(json.loads((model / "config.json").read_text()))
    fit = repair_fit_bytes(
        parsed.repair_settings, plan_models(parsed)[0], shape, 4, distills=parsed.distills
    )
    resources = {
        "capture": {
            "memory_gib": between(
                model, "capture", cal.batch_size, cal.seq_len + 1, states=2 * shape.n_blocks + 1
            )
        },
        "grid": {"memory_gib": between(model, "evaluate", ev.batch_size, ev.seq_len + 1, fit)},
    }
    streamed = tiny_job(tmp_path, model, name="streamed", resources=resources, **common)
    with local_ray():  # one local Ray for both jobs
        assert run_job(parse_spec(streamed)).failed == []
        assert run_job(parse_spec(whole)).failed == []

    def by_variant(job: str) -> dict[tuple[str, str], dict]:
        rows = read_catalog(tmp_path / job / "catalog")
        return {(r["method_label"], r["repair"]): r for r in rows}

    rows, held = by_variant("streamed"), by_variant("whole")
    # dense, and shortgpt without and with its repair, of 2 blocks and of 2 attentions
    assert rows.keys() == held.keys() and len(rows) == 5, rows.keys()
    for key, row in rows.items():
        plan = json.loads(row["memory_plan"])
        assert plan["capture"]["mode"] == plan["evaluate"]["mode"] == "streamed", plan
        assert json.loads(held[key]["memory_plan"])["capture"]["mode"] == "memory"
        assert row["pruned_layers"] == held[key]["pruned_layers"]
        assert row["sublayers"] == held[key]["sublayers"]
        assert row["ppl_ptb"] == pytest.approx(held[key]["ppl_ptb"], rel=1e-4), key
        assert row["speed_skipped"].startswith("not timed: the model is streamed")
        assert row.get("latency_ms") is None
    # lorp status says which stages streamed, and awaits no speed pass; the timeline's
    # spans carry the mode.
    status = "\n".join(format_status(run_status(tmp_path / "streamed")))
    assert "memory       tiny: capture streamed (" in status, status
    assert "evaluate streamed (" in status and "await the speed pass" not in status
    events = read_events(tmp_path / "streamed" / "events.jsonl")
    modes = {(e["stage"], e.get("mode")) for e in events if e["event"] == "span"}
    assert {("capture", "streamed"), ("point", "streamed")} <= modes, modes
    client = MlflowClient(f"sqlite:///{tmp_path / 'streamed' / 'mlflow.db'}")
    tags = client.get_run(rows[("shortgpt", "none")]["mlflow_run_id"]).data.tags
    assert json.loads(tags["memory_plan"])["evaluate"]["mode"] == "streamed"
    # The same S from the streamed capture as from the capture of the model held whole.
    a = SimilarityStats.from_file(next(r["stats_file"] for r in rows.values()))
    b = SimilarityStats.from_file(next(r["stats_file"] for r in held.values()))
    assert a.tokens == b.tokens > 0
    # 1e-6 of the largest sum (576, the diagonal): the streamed capture takes the whole
    # shard per forward, the held one the job's batch, so the fp32 sums round apart.
    assert torch.allclose(a._sum, b._sum, rtol=0, atol=1e-6 * float(b._sum.abs().max()))
    # The repaired variants were written from the files with the fold applied: tensor for
    # tensor what the in-memory surgery of the job held whole wrote (blocks: the model's own
    # form; attention sub-layers: Nemotron-NAS, its o_proj folds among the tensors).
    repaired = [k for k in rows if k[1] == "linear"]
    assert sorted(rows[k]["granularity"] for k in repaired) == ["attention", "block"]
    for key in repaired:
        ours, theirs = Path(rows[key]["checkpoint"]), Path(held[key]["checkpoint"])
        kw = {"dtype": torch.float32, "trust_remote_code": True}
        a_model = AutoModelForCausalLM.from_pretrained(str(ours), **kw)
        b_model = AutoModelForCausalLM.from_pretrained(str(theirs), **kw)
        a_state, b_state = a_model.state_dict(), b_model.state_dict()
        assert a_state.keys() == b_state.keys()
        for name, p in a_state.items():
            assert torch.allclose(p, b_state[name], rtol=0, atol=1e-6), (key, name)
