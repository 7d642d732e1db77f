"""GGUF checkpoints (the packaged models ship as GGUF) converted once into a Hugging Face
directory in lorp's cache, keyed by the file and `CONVERSION_VERSION`.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

import torch

from lorp.atomic import atomic_dir
from lorp.cache import cache_root
from lorp.models.architectures import architecture_for
from lorp.models.surgery import clear_gguf_quantizer

log = logging.getLogger(__name__)

# Part of the converted directory's cache key: a conversion that writes something new
# (2: the GGUF's add_bos_token kept) is redone rather than served from an older cache.
CONVERSION_VERSION = 2


def convert_gguf(gguf: Path, name: str | None = None) -> Path:
    """Dequantize a GGUF into a cached fp32 safetensors directory (once per file)."""
    stat = gguf.stat()
    source = f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}:v{CONVERSION_VERSION}"
    key = hashlib.sha256(source.encode()).hexdigest()
    out = cache_root() / "models" / f"{name or gguf.stem}-{key[:12]}"
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


def _write_converted(gguf: Path, name: str | None, tmp: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    )
    architecture_for(model.config.model_type)  # refuse unsupported families early
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
