"""What planning reads of a checkpoint's model (`pipeline.plan.reads`): built on the meta
device once per content, then read back from lorp's cache; a changed config or changed
tensor headers are read anew, never served stale."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import pipeline.plan.reads as reads
from lorp.models.disk_names import model_of
from lorp.models.loading import load_config
from lorp.models.memory import weight_size
from lorp.models.safetensors_index import tensor_index
from pipeline.plan.reads import READS, build_read, read_model
from tests.helpers.tiny_models import save_tiny, tiny_model


@pytest.fixture
def builds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Every model the reads build, in a private lorp cache."""
    monkeypatch.setenv("LORP_CACHE", str(tmp_path / "cache"))
    seen: list[Path] = []
    real = reads.build_read

    def counted(path: Path, trust_remote_code: bool = False) -> reads.ModelRead:
        seen.append(path)
        return real(path, trust_remote_code)

    monkeypatch.setattr(reads, "build_read", counted)
    return seen


def test_a_checkpoint_is_built_once_and_read_back_equal(tmp_path: Path, builds: list[Path]) -> None:
    model = save_tiny("llama", tmp_path / "m")
    first = read_model(model)
    assert read_model(model) == first and builds == [model]
    assert len(list((tmp_path / "cache" / READS).glob("*.json"))) == 1
    # The same content elsewhere (another clone's copy) is the same read.
    assert read_model(save_tiny("llama", tmp_path / "copy")) == first and len(builds) == 1


def test_the_cached_unit_peaks_are_those_of_the_model_on_the_meta_device(
    tmp_path: Path, builds: list[Path]
) -> None:
    """The streamed unit's bytes `plan_memory` takes from the read, for every load dtype,
    equal `weight_size` with the model built (as the plan computed them before)."""
    from tests.helpers.family_models import family_model

    model = tmp_path / "moe"
    family_model("qwen3_moe").save_pretrained(model)  # experts stored one tensor each
    read = read_model(model)
    built = model_of(load_config(model))
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        size = weight_size(tensor_index(model), dtype, None, built)
        assert read.unit_peak(dtype.itemsize) == size.largest_unit
    assert read.unit_peak(4) == 98_304 + 65_536  # a bank and its experts' tensors
    assert read.n_experts == 4


def test_a_changed_config_or_header_is_read_anew(tmp_path: Path, builds: list[Path]) -> None:
    model = save_tiny("llama", tmp_path / "m")
    read_model(model)
    saved = (model / "config.json").read_bytes()
    config = json.loads(saved)
    (model / "config.json").write_text(json.dumps(config | {"tie_word_embeddings": True}))
    assert read_model(model).tied and len(builds) == 2
    # Other weights of the same shapes: the same read, served from the cache.
    tiny_model("llama", seed=1).save_pretrained(model, safe_serialization=True)
    (model / "config.json").write_bytes(saved)
    read_model(model)
    assert len(builds) == 2
    # The tensors stored in another dtype change the headers: read anew.
    tiny_model("llama", dtype=torch.bfloat16).save_pretrained(model, safe_serialization=True)
    (model / "config.json").write_bytes(saved)
    read_model(model)
    assert len(builds) == 3


def test_a_damaged_cache_file_is_read_again(tmp_path: Path, builds: list[Path]) -> None:
    model = save_tiny("llama", tmp_path / "m")
    first = read_model(model)
    (memo,) = (tmp_path / "cache" / READS).glob("*.json")
    memo.write_text('{"family": ')  # a half-written file from elsewhere
    assert read_model(model) == first and len(builds) == 2
    assert json.loads(memo.read_text())["family"] == first.family


def test_a_family_lorp_cannot_take_is_refused_each_time_and_not_cached(
    tmp_path: Path, builds: list[Path]
) -> None:
    model = save_tiny("llama", tmp_path / "m")
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(config | {"model_type": "bart"}))
    for _ in range(2):
        with pytest.raises(ValueError, match="cannot be pruned by lorp: it is an encoder-"):
            read_model(model)
    assert len(builds) == 2 and not (tmp_path / "cache" / READS).exists()


def test_the_key_changes_with_the_code(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another lorp (an edited reader, another transformers) is another key."""
    model = save_tiny("llama", tmp_path / "m")
    key = reads.read_key(model, False)
    monkeypatch.setattr(reads, "code_digest", lambda: "another")
    assert reads.read_key(model, False) not in (key, None)
    assert reads.read_key(model, True) != reads.read_key(model, False)


def test_build_read_is_what_read_model_caches(tmp_path: Path, builds: list[Path]) -> None:
    model = save_tiny("llama", tmp_path / "m")
    assert read_model(model) == build_read(model)
