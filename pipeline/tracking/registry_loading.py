"""Reading a registered version back: `load_variant` loads it as a transformers model and
tokenizer, `pull` (`lorp pull`) copies its checkpoint directory out. A checkpoint in remote
storage is fetched to a local directory first, and refused without its completion marker;
a checkpoint redone since it was registered is refused too. They live here, not in
`lorp/`, because `lorp/` never imports MLflow.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlflow.entities.model_registry import ModelVersion
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from lorp.atomic import atomic_dir
from lorp.models.surgery import PROVENANCE_FILE
from pipeline.storage.store import Storage, is_remote, scratch_dir
from pipeline.tracking.registry import DENSE
from pipeline.tracking.runs import GRID_KEY, redact

URI_FORMS = "models:/<name>/<version> or models:/<name>@<alias>"


def parse_models_uri(uri: str) -> tuple[str, str | None, str | None]:
    """(name, version, alias) of `models:/<name>/<version>` or `models:/<name>@<alias>`."""
    m = re.fullmatch(r"models:/([^/@]+)(?:/(\d+)|@([\w-]+))/?", uri.strip())
    if not m:
        raise ValueError(f"not a model version URI: {uri!r} (expected {URI_FORMS})")
    return m.group(1), m.group(2), m.group(3)


def store_uri(tracking_uri: str | None) -> str:
    """`tracking_uri`, else MLFLOW_TRACKING_URI; never MLflow's default (a new
    ./mlflow.db), which would hide a missing setting behind an empty registry."""
    uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
    if not uri:
        raise ValueError("no tracking URI: pass --tracking-uri or set MLFLOW_TRACKING_URI")
    return uri


def resolve_version(client: MlflowClient, uri: str, store: str) -> ModelVersion:
    """The model version a `models:/` URI names in `store` (an alias resolves to its
    version)."""
    name, version, alias = parse_models_uri(uri)
    try:
        if alias is not None:
            return client.get_model_version_by_alias(name, alias)
        return client.get_model_version(name, version)
    except MlflowException as exc:
        if exc.error_code not in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"):
            raise
        cause = str(exc).splitlines()[0]
        raise ValueError(f"{uri!r} not found in {redact(store)}: {cause}") from None


@contextmanager
def version_files(client: MlflowClient, mv: ModelVersion, store: str) -> Iterator[Path]:
    """The directory holding a version's standard checkpoint: the checkpoint itself for a
    local source (nothing copied), else a temporary copy (from the job's storage, or
    MLflow's artifact store), removed on exit. A variant stored as a manifest is written
    out from its base (as named, else the job's stored copy: `pipeline.storage.bases`),
    checked by fingerprint (`lorp.models.variant_manifest`)."""
    from lorp.models.variant_manifest import is_manifest, materialize_variant
    from pipeline.storage.bases import fetch_base

    with _stored_files(client, mv, store) as path:
        if not is_manifest(path):
            yield path
            return
        with scratch_dir() as tmp:  # $LORP_SCRATCH: a checkpoint's size, not /tmp's
            yield materialize_variant(path, tmp / "checkpoint", fetch=fetch_base)


@contextmanager
def _stored_files(client: MlflowClient, mv: ModelVersion, store: str) -> Iterator[Path]:
    """The directory a version's source names, as stored (fetched when remote)."""
    from mlflow.artifacts import download_artifacts
    from mlflow.utils.file_utils import local_file_uri_to_path

    source = client.get_model_version_download_uri(mv.name, str(mv.version))
    if source.startswith("file:") or os.path.isabs(source):
        path = Path(local_file_uri_to_path(source))
        if not path.is_dir():
            raise FileNotFoundError(f"version {mv.name}/{mv.version}: {str(path)!r} is gone")
        yield path
        return
    if is_remote(source) and Storage(source).complete():  # a checkpoint lorp stored
        with Storage(source).fetched() as path:
            yield path
        return
    with tempfile.TemporaryDirectory(prefix="lorp-pull-") as tmp:
        got = download_artifacts(source, dst_path=tmp, tracking_uri=store)
        yield Path(got)


def check_provenance(path: Path, mv: ModelVersion) -> dict[str, Any] | None:
    """The checkpoint's `lorp_pruning.json`, checked against the version's tags: a
    checkpoint redone since it was registered no longer matches and is refused."""
    file = path / PROVENANCE_FILE
    prov = json.loads(file.read_text()) if file.is_file() else None
    if mv.tags.get("method") == DENSE:  # a base model may be an earlier lorp checkpoint
        return prov
    want = mv.tags.get("pruned_layers")
    have = (prov or {}).get("pruned", [])
    if want is not None and json.loads(want) != have:
        raise ValueError(
            f"{mv.name}/{mv.version}: {str(path)!r} prunes {have}, the version says {want}"
        )
    if prov and mv.tags.get(GRID_KEY) not in (None, prov.get("grid_key")):
        raise ValueError(f"{mv.name}/{mv.version}: {str(path)!r} is another grid point's")
    return prov


@dataclass
class Variant:
    """A registered version, loaded: the transformers model and tokenizer, the version and
    the checkpoint's `lorp_pruning.json` (None for a dense model that has none)."""

    model: Any
    tokenizer: Any
    version: ModelVersion
    provenance: dict[str, Any] | None


def load_variant(uri: str, *, tracking_uri: str | None = None, **kwargs: Any) -> Variant:
    """Load `models:/<name>@best-8` (or `models:/<name>/<version>`) as a transformers model
    and tokenizer; `kwargs` go to `from_pretrained` (dtype, device_map, ...). A version
    the registry marks `trust_remote_code` (a sub-layer variant, whose checkpoint carries
    lorp's own Nemotron-NAS code) loads with it unless `kwargs` say otherwise."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    store = store_uri(tracking_uri)
    client = MlflowClient(tracking_uri=store, registry_uri=store)
    mv = resolve_version(client, uri, store)
    trust = kwargs.setdefault("trust_remote_code", mv.tags.get("trust_remote_code") == "true")
    with version_files(client, mv, store) as path:
        prov = check_provenance(path, mv)
        model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust)
    return Variant(model.eval(), tokenizer, mv, prov)


def pull(
    uri: str,
    out: str | os.PathLike[str],
    *,
    tracking_uri: str | None = None,
    overwrite: bool = False,
) -> tuple[Path, ModelVersion]:
    """Copy the checkpoint directory a version points at into `out`, atomically."""
    out = Path(out)
    if out.exists() and not overwrite:
        raise ValueError(f"--out {str(out)!r} already exists (pass --overwrite to replace it)")
    store = store_uri(tracking_uri)
    client = MlflowClient(tracking_uri=store, registry_uri=store)
    mv = resolve_version(client, uri, store)
    with version_files(client, mv, store) as path:
        check_provenance(path, mv)
        with atomic_dir(out, overwrite=overwrite) as tmp:
            shutil.copytree(path, tmp, dirs_exist_ok=True)
    return out, mv
