"""Pruning (and repairing) a checkpoint by rewriting its files equals the in-memory surgery,
tensor for tensor and config key for key, across shards and dtypes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from lorp.models.architectures import decoder_blocks
from lorp.models.file_surgery import write_pruned_files
from lorp.repair.capture import capture_repair_stats
from lorp.repair.fit import fit_runs
from lorp.repair.fold import file_folds
from lorp.repair.maps import RepairRefused
from lorp.repair.stats import contiguous_runs
from tests.helpers.model_checks import (
    assert_same_checkpoint,
    config_of,
    full_copy,
    in_memory,
    tensors,
)
from tests.helpers.tiny_models import FAMILIES, N_BLOCKS
from tests.helpers.windows import token_windows


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_file_surgery_equals_in_memory(
    family: str, checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    """Pruned and repaired from the files = pruned and repaired in memory, for a run
    from block 0 (where the embeddings are not tied) and a run inside the stack."""
    path = checkpoints[family]
    tied = family == "gemma3_text"
    layers = [2, 3] if tied else [0, 1, 3, 4]
    dense = in_memory(path)
    stats = capture_repair_stats(
        dense, [token_windows(8)], contiguous_runs(layers, N_BLOCKS), progress=False
    )
    fits = fit_runs(dense, stats)
    provenance = {"pruned": layers}
    written = write_pruned_files(
        path, tmp_path / "files", layers, provenance, changes=file_folds(fits)
    )
    saved = full_copy(dense, fits, layers, tmp_path / "memory", provenance)
    assert_same_checkpoint(saved, written)
    b = tensors(written)
    assert config_of(written)["num_hidden_layers"] == N_BLOCKS - len(layers)
    # The fold did change block s-1's down_proj (block 2 is the pruned model's block 0
    # when blocks 0, 1, 3, 4 go; block 1 stays block 1 when 2, 3 go).
    before, after = (1, 1) if tied else (2, 0)
    down = "model.layers.{}.mlp.down_proj.weight"
    assert not torch.equal(tensors(path)[down.format(before)], b[down.format(after)])
    reloaded = AutoModelForCausalLM.from_pretrained(str(written), dtype=torch.float32)
    assert len(decoder_blocks(reloaded)) == N_BLOCKS - len(layers)


def test_file_surgery_refuses_a_fold_into_tied_embeddings(
    checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    path = checkpoints["gemma3_text"]
    dense = in_memory(path)
    stats = capture_repair_stats(dense, [token_windows(8)], [(0, 1)], progress=False)
    fits = fit_runs(dense, stats)
    with pytest.raises(RepairRefused, match="tied embeddings"):
        write_pruned_files(path, tmp_path / "x", [0, 1], {}, changes=file_folds(fits))
    assert not (tmp_path / "x").exists()


def test_file_surgery_shards_and_dtype(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    """A checkpoint in several shards keeps its shards (and an index naming them); with
    a dtype, every floating tensor is written in it."""
    path = checkpoints["qwen2"]
    model = in_memory(path)
    sharded = tmp_path / "sharded"
    model.save_pretrained(sharded, max_shard_size="200KB")
    assert len(list(sharded.glob("*.safetensors"))) > 1
    out = write_pruned_files(sharded, tmp_path / "out", [2], {}, dtype=torch.bfloat16)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    got = tensors(out)
    assert set(index["weight_map"]) == set(got)
    assert {t.dtype for t in got.values()} == {torch.bfloat16}
    want = tensors(path)
    assert torch.equal(
        got["model.layers.2.mlp.up_proj.weight"],
        want["model.layers.3.mlp.up_proj.weight"].bfloat16(),
    )
    assert config_of(out)["dtype"] == "bfloat16"
