"""Granularity as a grid dimension: one sub-layer capture on Ray serves block, attention and
MLP points; sub-layer points are repaired from unit sums, stored as manifests that write
out as Nemotron-NAS checkpoints, catalogued with their granularity and sub-layers, costed
by what they keep, timed, and registered under their own aliases; on a real local Ray and
sqlite MLflow."""

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
from lorp.models.variant_manifest import materialize_variant, read_manifest
from lorp.repair.sublayer_repair import unit_stats
from lorp.scoring.window_scores import window_losses
from pipeline.catalog.table import read_catalog
from pipeline.driver.run import run_job
from pipeline.spec.parse import parse_spec
from pipeline.stages.calibration import read_shard
from tests.helpers.job_specs import tiny_job
from tests.helpers.tiny_models import save_tiny_ptb

pytestmark = [pytest.mark.integration]


def test_sublayer_points_run_on_ray_and_are_recorded_by_value(
    ray_cluster: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    model = save_tiny_ptb("llama", tmp_path / "llama")
    spec = tiny_job(
        tmp_path,
        model,
        "units",
        budgets=[2],
        methods=[{"name": "shortgpt"}],
        granularity=["block", "attention", "mlp"],
        repair=["none", "linear"],
        evaluation={
            "perplexity": ["ptb"],
            "seq_len": 48,
            "max_windows": 2,
            "speed": True,
            "speed_budget_s": 4,
        },
        ray={"num_cpus": 2},
    )
    summary = run_job(parse_spec(spec))
    assert summary.done == 7 and not summary.failed and summary.captured == 1
    run_dir = tmp_path / "units"
    rows = {r["method_label"]: r for r in read_catalog(run_dir / "catalog")}
    assert sorted(rows) == sorted(
        ["dense"] + [f"shortgpt{g}{r}" for g in ("", "-attention", "-mlp") for r in ("", "+linear")]
    )

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

    # Stored as a sub-layer manifest (the job's default `checkpoints: manifest`): written
    # out from its base, the Nemotron-NAS checkpoint loads in transformers (its own code)
    # and gives the in-memory variant's logits; its provenance names the sub-layers.
    ckpt = Path(row["checkpoint"])
    assert read_manifest(ckpt)["sublayers"] == row["sublayers"]
    written = materialize_variant(ckpt, tmp_path / "written")  # the base as the job named it
    assert (
        json.loads((written / "lorp_pruning.json").read_text())["granularity_units"]
        == (row["sublayers"])
    )
    served = AutoModelForCausalLM.from_pretrained(written, trust_remote_code=True).eval()
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


def test_sublayer_sleb_scores_unit_sets_on_the_loss_actors(
    ray_cluster: None, tmp_path: Path
) -> None:
    """SLEB and FinerCut at mixed granularity ask the loss actors about candidate sets of
    sub-layer units: each row removes what the greedy elimination over the held-out loss
    (FinerCut: the JS divergence from the dense outputs) of the same windows, run in this
    process, removes; blocks and units, and the two measures, keep separate memos, and a
    rerun selects from the cache. The repair-aware window at mixed granularity scores
    runs of units by their repaired variants' held-out loss on a worker."""
    from lorp.scoring.removal_loss import LossEvaluator
    from pipeline.events.log import EventLog
    from pipeline.stages.calibration import heldout_windows
    from tests.helpers.progress_lines import progress_lines

    model = save_tiny_ptb("llama", tmp_path / "llama")
    spec = parse_spec(
        tiny_job(
            tmp_path,
            model,
            "sleb",
            budgets=[2],
            methods=[
                {"name": "sleb"},
                {"name": "finercut"},
                {"name": "window", "label": "window-loss", "options": {"score": "loss"}},
            ],
            granularity=["block", "mixed"],
            ray={"num_cpus": 2},
        )
    )
    with progress_lines() as lines:
        summary = run_job(spec)
    assert summary.done == 6 and not summary.failed  # dense is not a point
    rows = {r["method_label"]: r for r in read_catalog(tmp_path / "sleb" / "catalog")}
    mixed, block = rows["sleb-mixed"], rows["sleb"]
    assert mixed["n_evals"] == 8 + 7  # N=6: the 8 units of blocks 1..4, then the 7 left
    assert any(" sleb-mixed-b2 step 2: 7 candidates scored" in x for x in lines), lines
    assert any("tiny sleb-mixed-b2: 2 sub-layers removed" in x for x in lines), lines

    dense = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(model)
    held = torch.from_numpy(heldout_windows(tok, spec.calibration, spec.domains).windows)
    units = LossEvaluator(dense, held, units=True)
    S = capture_stats(dense, held.split(2), sublayers=True, progress=False).similarity()
    want = select_units(S, 2, "mixed", "sleb", losses=units)
    assert [parse_unit_label(u) for u in mixed["sublayers"]] == list(want.layers)
    assert mixed["granularity"] == "mixed" and mixed["pruned_layers"] == []
    blocks = select_units(S, 2, "block", "sleb", losses=units).details["blocks"]
    assert block["pruned_layers"] == blocks and block["n_evals"] == 4 + 3
    js = LossEvaluator(dense, held, units=True, measure="js")
    want = select_units(S, 2, "mixed", "finercut", losses=js)
    got = rows["finercut-mixed"]
    assert [parse_unit_label(u) for u in got["sublayers"]] == list(want.layers)
    assert got["n_evals"] == 8 + 7
    # The actors measured JS, not the loss: the cached selection's step values are the
    # in-process evaluator's divergences (a loss would be about ln 512 here).
    cached = [json.loads(f.read_text()) for f in tmp_path.rglob("selections/*.json")]
    (fc,) = [c for c in cached if c["method"] == "finercut" and c["details"].get("granularity")]
    assert fc["details"]["picked_loss"] == pytest.approx(want.details["picked_loss"], rel=1e-4)
    assert max(fc["details"]["picked_loss"]) < 0.69  # a JS divergence is at most ln 2
    blocks = select_units(S, 2, "block", "finercut", losses=js).details["blocks"]
    assert rows["finercut"]["pruned_layers"] == blocks

    # The window of consecutive units whose repaired variant has the lowest held-out
    # loss, each candidate's score the loss of that variant built here from unit sums of
    # the job's own calibration shards (validated on the held-out windows).
    shards = sorted((tmp_path / "sleb" / "calibration").rglob("*.parquet"))
    fit = torch.cat([read_shard(p) for p in shards]).split(2)
    skip = int(resolve_bos(tok, "auto") is not None)
    runs = [(s, s + 1) for s in range(2, 9)]  # attn.1 .. mlp.4, two at a time
    sums = unit_stats(dense, runs, fit, {"": held.split(2)}, skip_prefix=skip)
    here = window_losses(dense, sums, held, ridge=spec.ridge_value, units=True)
    window = rows["window-loss-mixed"]  # its checkpoint's provenance holds the scores
    provenance = json.loads((Path(window["checkpoint"]) / "lorp_pruning.json").read_text())
    got = {parse_unit_label(u): v for u, v in provenance["details"]["window_loss"].items()}
    assert got == pytest.approx({s: here[(s, e)] for s, e in runs}, rel=1e-4)
    start = min(got, key=lambda u: (got[u], u))
    assert [parse_unit_label(u) for u in window["sublayers"]] == [start, start + 1]
    assert len(set(got.values())) == len(runs)  # the candidates differ: the pick means something

    events = EventLog(tmp_path / "sleb" / "events.jsonl").read()
    scored = sum(e["evaluated"] for e in events if e["event"] == "losses")
    assert scored == 2 * (15 + 7)  # no two of the four memos share an entry
    again = run_job(spec)
    assert again.skipped == 6
    events = EventLog(tmp_path / "sleb" / "events.jsonl").read()
    assert sum(e["evaluated"] for e in events if e["event"] == "losses") == scored
