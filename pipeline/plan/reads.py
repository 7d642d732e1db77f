"""What planning reads of a checkpoint's model, built on the meta device from its config,
and kept in lorp's cache by content so that the next plan of the same checkpoint reads a
small JSON file instead.

Building the model on the meta device needs transformers' model classes: importing them
(and what they import: the generation utilities, scikit-learn, SciPy) and building two
models per checkpoint took most of a warm `lorp plan` (measured: 8 of 12 s for
jobs/quality.yaml on 2 shared cores). What the build yields depends on the config, the
safetensors headers (for the streamed units' sizes) and the code that reads them, so the
cache key is a hash of exactly those: `config.json`, any remote code beside it, every
tensor's name, file, dtype, shape and offsets, lorp's and the planner's sources, and the
versions of transformers and torch. A changed checkpoint or a changed reader is read
anew; weights are never read.
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import asdict, dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from lorp.atomic import atomic_file
from lorp.cache import cache_root
from pipeline.plan.grid import FamilyLimits

READS = "plan-reads"
"""The cache folder of the reads (`cache_root() / READS / <key>.json`)."""


@dataclass(frozen=True)
class ModelRead:
    """What planning reads of a checkpoint's model, built on the meta device from its
    config (`lorp.models.architectures.architecture_for`): no weight is read."""

    family: str
    tied: bool
    """Its LM head is its input embeddings (a repair run from block 0 cannot fold)."""
    block_prefix: str
    """Where its files keep its text blocks (`lorp.models.disk_names`)."""
    limits: FamilyLimits = FamilyLimits()
    n_experts: int = 0
    """Routed experts per MoE layer (0: none)."""
    top_k: int = 0
    expert_groups: int = 1
    unit_peaks: tuple[tuple[int, int], ...] = ()
    """(itemsize, bytes) for each load itemsize lorp takes: the most one streamed unit of
    the model holds (`lorp.models.memory.unit_peak`), which needs the model's modules."""

    def unit_peak(self, itemsize: int) -> int:
        return dict(self.unit_peaks)[itemsize]


def read_model(path: Path, trust_remote_code: bool = False) -> ModelRead:
    """The model of checkpoint `path` read from its config, from the cache where this
    content was read before; ValueError (one line) where lorp cannot prune its family,
    naming what is missing (never cached: it is read again, and says so again)."""
    key = read_key(path, trust_remote_code)
    memo = cache_root() / READS / f"{key}.json" if key else None
    saved = _load(memo) if memo else None
    if saved is not None:
        return saved
    read = build_read(path, trust_remote_code)
    if memo is not None:
        # Atomic: two plans (or a plan and a run) of one checkpoint may write it at once.
        with atomic_file(memo) as tmp:
            tmp.write_text(json.dumps(asdict(read)))
    return read


def build_read(path: Path, trust_remote_code: bool = False) -> ModelRead:
    """`read_model` without the cache: the model built on the meta device."""
    from lorp.experts.layers import expert_groups, moe_layers, top_k
    from lorp.models.architectures import architecture_for, tied_embeddings
    from lorp.models.disk_names import disk_layout, model_of
    from lorp.models.loading import DTYPES, load_config
    from lorp.models.memory import unit_peak
    from lorp.models.safetensors_index import tensor_index

    config = load_config(path, trust_remote_code)
    family = architecture_for(config).family
    model = model_of(config)
    prefix = disk_layout(model).block_prefix
    limits = family_limits(config, model)
    layers = moe_layers(model)
    index = tensor_index(path)
    sizes = sorted({d.itemsize for d in DTYPES.values()})
    return ModelRead(
        family,
        tied_embeddings(model),
        prefix,
        limits,
        max((layer.n_experts for layer in layers), default=0),
        top_k(config),
        expert_groups(config),
        tuple((s, unit_peak(model, index, s)) for s in sizes),
    )


def family_limits(config: Any, model: Any) -> FamilyLimits:
    """What the family of `config` (whose model on the meta device is `model`) cannot
    take (`lorp.models.coverage`): one more model built on the meta device, for the cut."""
    from lorp.models.architectures import decoder_blocks
    from lorp.models.coverage import cut_refusals, repair_refusal, split_refusal

    blocks = decoder_blocks(model)
    cut = cut_refusals(config, blocks, [1]).get(1) if len(blocks) > 2 else None
    return FamilyLimits(cut, repair_refusal(model), split_refusal(model))


def read_key(path: Path, trust_remote_code: bool) -> str | None:
    """The cache key of `path`'s read: a hash of what the read depends on (the module
    docstring). None where the checkpoint's files cannot be listed as a read needs them
    (no config, no safetensors): then nothing is cached and the read says what is wrong."""
    from lorp.models.safetensors_index import tensor_index

    try:
        config = (path / "config.json").read_bytes()
        index = tensor_index(path)
    except (OSError, ValueError):
        return None
    h = hashlib.sha256(code_digest().encode())
    h.update(f"|trust={trust_remote_code}|".encode() + config)
    for remote in sorted(path.glob("*.py")):  # trust_remote_code's modules
        h.update(remote.name.encode() + remote.read_bytes())
    entries = [(k, e.file.name, e.dtype, e.shape, e.start, e.end) for k, e in index.items()]
    h.update(json.dumps(sorted(entries)).encode())
    return h.hexdigest()[:32]


@functools.cache
def code_digest() -> str:
    """A hash of the code a read runs: lorp's sources, the planner's, and the versions of
    the libraries that build the model. Once per process (about 10 ms)."""
    import lorp.cache

    files = sorted(Path(lorp.cache.__file__).parent.rglob("*.py"))
    files += sorted(Path(__file__).parent.glob("*.py"))
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode() + f.read_bytes())
    for package in ("transformers", "torch"):
        try:
            h.update(f"{package}={version(package)}".encode())
        except PackageNotFoundError:
            h.update(f"{package}=none".encode())
    return h.hexdigest()


def _load(memo: Path) -> ModelRead | None:
    """The cached read, or None when absent or unreadable (then it is read again)."""
    try:
        saved = json.loads(memo.read_text())
        limits = FamilyLimits(**saved.pop("limits"))
        peaks = tuple((int(s), int(b)) for s, b in saved.pop("unit_peaks"))
        return ModelRead(**saved, limits=limits, unit_peaks=peaks)
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None
