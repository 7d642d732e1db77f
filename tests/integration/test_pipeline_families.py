"""A job of mixture-of-experts models through `lorp run` on a real local Ray and a real
sqlite MLflow: Qwen3-MoE, Mixtral and DeepSeek-V3, each pruned by depth and repaired
(every routed expert's bank and the shared experts take the map), stored as manifests,
registered, pulled back as standard checkpoints and reloaded in transformers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from pipeline.catalog.table import read_catalog
from pipeline.driver.run import run_job
from pipeline.spec.parse import parse_spec
from pipeline.tracking.registry_loading import load_variant, pull
from tests.helpers.family_models import save_family_ptb
from tests.helpers.job_specs import tiny_job
from tests.helpers.ray_cluster import local_ray

pytestmark = [pytest.mark.integration, pytest.mark.slow]

FAMILIES = {"qwen3_moe": "Qwen3Moe", "mixtral": "Mixtral", "deepseek_v3": "DeepseekV3"}
EVALUATION = {"perplexity": ["ptb"], "seq_len": 48, "max_windows": 2, "speed": False}


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("moe")
    models = [save_family_ptb(f, root / f) for f in FAMILIES]
    spec = tiny_job(root, models[0], "moe", budgets=[1], evaluation=EVALUATION)
    spec |= {
        "models": [{"ref": str(m), "name": m.name} for m in models],
        "methods": [{"name": "shortgpt"}],
        "repair": ["none", "linear"],
        "repair_followers": 0,
        "calibration": spec["calibration"] | {"shards": 1},
    }
    with local_ray(), pytest.MonkeyPatch.context() as mp:
        mp.delenv("MLFLOW_TRACKING_URI", raising=False)
        summary = run_job(parse_spec(spec))
    rows = read_catalog(root / "moe" / "catalog")
    return {"root": root, "summary": summary, "rows": rows}


def test_every_model_is_pruned_repaired_and_recorded(job: dict[str, Any]) -> None:
    summary, rows = job["summary"], job["rows"]
    assert not summary.failed and summary.done == 3 * 3  # dense, pruned, repaired each
    assert {r["model"]: r["family"] for r in rows} == FAMILIES
    for model in FAMILIES:
        mine = {r["method_label"]: r for r in rows if r["model"] == model}
        assert set(mine) == {"dense", "shortgpt", "shortgpt+linear"}
        repaired = mine["shortgpt+linear"]
        assert repaired["pruned_layers"] == mine["shortgpt"]["pruned_layers"]
        kinds = ["attention+moe" for _ in repaired["pruned_layers"]]
        assert repaired["removed_kinds"] == kinds and mine["dense"]["removed_kinds"] is None
        assert {r["experts"] for r in mine.values()} == {4}
        # a token runs through 2 of the 4 experts of each MoE layer: less than every weight
        assert mine["dense"]["active_params"] < mine["dense"]["params"]
        assert repaired["active_params"] < mine["dense"]["active_params"]
        assert repaired["repair_kept"].startswith("1/1 runs") or repaired["repair_gate"]
        assert all(r["model_uri"] for r in mine.values())


def test_a_registered_repaired_variant_pulls_and_reloads(
    job: dict[str, Any], tmp_path: Path
) -> None:
    summary, rows = job["summary"], job["rows"]
    for model in FAMILIES:
        row = next(
            r for r in rows if r["model"] == model and r["method_label"] == "shortgpt+linear"
        )
        out, _ = pull(row["model_uri"], tmp_path / model, tracking_uri=summary.tracking_uri)
        reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
        assert reloaded.config.num_hidden_layers == 3
        variant = load_variant(row["model_uri"], tracking_uri=summary.tracking_uri)
        ids = torch.tensor([[5, 9, 14, 30, 41]])
        with torch.no_grad():
            torch.testing.assert_close(reloaded(ids).logits, variant.model(ids).logits)
