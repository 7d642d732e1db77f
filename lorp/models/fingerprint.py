"""Content fingerprints: the same checkpoint under two names, or sharded differently, gets
one fingerprint, so cached similarity statistics are shared; any change of config or
weights gives another.

model fingerprint = sha256 over the canonical config (paths and tool versions removed) and
every tensor (name, dtype, shape, bytes) in name order, across all safetensors shards.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from lorp.atomic import atomic_file
from lorp.cache import cache_root

# Config keys that say where or with what a checkpoint was written, not what it is.
VOLATILE_CONFIG_KEYS = {"_name_or_path", "transformers_version", "torch_dtype", "dtype"}


def canonical_config(config: dict[str, Any]) -> bytes:
    clean = {k: v for k, v in config.items() if k not in VOLATILE_CONFIG_KEYS}
    return json.dumps(clean, sort_keys=True, separators=(",", ":")).encode()


def fingerprint_checkpoint(path: str | os.PathLike[str]) -> str:
    """Fingerprint of a local HF directory; memoised in the lorp cache by file stats, so
    only a changed file is hashed again."""
    path = Path(path)
    files = sorted(path.glob("*.safetensors"))
    stamp = [
        [f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in [path / "config.json", *files]
    ]
    memo = _memo_file(path)
    saved = _read_memo(memo)
    if saved.get("stamp") == stamp:
        return str(saved["fingerprint"])
    digest = _hash_checkpoint(path, files)
    # Atomic: concurrent Ray tasks fingerprint the same model and read each other's memo.
    with atomic_file(memo) as tmp:
        tmp.write_text(
            json.dumps({"path": str(path.resolve()), "stamp": stamp, "fingerprint": digest})
        )
    return digest


def check_readable(path: str | os.PathLike[str]) -> None:
    """What `fingerprint_checkpoint` refuses before it hashes, without hashing: every
    safetensors file of the directory opens (its header whole, its data within the file),
    each failure one line naming the file. `lorp plan` checks this and leaves the hashing,
    seconds a GiB, to the run that needs the fingerprint."""
    for f in sorted(Path(path).glob("*.safetensors")):
        with _opened(f):
            pass


def _hash_checkpoint(path: Path, files: list[Path]) -> str:
    h = hashlib.sha256()
    h.update(canonical_config(json.loads((path / "config.json").read_text())))
    where = {}
    for f in files:
        with _opened(f) as st:
            for key in st.keys():  # noqa: SIM118 (safe_open is not a dict)
                where[key] = f
    for key in sorted(where):
        with _opened(where[key]) as st:
            try:
                tensor = st.get_tensor(key)
            except Exception as exc:  # SafetensorError: the file changed or is cut short
                raise ValueError(f"{str(where[key])!r}: tensor {key!r} unreadable: {exc}") from None
            _update_tensor(h, key, tensor)
    return h.hexdigest()[:32]


@contextmanager
def _opened(file: Path) -> Iterator[Any]:
    """safetensors' reader of `file`; a file it cannot read is one line naming it."""
    from safetensors import safe_open

    try:
        handle = safe_open(str(file), framework="pt")
    except Exception as exc:  # SafetensorError (not an OSError), or an OSError
        raise ValueError(f"{str(file)!r} is not a readable safetensors file: {exc}") from None
    with handle as st:
        yield st


def _update_tensor(h: Any, key: str, tensor: torch.Tensor) -> None:
    h.update(f"{key}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
    h.update(tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())


def _memo_file(path: Path) -> Path:
    key = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:24]
    return cache_root() / "fingerprints" / f"{key}.json"


def _read_memo(memo: Path) -> dict[str, Any]:
    """The memo, or {} when absent or unreadable (then the checkpoint is hashed again)."""
    try:
        return dict(json.loads(memo.read_text()))
    except (OSError, ValueError, TypeError):
        return {}
