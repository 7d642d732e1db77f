"""A checkpoint's tensors as its safetensors headers list them: names, dtypes, shapes and
byte ranges, read from a few kilobytes of each shard without loading a weight; and which
block a tensor belongs to.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

# safetensors dtype names and their sizes in bytes.
DTYPE_BYTES = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
}


FLOATS = {"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"}


DTYPE_NAMES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
"""torch dtypes by their safetensors names (and `TORCH_DTYPES` the other way)."""


TORCH_DTYPES = {name: dtype for dtype, name in DTYPE_NAMES.items()}


_BLOCK_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a checkpoint, as its file's header describes it."""

    key: str
    file: Path
    dtype: str
    shape: tuple[int, ...]
    start: int
    """Absolute byte offset of the data in `file`."""
    end: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def nbytes_as(self, itemsize: int) -> int:
        """Bytes once loaded: floating tensors at the load dtype, others as they are."""
        if self.dtype in FLOATS:
            return self.numel * itemsize
        return self.end - self.start


def read_header(file: Path) -> tuple[dict[str, Any], int]:
    """A safetensors file's header (tensor entries; `__metadata__` dropped) and the byte
    offset where its data starts. Reads the header only."""
    try:
        with open(file, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise ValueError(f"{str(file)!r} is not a safetensors file (shorter than 8 bytes)")
            (n,) = struct.unpack("<Q", raw)
            size = os.fstat(f.fileno()).st_size
            if n > size - 8:
                raise ValueError(
                    f"{str(file)!r} is truncated or not a safetensors file (its header "
                    f"claims {n:,} bytes, the file holds {size:,})"
                )
            header = json.loads(f.read(n))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{str(file)!r} has no readable safetensors header: {exc}") from None
    except OSError as exc:
        raise ValueError(f"{str(file)!r} cannot be read: {exc.strerror or exc}") from None
    if not isinstance(header, dict):
        raise ValueError(f"{str(file)!r} has no readable safetensors header (not an object)")
    header.pop("__metadata__", None)
    return header, 8 + n


def check_weights(path: Path) -> None:
    """One line naming the file when a checkpoint's weights are not whole: a shard its
    index names but the directory lacks, a header that cannot be read, or a file shorter
    than its header says (a copy cut off, a full disk). Reads the headers only."""
    for file in weight_files(path):
        header, base = read_header(file)
        try:
            need = base + max((int(e["data_offsets"][1]) for e in header.values()), default=0)
        except (KeyError, TypeError, ValueError, IndexError):
            raise ValueError(
                f"{str(file)!r} has no readable safetensors header (an entry without data_offsets)"
            ) from None
        have = file.stat().st_size
        if have < need:
            raise ValueError(
                f"{str(file)!r} is truncated: its header lists {need:,} bytes, the file "
                f"holds {have:,}"
            )


def weight_files(path: Path) -> list[Path]:
    """The checkpoint's safetensors files: those its index names, else `model.safetensors`,
    else every one (hub repositories may ship another format's file beside the shards,
    such as Mistral's `consolidated.safetensors`)."""
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / n for n in names]
    if (path / "model.safetensors").is_file():
        return [path / "model.safetensors"]
    return sorted(path.glob("*.safetensors"))


def tensor_index(path: Path) -> dict[str, TensorEntry]:
    """Every tensor of the checkpoint directory `path`, over all its shards."""
    files = weight_files(path)
    if not files:
        raise ValueError(f"model directory {str(path)!r} has no .safetensors weights to size")
    out: dict[str, TensorEntry] = {}
    for file in files:
        header, base = read_header(file)
        for key, e in header.items():
            start, end = e["data_offsets"]
            out[key] = TensorEntry(
                key, file, e["dtype"], tuple(e["shape"]), base + start, base + end
            )
    return out


def block_of(key: str) -> int | None:
    """The block index a tensor belongs to (`...layers.<i>.`), None outside the blocks."""
    m = _BLOCK_KEY.search(key)
    return int(m.group(1)) if m else None


def split_block_key(key: str) -> tuple[str, int, str] | None:
    """(prefix up to `layers.`, block index, the name inside the block), None outside the
    blocks: from the same match as `block_of`, so a name that repeats `layers.<i>.`
    inside a block is split where the block's index is."""
    m = _BLOCK_KEY.search(key)
    if m is None:
        return None
    return key[: m.start(1)], int(m.group(1)), key[m.end() :]
