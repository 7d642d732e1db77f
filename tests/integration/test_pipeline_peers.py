"""The four peer recipes as job entries: each selection made (Prune&Comp's on the model,
in a Ray task), its own repair fitted in the point's task on the calibration windows,
and the variant stored as what it changes, on a real local Ray and sqlite MLflow."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from lorp.models.variant_manifest import CHANGES_FILE, materialize_variant
from pipeline.catalog.table import read_catalog
from pipeline.driver.run import run_job
from pipeline.spec.parse import parse_spec
from tests.helpers.job_specs import tiny_job
from tests.helpers.ray_cluster import local_ray
from tests.helpers.tiny_models import save_tiny_ptb

pytestmark = [pytest.mark.integration]

PEERS = {
    "replaceme+cosine-map": {"name": "replaceme", "repair_options": {"epochs": 1}},
    "linear-patch+hadamard-patch": {"name": "linear-patch"},
    "prune-comp+magnitude-comp": {"name": "prune-comp"},
    "streamline-layer+replacement-ffn": {
        "name": "streamline-layer",
        "repair_options": {"epochs": 2, "lr": 1e-3},
    },
}


def test_the_four_peer_entries_run_through_a_job(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    model = save_tiny_ptb("llama", tmp_path / "llama")
    spec = tiny_job(
        tmp_path,
        model,
        "peers",
        budgets=[2],
        methods=list(PEERS.values()),
        repair=["none", "linear"],  # a peer takes its own repair whatever the job's
        evaluation={"perplexity": ["ptb"], "seq_len": 48, "max_windows": 2, "speed": False},
        ray={"num_cpus": 2},
        checkpoints="manifest",
    )
    with local_ray():
        summary = run_job(parse_spec(spec))
    assert summary.done == 5 and not summary.failed and not summary.refused
    rows = {r["method_label"]: r for r in read_catalog(tmp_path / "peers" / "catalog")}
    assert sorted(rows) == sorted(["dense", *PEERS])
    for label, row in rows.items():
        if label == "dense":
            continue
        assert row["repair"] == label.partition("+")[2] and len(row["pruned_layers"]) == 2
        assert row["ppl_ptb"] > 0 and _fit(row)["repair"] == row["repair"]
    steps = _fit(rows["prune-comp+magnitude-comp"])["steps"]
    assert sorted(s["block"] for s in steps) == rows["prune-comp+magnitude-comp"]["pruned_layers"]
    ffn = rows["streamline-layer+replacement-ffn"]
    assert len(ffn["kept_layers"]) == 6 - 2 + 1  # the run's last block carries the FFN
    _check_stored(tmp_path, ffn, rows["replaceme+cosine-map"])


def _fit(row: dict) -> dict:
    return json.loads(row["repair_fits"])[0]


def _check_stored(tmp_path: Path, ffn: dict, replaceme: dict) -> None:
    """The FFN variant reloads with Llama's own class, its carrier's attention zeroed;
    ReplaceMe's stores block i's down_proj and nothing else."""
    written = materialize_variant(ffn["checkpoint"], tmp_path / "ffn")
    loaded = AutoModelForCausalLM.from_pretrained(written)
    assert type(loaded).__name__ == "LlamaForCausalLM" and len(loaded.model.layers) == 5
    carrier = _fit(ffn)["carrier"]
    at = ffn["kept_layers"].index(carrier)
    assert torch.count_nonzero(loaded.model.layers[at].self_attn.o_proj.weight) == 0
    i = replaceme["pruned_layers"][0] - 1
    changed = load_file(str(Path(replaceme["checkpoint"]) / CHANGES_FILE))
    assert sorted(changed) == [f"model.layers.{i}.mlp.down_proj.weight"]
