"""A job of mixture-of-experts models through `lorp run` on a real local Ray and a real
sqlite MLflow: Qwen3-MoE, Mixtral, OLMoE, DeepSeek-V3 and gpt-oss, each pruned by depth
(repaired too: every routed expert's bank and the shared experts take the map), by
routed experts (REAP, from the sums captured with S) and by both; stored as manifests,
registered, pulled back as standard checkpoints and reloaded in transformers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from lorp.experts.layers import expert_count_field
from pipeline.catalog.table import read_catalog
from pipeline.driver.run import run_job
from pipeline.spec.parse import parse_spec
from pipeline.tracking.registry_loading import load_variant, pull
from tests.helpers.family_models import save_family_ptb
from tests.helpers.job_specs import tiny_job
from tests.helpers.ray_cluster import local_ray

pytestmark = [pytest.mark.integration, pytest.mark.slow]

FAMILIES = {
    "qwen3_moe": ("Qwen3Moe", {}),
    "mixtral": ("Mixtral", {}),
    "olmoe": ("Olmoe", {}),
    "deepseek_v3": ("DeepseekV3", {"n_routed_experts": 8}),  # 2 groups of 4: 1 from each
    "gpt_oss": ("GptOss", {}),
}
EVALUATION = {"perplexity": ["ptb"], "seq_len": 48, "max_windows": 2, "speed": False}
LABELS = {"dense", "shortgpt", "shortgpt+linear", "reap-experts", "shortgpt&reap-experts"}


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("moe")
    models = [save_family_ptb(f, root / f, **kw) for f, (_, kw) in FAMILIES.items()]
    spec = tiny_job(root, models[0], "moe", budgets=[1], evaluation=EVALUATION)
    spec |= {
        "models": [{"ref": str(m), "name": m.name} for m in models],
        "methods": [{"name": "shortgpt"}],
        "repair": ["none", "linear"],
        "repair_followers": 0,
        "experts": {"budgets": [2], "methods": ["reap"]},
        "calibration": spec["calibration"] | {"shards": 2},
    }
    with local_ray(), pytest.MonkeyPatch.context() as mp:
        mp.delenv("MLFLOW_TRACKING_URI", raising=False)
        summary = run_job(parse_spec(spec))
    rows = read_catalog(root / "moe" / "catalog")
    return {"root": root, "summary": summary, "rows": rows}


def by_label(job: dict[str, Any], model: str) -> dict[str, dict[str, Any]]:
    return {r["method_label"]: r for r in job["rows"] if r["model"] == model}


def test_every_model_is_cut_by_depth_by_experts_and_by_both(job: dict[str, Any]) -> None:
    summary = job["summary"]
    assert not summary.failed and summary.done == len(FAMILIES) * len(LABELS)
    assert {r["model"]: r["family"] for r in job["rows"]} == {
        f: family for f, (family, _) in FAMILIES.items()
    }
    for model in FAMILIES:
        mine = by_label(job, model)
        assert set(mine) == LABELS
        dense, depth, cut, both = (
            mine[k] for k in ("dense", "shortgpt", "reap-experts", "shortgpt&reap-experts")
        )
        n = dense["experts"]
        assert (dense["expert_budget"], dense["expert_method"]) == (0, None)
        assert (cut["experts"], cut["expert_budget"], cut["expert_method"]) == (n - 2, 2, "reap")
        assert (cut["granularity"], cut["budget"], cut["pruned_layers"]) == ("experts", 2, [])
        removed = json.loads(cut["experts_removed"])
        assert all(len(e) == 2 for e in removed.values()) and len(removed) >= 3
        assert both["pruned_layers"] == depth["pruned_layers"] and both["experts"] == n - 2
        assert json.loads(both["experts_removed"]) == removed  # one selection, two points
        # the cut frees 2 experts of every MoE layer; a token still runs through top-k
        assert cut["params"] < dense["params"] and both["params"] < depth["params"]
        freed = dense["params"] - cut["params"]
        assert dense["active_params"] - cut["active_params"] < freed / 10
        assert both["weight_bytes"] < depth["weight_bytes"]
        assert all(r["model_uri"] for r in mine.values())


def test_moe_blocks_are_removed_and_repaired_by_depth(job: dict[str, Any]) -> None:
    for model in FAMILIES:
        mine = by_label(job, model)
        repaired = mine["shortgpt+linear"]
        assert repaired["pruned_layers"] == mine["shortgpt"]["pruned_layers"]
        assert all("moe" in kind for kind in repaired["removed_kinds"])
        assert mine["dense"]["removed_kinds"] is None
        assert repaired["active_params"] < mine["dense"]["active_params"]
        assert repaired["repair_kept"].startswith("1/1 runs") or repaired["repair_gate"]


@pytest.mark.parametrize("label", ["shortgpt+linear", "reap-experts", "shortgpt&reap-experts"])
def test_registered_variants_pull_and_reload(
    job: dict[str, Any], label: str, tmp_path: Path
) -> None:
    tracking = job["summary"].tracking_uri
    ids = torch.tensor([[5, 9, 14, 30, 41]])
    for model in FAMILIES:
        row = by_label(job, model)[label]
        out, _ = pull(row["model_uri"], tmp_path / model, tracking_uri=tracking)
        reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
        config = reloaded.config.get_text_config()
        assert config.num_hidden_layers == 4 - len(row["pruned_layers"])
        assert getattr(config, expert_count_field(config)) == row["experts"]
        variant = load_variant(row["model_uri"], tracking_uri=tracking)
        with torch.no_grad():
            torch.testing.assert_close(reloaded(ids).logits, variant.model(ids).logits)


def test_the_expert_cut_is_a_best_alias_of_its_own(job: dict[str, Any], tmp_path: Path) -> None:
    """`best-experts-2` ranks expert cuts alone, `best-block-e2-1` the rows that removed a
    block and 2 experts: neither competes with `best-1`, the depth cuts'."""
    tracking = job["summary"].tracking_uri
    model = "qwen3_moe"
    mine = by_label(job, model)
    for alias, label in (
        ("best-experts-2", "reap-experts"),
        ("best-block-e2-1", "shortgpt&reap-experts"),
    ):
        variant = load_variant(f"models:/lorp-{model}@{alias}", tracking_uri=tracking)
        assert variant.model.config.num_experts == mine[label]["experts"]
