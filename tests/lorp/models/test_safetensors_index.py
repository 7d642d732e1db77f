"""A checkpoint's tensors as its headers list them: only the files the checkpoint names, a
file without a header refused, block keys split at the block's own index."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from lorp.models.disk_names import DiskLayout
from lorp.models.file_surgery import renamed, write_pruned_files
from lorp.models.perplexity import perplexity
from lorp.models.safetensors_index import read_header, split_block_key, tensor_index
from lorp.models.streaming import build_streamed
from tests.helpers.model_checks import in_memory
from tests.helpers.windows import token_windows


def test_header_reader_refuses_a_non_safetensors_file(tmp_path: Path) -> None:
    bad = tmp_path / "x.safetensors"
    bad.write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00nope!")
    with pytest.raises(ValueError, match="no readable safetensors header"):
        read_header(bad)


def test_only_the_checkpoints_own_files_are_read(
    checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    """A repository may ship another format's weights beside the shards (Mistral's
    `consolidated.safetensors`): sizing, streaming and file surgery read only the files
    the checkpoint names."""
    from safetensors.torch import save_file

    copy = tmp_path / "llama"
    shutil.copytree(checkpoints["llama"], copy)
    save_file(
        {"layers.0.attention.wq.weight": torch.ones(4, 4)}, str(copy / "consolidated.safetensors")
    )
    assert "layers.0.attention.wq.weight" not in tensor_index(copy)
    x = token_windows(4)
    assert perplexity(build_streamed(copy), x) == pytest.approx(perplexity(in_memory(copy), x))
    out = write_pruned_files(copy, tmp_path / "out", [1], {})
    assert sorted(p.name for p in out.glob("*.safetensors")) == ["model.safetensors"]


def test_block_keys_split_at_the_blocks_index() -> None:
    assert split_block_key("model.layers.3.sub.layers.1.weight") == (
        "model.layers.",
        3,
        "sub.layers.1.weight",
    )
    assert split_block_key("model.embed_tokens.weight") is None
    layout = DiskLayout("model.layers.", 4)
    assert (
        renamed("model.layers.3.sub.layers.3.w", {3: 0}, layout) == "model.layers.0.sub.layers.3.w"
    )
    # another tower's blocks, and a layer past the decoder's (multi-token prediction), stay
    assert (
        renamed("model.vision_tower.layers.3.w", {3: 0}, layout) == "model.vision_tower.layers.3.w"
    )
    assert layout.split("model.layers.4.w") is None and layout.split("mtp.layers.0.w") is None
