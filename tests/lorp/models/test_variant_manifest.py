"""A variant stored as what it changes materialises into the full copy, tensor for tensor;
its size is what it changes; a base that changed is refused in one line. A sub-layer
variant's manifest materialises into the Nemotron-NAS checkpoint written from memory."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from lorp.models.fingerprint import fingerprint_checkpoint
from lorp.models.variant_manifest import (
    BaseRef,
    is_manifest,
    materialize_variant,
    read_manifest,
    variant_bytes,
    write_manifest,
    write_unit_manifest,
)
from lorp.repair.capture import capture_repair_stats
from lorp.repair.fit import fit_runs
from lorp.repair.fold import file_folds
from lorp.repair.stats import contiguous_runs
from tests.helpers.model_checks import (
    assert_same_checkpoint,
    config_of,
    full_copy,
    in_memory,
)
from tests.helpers.tiny_models import FAMILIES, N_BLOCKS
from tests.helpers.windows import token_windows


def base_ref(path: Path) -> BaseRef:
    return BaseRef(str(path), "dir", fingerprint_checkpoint(path))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_materialised_variant_equals_the_full_copy(
    family: str, checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    """Repaired in memory and saved whole = the manifest written back from its base."""
    path = checkpoints[family]
    layers = [2, 3] if family == "gemma3_text" else [0, 1, 3, 4]
    dense = in_memory(path)
    stats = capture_repair_stats(
        dense, [token_windows(8)], contiguous_runs(layers, N_BLOCKS), progress=False
    )
    fits = fit_runs(dense, stats)
    provenance = {"pruned": layers, "grid_key": "k"}
    variant = write_manifest(
        path, tmp_path / "variant", base_ref(path), layers, provenance, changes=file_folds(fits)
    )
    assert is_manifest(variant) and not is_manifest(path)
    out = materialize_variant(variant, tmp_path / "pulled")  # resolves and checks its base
    full = full_copy(dense, fits, layers, tmp_path / "full", provenance)
    assert_same_checkpoint(full, out)
    assert json.loads((out / "lorp_pruning.json").read_text()) == provenance
    # What it stores: the folded tensors only, a small part of the full copy.
    changed = read_manifest(variant)["changed"]
    assert changed and all(
        k.endswith(("down_proj.weight", "norm.weight", "embed_tokens.weight")) for k in changed
    )
    assert variant_bytes(variant) < variant_bytes(full) / 3


def test_an_unrepaired_variant_is_a_few_kilobytes(
    checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    path = checkpoints["llama"]
    variant = write_manifest(path, tmp_path / "v", base_ref(path), [1, 2], {"pruned": [1, 2]})
    assert read_manifest(variant)["changed"] == []
    assert variant_bytes(variant) < 4096
    out = materialize_variant(variant, tmp_path / "out")
    assert config_of(out)["num_hidden_layers"] == N_BLOCKS - 2
    assert (out / "tokenizer.json").is_file() == (path / "tokenizer.json").is_file()


def test_a_changed_base_is_refused_in_one_line(
    checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    base = tmp_path / "base"
    shutil.copytree(checkpoints["llama"], base)
    variant = write_manifest(base, tmp_path / "v", base_ref(base), [1], {"pruned": [1]})
    config = json.loads((base / "config.json").read_text())
    config["rms_norm_eps"] = 1e-3  # another model under the same path
    (base / "config.json").write_text(json.dumps(config))
    refused = (
        r"base .*base' of the variant is not available or changed .*as named: .* has fingerprint"
    )
    with pytest.raises(ValueError, match=refused) as exc:
        materialize_variant(variant, tmp_path / "out")
    assert "\n" not in str(exc.value)
    assert not (tmp_path / "out").exists()


def test_not_a_manifest_is_refused(tmp_path: Path) -> None:
    (tmp_path / "lorp_variant.json").write_text('{"format": "other/9"}')
    with pytest.raises(ValueError, match="format 'other/9', expected 'lorp-variant/1' or"):
        read_manifest(tmp_path)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_a_sublayer_manifest_materialises_into_the_checkpoint_written_from_memory(
    family: str, checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    """Units removed and repaired in memory, saved whole in Nemotron-NAS form = the
    manifest (the units and the folded output projections) written out from its base's
    files, tensor for tensor; it stores those projections only."""
    import copy

    import torch
    from transformers import AutoModelForCausalLM

    from lorp.models.nemotron_nas import save_sublayer_variant
    from lorp.repair.sublayer_repair import folded_parameters, repair_sublayers
    from tests.helpers.repair_runs import batches
    from tests.helpers.tiny_models import tiny_config

    path = checkpoints["llama"]
    if family == "qwen2":  # Qwen2.5-Coder's form: full attention, q/k/v biases
        config = tiny_config("qwen2")
        config.use_sliding_window, config.layer_types = False, ["full_attention"] * N_BLOCKS
        torch.manual_seed(0)
        path = tmp_path / "qwen2"
        AutoModelForCausalLM.from_config(config).save_pretrained(path, safe_serialization=True)
    units = [4, 7, 8]  # attn.2 (after mlp.1), and mlp.3 + attn.4 (after attn.3)
    variant = copy.deepcopy(in_memory(path))
    fits = repair_sublayers(variant, units, batches(token_windows(8)), ridge=1e-3)
    changed = folded_parameters(variant, fits)
    assert sorted(changed) == [
        "model.layers.1.mlp.down_proj.weight",
        "model.layers.3.self_attn.o_proj.weight",
    ]
    provenance = {"method": "shortgpt", "grid_key": "k"}
    full = save_sublayer_variant(variant, None, tmp_path / "full", units, provenance)
    manifest = write_unit_manifest(
        tmp_path / "m", base_ref(path), units, provenance, changed=changed
    )
    doc = read_manifest(manifest)
    assert doc["format"] == "lorp-sublayer-variant/1" and doc["units"] == units
    assert doc["sublayers"] == ["attn.2", "mlp.3", "attn.4"]
    assert variant_bytes(manifest) < variant_bytes(full) / 3
    out = materialize_variant(manifest, tmp_path / "pulled")  # resolves and checks its base
    assert_same_checkpoint(full, out)
    assert json.loads((out / "lorp_pruning.json").read_text()) == json.loads(
        (full / "lorp_pruning.json").read_text()
    )
    assert (out / "modeling_decilm.py").is_file()
