"""A pruned variant stored as what it changes: a manifest naming its base checkpoint (by
reference and content fingerprint) and the blocks it drops, beside a small safetensors file
of the tensors its repair rewrote (the folded `down_proj`, norm or embedding of each run).

Removing blocks only drops and renumbers tensors the base already holds, so an unrepaired
variant is a few hundred bytes and a repaired one a few tensors (SmolLM2-135M: 3.5 MB a run
against 540 MB for the whole model). `materialize_variant` writes the standard checkpoint
back, tensor by tensor from the base's files (`lorp.models.file_surgery`), tensor-identical
to the full copy `lorp.models.surgery.save_pruned` writes from the model in memory.

A variant directory holds `lorp_variant.json`, `lorp_changes.safetensors` and the
provenance file (`lorp_pruning.json`) every pruned checkpoint carries.

A sub-layer variant (attention or MLP units removed, `lorp.models.sublayers`) has a
manifest of its own format, `lorp-sublayer-variant/1` (an older lorp refuses it in one
line rather than read it as a block variant of no blocks): the units it removes and the
output projections its repair folded (SmolLM2-135M in float32: an `o_proj` is 1.3 MB, a
`down_proj` 3.5 MB, against 540 MB). It is written out as the Nemotron-NAS checkpoint
vLLM serves, from the base's files (`lorp.models.nemotron_nas.write_sublayer_files`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch

from lorp.atomic import atomic_dir
from lorp.models.file_surgery import FileChanges, write_pruned_files
from lorp.models.surgery import PROVENANCE_FILE

MANIFEST_FILE = "lorp_variant.json"
CHANGES_FILE = "lorp_changes.safetensors"
FORMAT = "lorp-variant/1"
UNIT_FORMAT = "lorp-sublayer-variant/1"


@dataclass(frozen=True)
class BaseRef:
    """Where a variant's base checkpoint comes from, as any node resolves it
    (`lorp.models.loading.materialize`), and the content it must have."""

    ref: str
    kind: str
    fingerprint: str
    revision: str | None = None
    stored: str | None = None
    """Where the job stored a copy of the base that every node that pulls reaches (a
    storage URI, `pipeline.storage.bases`); None for a hub id pinned to `revision`."""


def is_manifest(path: str | os.PathLike[str]) -> bool:
    """Whether `path` is a variant directory (a manifest), not a standard checkpoint."""
    return (Path(path) / MANIFEST_FILE).is_file()


def write_manifest(
    base_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    base: BaseRef,
    layers: Iterable[int],
    provenance: Mapping[str, Any],
    *,
    changes: FileChanges | None = None,
    dtype: str = "float32",
    overwrite: bool = False,
    experts: Mapping[int, Sequence[int]] | None = None,
) -> Path:
    """Write the variant of `base_dir` (the local copy of `base`) without blocks `layers`,
    with the tensors `changes` rewrites (a repair's fold, `lorp.repair.fold.file_folds`)
    computed from the base's tensors in `dtype`, to `out_dir`, atomically. `experts`:
    block -> routed experts removed (`lorp.experts.files`): the tensors it slices (every
    MoE layer's router, and banks the files keep fused) are stored cut; per-expert
    tensors are only renamed, so they stay the base's."""

    from lorp.models.loading import parse_dtype

    pruned = sorted(int(b) for b in layers)
    changed = _changed_tensors(Path(base_dir), changes, parse_dtype(dtype), experts, pruned)
    doc = {
        "format": FORMAT,
        "base": asdict(base),
        "pruned": pruned,
        "dtype": dtype,
        "changed": sorted(changed),
    }
    if experts:
        doc["experts"] = {str(b): sorted(int(e) for e in v) for b, v in sorted(experts.items())}
    return _write_variant_dir(out_dir, doc, changed, provenance, overwrite)


def write_unit_manifest(
    out_dir: str | os.PathLike[str],
    base: BaseRef,
    units: Iterable[int],
    provenance: Mapping[str, Any],
    *,
    changed: Mapping[str, torch.Tensor] | None = None,
    dtype: str = "float32",
    overwrite: bool = False,
) -> Path:
    """A sub-layer variant of `base` without `units` (module docstring), whose repair
    rewrote `changed` (checkpoint key -> its folded tensor, in memory:
    `lorp.repair.sublayer_repair.folded_parameters`), stored in `dtype`, atomically."""

    from lorp.models.loading import parse_dtype
    from lorp.models.sublayers import unit_label

    wanted = sorted(int(u) for u in units)
    cast = parse_dtype(dtype)
    tensors = {k: v.detach().to(cast).contiguous().cpu() for k, v in (changed or {}).items()}
    doc = {
        "format": UNIT_FORMAT,
        "base": asdict(base),
        "units": wanted,
        "sublayers": [unit_label(u) for u in wanted],
        "dtype": dtype,
        "changed": sorted(tensors),
    }
    return _write_variant_dir(out_dir, doc, tensors, provenance, overwrite)


def _write_variant_dir(
    out_dir: str | os.PathLike[str],
    doc: Mapping[str, Any],
    tensors: Mapping[str, torch.Tensor],
    provenance: Mapping[str, Any],
    overwrite: bool,
) -> Path:
    """A variant directory (manifest, changed tensors, provenance), atomically."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    if out.exists() and not overwrite:
        raise FileExistsError(f"output directory already exists: {str(out)!r}")
    with atomic_dir(out, overwrite=overwrite) as tmp:
        save_file(dict(tensors), str(tmp / CHANGES_FILE), metadata={"format": "pt"})
        (tmp / PROVENANCE_FILE).write_text(json.dumps(dict(provenance), indent=2, sort_keys=True))
        (tmp / MANIFEST_FILE).write_text(json.dumps(doc, indent=2))
    return out


def _changed_tensors(
    base_dir: Path,
    changes: FileChanges | None,
    dtype: torch.dtype,
    experts: Mapping[int, Sequence[int]] | None = None,
    pruned: Sequence[int] = (),
) -> dict[str, torch.Tensor]:
    """Each rewritten tensor by its key in the base, computed as the file surgery would:
    folded by `changes`, and cut where an expert cut slices it (in the blocks kept)."""
    if changes is None and not experts:
        return {}
    from safetensors import safe_open
    from transformers import AutoConfig

    from lorp.models.architectures import tied_embeddings
    from lorp.models.disk_names import disk_layout, model_of
    from lorp.models.safetensors_index import tensor_index

    model = model_of(AutoConfig.from_pretrained(str(base_dir)))
    index = tensor_index(base_dir)
    tied = tied_embeddings(model) and "lm_head.weight" not in index
    fns = dict(changes(index, model, tied)) if changes is not None else {}
    if experts:
        from lorp.experts.files import expert_files

        cut, layout = expert_files(model, index, experts), disk_layout(model)
        for key in cut.slices:
            if layout.block_of(key) not in pruned:
                fold = fns.get(key, lambda t: t)
                fns[key] = lambda t, fold=fold, key=key: cut.cut(key)(fold(t))
    out = {}
    for key, fn in fns.items():
        with safe_open(str(index[key].file), framework="pt") as f:
            t = f.get_tensor(key)
        if t.is_floating_point():
            t = t.to(dtype)
        out[key] = fn(t).contiguous()
    return out


def read_manifest(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The manifest of variant directory `path`, refused in one line if it is not one."""
    file = Path(path) / MANIFEST_FILE
    try:
        doc = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{str(file)!r} is not a lorp variant manifest ({exc})") from None
    if doc.get("format") not in (FORMAT, UNIT_FORMAT):
        raise ValueError(
            f"{str(file)!r}: format {doc.get('format')!r}, expected {FORMAT!r} or {UNIT_FORMAT!r}"
        )
    return doc


def base_ref(doc: Mapping[str, Any]) -> BaseRef:
    """A manifest's base; fields a newer lorp added are left out (the format's version
    changes when one must be understood)."""
    known = {f.name for f in fields(BaseRef)}
    return BaseRef(**{k: v for k, v in doc["base"].items() if k in known})


def resolve_base(base: BaseRef, fetch: Callable[[str], Path] | None = None) -> Path:
    """The base's local directory on this node, refused in one line naming the base unless
    its content is the fingerprint the manifest names. Tried in turn: the reference as the
    job resolved it (converted or downloaded here if needed: nothing fetched where this node
    has it), then the stored copy, through `fetch` (its URI -> a local directory)."""
    from lorp.models.fingerprint import fingerprint_checkpoint
    from lorp.models.loading import ModelRef, materialize

    routes: list[tuple[str, Callable[[], Path]]] = [
        ("as named", lambda: materialize(ModelRef(base.ref, base.kind), revision=base.revision))  # type: ignore[arg-type]
    ]
    if base.stored and fetch is not None:
        routes.append((f"stored at {base.stored}", lambda: fetch(base.stored)))  # type: ignore[arg-type]
    tried = []
    for how, get in routes:
        try:
            local = get()
            have = fingerprint_checkpoint(local)
        except Exception as exc:  # noqa: BLE001 (whatever fails, the next route is tried)
            tried.append(f"{how}: {(str(exc).splitlines() or [type(exc).__name__])[0]}")
            continue
        if have == base.fingerprint:
            return local
        tried.append(f"{how}: {str(local)!r} has fingerprint {have[:12]}")
    raise ValueError(
        f"base {base.ref!r} of the variant is not available or changed (the variant was made "
        f"from fingerprint {base.fingerprint[:12]}): " + "; ".join(tried)
    )


def materialize_variant(
    path: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    base_dir: str | os.PathLike[str] | None = None,
    fetch: Callable[[str], Path] | None = None,
    overwrite: bool = False,
) -> Path:
    """Write variant `path` as a standard checkpoint to `out_dir` (safetensors, config,
    tokenizer, provenance), streamed tensor by tensor from its base: `base_dir` when the
    caller has it (trusted), else the base the manifest names, resolved and checked
    (`resolve_base`; `fetch` reaches its stored copy)."""
    from safetensors.torch import load_file

    from lorp.models.loading import parse_dtype

    doc = read_manifest(path)
    base = Path(base_dir) if base_dir is not None else resolve_base(base_ref(doc), fetch)
    stored = load_file(str(Path(path) / CHANGES_FILE))
    provenance = json.loads((Path(path) / PROVENANCE_FILE).read_text())
    if doc["format"] == UNIT_FORMAT:
        from lorp.models.nemotron_nas import write_sublayer_files

        return write_sublayer_files(
            base,
            out_dir,
            doc["units"],
            provenance,
            changed=stored,
            dtype=parse_dtype(doc["dtype"]),
            overwrite=overwrite,
        )
    return write_pruned_files(
        base,
        out_dir,
        doc["pruned"],
        provenance,
        changes=lambda index, arch, tied: {k: (lambda _t, v=v: v) for k, v in stored.items()},
        dtype=parse_dtype(doc["dtype"]),
        overwrite=overwrite,
        experts={int(b): e for b, e in doc.get("experts", {}).items()} or None,
    )


def variant_bytes(path: str | os.PathLike[str]) -> int:
    """What a variant directory (manifest or full checkpoint) takes on disk."""
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())
