"""Granularity as a grid dimension: one sub-layer capture on Ray serves block, attention and
MLP points; sub-layer points are repaired from unit sums, stored as Nemotron-NAS
checkpoints, catalogued with their granularity and sub-layers, costed by what they keep,
timed, and registered under their own aliases; on a real local Ray and sqlite MLflow."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from lorp.data.windows import resolve_bos
from lorp.locality.capture import capture_stats
from lorp.methods.sublayer_selection import select_units
from lorp.models.sublayers import parse_unit_label, remove_sublayers
from pipeline.records.catalog import read_catalog
from pipeline.run import run_job
from pipeline.spec.parse import parse_spec
from pipeline.stages.calibration import read_shard
from tests.helpers.job_specs import tiny_job
from tests.helpers.ray_cluster import local_ray
from tests.helpers.tiny_models import save_tiny_ptb

pytestmark = [pytest.mark.integration]


def test_sublayer_points_run_on_ray_and_are_recorded_by_value(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    model = save_tiny_ptb("llama", tmp_path / "llama")
    spec = tiny_job(
        tmp_path, model, "units", budgets=[2],
        methods=[{"name": "shortgpt"}],
        granularity=["block", "attention", "mlp"], repair=["none", "linear"],
        evaluation={"perplexity": ["ptb"], "seq_len": 48, "max_windows": 2, "speed": True,
                    "speed_budget_s": 4},
        ray={"num_cpus": 2},
    )  # fmt: skip
    with local_ray():
        summary = run_job(parse_spec(spec))
    assert summary.done == 7 and not summary.failed and summary.captured == 1
    run_dir = tmp_path / "units"
    rows = {r["method_label"]: r for r in read_catalog(run_dir / "catalog")}
    assert sorted(rows) == sorted(
        ["dense"] + [f"shortgpt{g}{r}" for g in ("", "-attention", "-mlp")
                     for r in ("", "+linear")]
    )  # fmt: skip

    # The selection is the one the sub-layer S of the job's own calibration windows gives.
    config = AutoConfig.from_pretrained(model)
    dense = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    shards = sorted((run_dir / "calibration").rglob("*.parquet"))
    windows = torch.cat([read_shard(p) for p in shards])
    skip = int(resolve_bos(AutoTokenizer.from_pretrained(model), "auto") is not None)
    S = capture_stats(dense, windows.split(2), sublayers=True, skip_prefix=skip, progress=False)
    want = select_units(S.similarity(), 2, "attention", "shortgpt").layers
    row = rows["shortgpt-attention"]
    assert [parse_unit_label(u) for u in row["sublayers"]] == list(want)
    assert row["granularity"] == "attention" and row["pruned_layers"] == []
    assert rows["shortgpt"]["granularity"] == "block" and rows["shortgpt"]["sublayers"] is None
    assert rows["dense"]["granularity"] is None

    # Costs count what each variant keeps: K and V only where attention stays.
    n, kv = config.num_hidden_layers, 2 * config.num_key_value_heads * config.head_dim * 4
    assert rows["dense"]["kv_bytes_per_token"] == n * kv
    assert row["kv_bytes_per_token"] == (n - 2) * kv
    mlp = rows["shortgpt-mlp"]  # every KV cache kept, two MLPs' FLOPs gone
    assert all(u.startswith("mlp.") for u in mlp["sublayers"]) and len(mlp["sublayers"]) == 2
    assert mlp["kv_bytes_per_token"] == n * kv
    assert mlp["prefill_flops_per_token"] < rows["dense"]["prefill_flops_per_token"]
    assert row["decode_bytes_per_token_4k"] < rows["dense"]["decode_bytes_per_token_4k"]
    assert row["params"] < row["params_dense"] == rows["dense"]["params"]

    # The Nemotron-NAS checkpoint loads in transformers (its own code) and gives the
    # in-memory variant's logits; its provenance names the sub-layers.
    ckpt = Path(row["checkpoint"])
    assert (
        json.loads((ckpt / "lorp_pruning.json").read_text())["granularity_units"]
        == (row["sublayers"])
    )
    served = AutoModelForCausalLM.from_pretrained(ckpt, trust_remote_code=True).eval()
    remove_sublayers(dense, want)
    with torch.no_grad():
        ids = windows[:2]
        assert torch.allclose(served(ids).logits, dense(ids).logits, atol=1e-4)
    assert row["ppl_ptb"] > 0 and row["eval_backend"] == "transformers"

    # The repaired twin is repaired from unit sums and judged by the gate; its speed is
    # its own twin's (same shapes), never a block point's; bounds count touched blocks.
    twin = rows["shortgpt-attention+linear"]
    assert twin["repair_kept"].startswith("0/2 runs") or twin["repair_kept"].startswith("2/2")
    assert json.loads(twin["repair_fits"])[0]["run"][0] == want[0]
    for label in ("speedup", "peak_mem_gib"):
        same = (twin.get(label), row.get(label))
        assert same[0] == same[1] or all(v != v for v in same)  # equal, or both unresolved

    # The registry ranks sub-layer budgets apart from block budgets.
    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'mlflow.db'}")
    aliases = client.get_registered_model("lorp-tiny").aliases
    assert {"best-2", "best-attention-2", "best-mlp-2"} <= set(aliases)
    mv = client.get_model_version("lorp-tiny", aliases["best-attention-2"])
    assert mv.tags["granularity"] == "attention" and mv.tags["trust_remote_code"] == "true"
