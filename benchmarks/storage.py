"""What a stored variant costs: a manifest (`checkpoints: manifest`) against the full copy
(`checkpoints: full`), in bytes, write time and `lorp pull` time.

    python benchmarks/storage.py --json storage.json --page docs/results/storage.md
    python benchmarks/storage.py --models /tmp/tiny --big none --json s.json   # seconds

For each model (the packaged ones by default, and a random-init Llama checkpoint of
`benchmarks/big_model.py`'s shape, `--big 13b`: about 26 GB, written first and counted as
the base) and a quarter of its blocks removed, three variants:

- unrepaired, the blocks as one run in the middle of the stack;
- repaired, that run with its map folded and one follower map (the job's default,
  `repair_followers: 1`): two rewritten `down_proj` (and, post-norm families, their norm);
- repaired worst case, every removed block a run of its own (every other block from the
  middle; a follower only after the last, the others' next block carrying the next run's
  map): the most tensors a repair at that budget rewrites.

Each is written as a manifest from the base's files (`lorp.models.variant_manifest`: the
fold computed there, as a grid point does), timed; then pulled (written back as a standard
checkpoint, `materialize_variant`), timed, and compared tensor for tensor with the full
copy `lorp.models.file_surgery` writes from the same base (also timed); for a model over
4 GiB (the big checkpoint) only the repaired variant is pulled, no full copy is written and
the worst case is left out (see `COPY_LIMIT`). The maps are an
identity plus noise, not fitted: what is stored depends on which tensors a repair rewrites
and their shapes, never on the values.

The base itself is stored once per model and fingerprint, as a job that writes manifests
stores it (`pipeline.storage.bases`: a packaged model as its GGUF, a directory as its
files): its bytes and time are the one-time cost beside every variant's. A node that never
had the base pulls the repaired variant from that copy: fetched, converted where it is a
GGUF, checked by fingerprint and written out (`first pull`, in a cache of its own; not for
the big checkpoint, whose stored copy is removed once timed: the disk holds the model and
one variant).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # lorp, pipeline and the tests' checkpoint checks

from benchmarks.pages import markers, replace_section, rule  # noqa: E402
from lorp.models.architectures import architecture_of, decoder_blocks  # noqa: E402
from lorp.models.disk_names import model_of  # noqa: E402
from lorp.models.file_surgery import write_pruned_files  # noqa: E402
from lorp.models.fingerprint import fingerprint_checkpoint  # noqa: E402
from lorp.models.loading import load_config, materialize, parse_model_ref, read_config  # noqa: E402
from lorp.models.safetensors_index import tensor_index  # noqa: E402
from lorp.models.variant_manifest import (  # noqa: E402
    BaseRef,
    materialize_variant,
    variant_bytes,
    write_manifest,
)
from lorp.repair.fold import file_folds  # noqa: E402
from lorp.repair.followers import follower_blocks  # noqa: E402
from lorp.repair.maps import RunFit  # noqa: E402
from lorp.repair.stats import contiguous_runs  # noqa: E402
from pipeline.storage.bases import fetch_base, store_base  # noqa: E402
from pipeline.storage.store import Storage  # noqa: E402

MODELS = ("smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b")
BEGIN, END = markers("storage")
COPY_LIMIT = 4 * 2**30
"""Above it (the big checkpoint) no full copy is written and only the repaired variant is
pulled (each is most of the model's size again, on a disk that holds the model already),
and the worst case is left out (each of its maps a d x d by d x MLP product in float64)."""
LIMITS = {"unrepaired": 0.001, "repaired": 0.05}
"""The issue's bounds: a variant's bytes over its model's weights."""


def layouts(n: int, share: float) -> dict[str, tuple[int, ...]]:
    """The removed blocks of each variant: one run in the middle; every other block."""
    k = max(1, round(share * n))
    start = max(1, (n - k) // 2)
    spread = tuple(range(max(1, n // 2 - k), n - 1, 2))[:k]
    return {"one run": tuple(range(start, start + k)), "spread": spread}


def synthetic_fits(layers: tuple[int, ...], n: int, d: int, post_norm: bool) -> list[RunFit]:
    """A map per run and per follower (`follower_blocks`: the kept block after each run,
    unless it carries the next run's map), shaped as fitted ones are: d x d float64,
    identity plus noise."""
    gen = torch.Generator().manual_seed(0)
    runs = contiguous_runs(layers, n)
    runs += [(f + 1, f) for f in follower_blocks(n, layers, 1)]  # a follower's "run"
    fits = []
    for run in runs:
        matrix = torch.eye(d, dtype=torch.float64)
        matrix += 1e-3 * torch.randn(d, d, generator=gen, dtype=torch.float64)
        normed = post_norm and run[0] > 0
        scale = torch.ones(d, dtype=torch.float64) if normed else None
        fits.append(RunFit(run, "normed" if normed else "full", matrix, scale, 0.0, 0.0, 1.0))
    return fits


CASES = [
    ("unrepaired", "one run", False),
    ("repaired", "one run", True),
    ("repaired", "spread", True),
]
"""(kind, layout, repaired) of each variant; the last is left out above `COPY_LIMIT`."""


@dataclass
class Model:
    """A model's checkpoint, as its variants are written from it."""

    name: str
    base: Path
    ref: BaseRef
    n: int
    d: int
    post_norm: bool
    weights: int
    dtype: str

    @property
    def small(self) -> bool:
        """Whether full copies are written and every variant pulled (`COPY_LIMIT`)."""
        return self.weights <= COPY_LIMIT


def measure_model(ref: str, share: float, work: Path) -> dict[str, Any]:
    mref = parse_model_ref(ref)
    base = materialize(mref)
    config = read_config(base)
    n, d = int(config["num_hidden_layers"]), int(config["hidden_size"])
    model = model_of(load_config(base))  # on the meta device: its blocks as lorp reads them
    last = architecture_of(model).layout(decoder_blocks(model)[0]).last_stage
    index = tensor_index(base)
    weights = sum(e.end - e.start for e in index.values())
    dtype = str(next(iter(index.values())).dtype)
    t0 = time.perf_counter()
    fingerprint = fingerprint_checkpoint(base)
    out: dict[str, Any] = {
        "model": ref if mref.kind == "alias" else Path(ref).name,
        "n_blocks": n,
        "hidden": d,
        "weights_bytes": weights,
        "dtype": dtype,
        "fingerprint_s": round(time.perf_counter() - t0, 3),
        "variants": [],
    }
    torch_dtype = {"BF16": "bfloat16", "F16": "float16"}.get(dtype, "float32")
    stored = _store_base(mref, fingerprint, base, work, out)
    post_norm = any(b.post_norm is not None for b in last)
    m = Model(out["model"], base, stored, n, d, post_norm, weights, torch_dtype)
    if not m.small:  # measured; the disk holds the model and one variant, not more
        shutil.rmtree(work.parent / "storage", ignore_errors=True)
    if m.small:  # untimed: the first pull pays for the imports (tokenizers)
        _store_and_pull(base, stored, layouts(n, share)["one run"], None, torch_dtype, work, True)
    for kind, layout, repaired in CASES[: 3 if m.small else 2]:
        row = _variant(m, kind, layout, repaired, layouts(n, share)[layout], work)
        if "first_pull_s" in row:
            out["first_pull_s"] = row["first_pull_s"]
        out["variants"].append(row)
    shutil.rmtree(work.parent / "storage", ignore_errors=True)  # the base's copy: measured
    return out


def _store_base(mref: Any, fingerprint: str, base: Path, work: Path, out: dict) -> BaseRef:
    """The base stored once, as a job that writes manifests stores it (timed, sized, into
    `out`); the reference its variants' manifests hold."""
    t0 = time.perf_counter()
    stored = store_base(Storage(work.parent / "storage"), mref.ref, mref.kind, fingerprint, base)
    assert stored is not None
    out |= {
        "base_stored_bytes": stored.bytes,
        "base_stored_s": round(time.perf_counter() - t0, 3),
        "base_stored_as": "GGUF" if mref.kind in ("alias", "gguf") else "files",
    }
    return BaseRef(mref.ref, mref.kind, fingerprint, None, stored.uri)


def _variant(
    m: Model, kind: str, layout: str, repaired: bool, layers: tuple[int, ...], work: Path
) -> dict[str, Any]:
    """One variant of `m` without `layers` (repaired: with synthetic maps) stored as a
    manifest, pulled, and set against its full copy: its row."""
    fits = synthetic_fits(layers, m.n, m.d, m.post_norm) if repaired else []
    changes = file_folds(fits) if fits else None
    row = {
        "kind": kind,
        "layout": layout,
        "removed": len(layers),
        "runs": len(contiguous_runs(layers, m.n)),
        "maps": len(fits),
    }
    row |= _store_and_pull(
        m.base,
        m.ref,
        layers,
        changes,
        m.dtype,
        work,
        pull=m.small or repaired,
        full=m.small,
        first_pull=(kind, layout) == ("repaired", "one run") and m.small,
    )
    row["share"] = row["manifest_bytes"] / m.weights
    row["within"] = row["share"] <= LIMITS[kind]
    print(
        f"{m.name} {kind} ({layout}, {len(layers)} blocks, {len(fits)} maps): "
        f"{row['manifest_bytes'] / 2**20:.2f} MiB = {100 * row['share']:.4f}% of the "
        f"weights; write {row['manifest_s']:.2f} s, pull {row.get('pull_s', '-')} s, "
        f"full copy {row.get('full_s', '-')} s",
        flush=True,
    )
    return row


def _store_and_pull(
    base: Path,
    ref: BaseRef,
    layers: tuple[int, ...],
    changes: Any,
    dtype: str,
    work: Path,
    pull: bool = True,
    full: bool = True,
    first_pull: bool = False,
) -> dict[str, Any]:
    """The manifest written (timed, sized); with `pull` written back as a checkpoint
    (timed), with `full` the full copy written (timed) and compared tensor for tensor;
    with `first_pull` also written back from the stored base by a node that never had
    it (timed, compared with the other pull)."""
    manifest, pulled, copy = work / "manifest", work / "pulled", work / "full"
    t0 = time.perf_counter()
    write_manifest(base, manifest, ref, layers, {}, changes=changes, dtype=dtype, overwrite=True)
    row: dict[str, Any] = {
        "manifest_bytes": variant_bytes(manifest),
        "manifest_s": round(time.perf_counter() - t0, 3),
    }
    if pull:
        t1 = time.perf_counter()
        materialize_variant(manifest, pulled, base_dir=base, overwrite=True)
        row["pull_s"] = round(time.perf_counter() - t1, 3)
    if pull and first_pull:
        row |= _first_pull(manifest, ref, pulled, work)
    if full:
        t2 = time.perf_counter()
        write_pruned_files(
            base, copy, layers, {}, changes=changes, dtype=getattr(torch, dtype), overwrite=True
        )
        row |= {
            "full_bytes": variant_bytes(copy),
            "full_s": round(time.perf_counter() - t2, 3),
            "pulled_equals_full": same_tensors(pulled, copy),
        }
    for d in (manifest, pulled, copy):
        shutil.rmtree(d, ignore_errors=True)
    return row


def _first_pull(manifest: Path, ref: BaseRef, pulled: Path, work: Path) -> dict[str, Any]:
    """The variant written out on a node whose cache is empty, from the stored base only:
    fetched, converted from its GGUF where it is one, fingerprinted, written out."""
    import os

    node = work / "new-node"
    before = os.environ.get("LORP_CACHE")
    os.environ["LORP_CACHE"] = str(node / "cache")
    try:
        t0 = time.perf_counter()
        assert ref.stored is not None
        local = fetch_base(ref.stored)
        if fingerprint_checkpoint(local) != ref.fingerprint:
            raise SystemExit(f"stored base {ref.stored}: another fingerprint")
        materialize_variant(manifest, node / "pulled", base_dir=local, overwrite=True)
        seconds = round(time.perf_counter() - t0, 3)
        same = same_tensors(node / "pulled", pulled)
    finally:
        if before is None:
            os.environ.pop("LORP_CACHE", None)
        else:
            os.environ["LORP_CACHE"] = before
        shutil.rmtree(node, ignore_errors=True)
    return {"first_pull_s": seconds, "first_pull_same": same}


def same_tensors(a: Path, b: Path) -> bool:
    """The tests' check of two checkpoints: the same tensors bit for bit, the same config."""
    from tests.helpers.model_checks import assert_same_checkpoint

    try:
        assert_same_checkpoint(a, b)
    except AssertionError:
        return False
    return True


def page(results: list[dict[str, Any]], share: float) -> str:
    lines = [
        f"A quarter of the blocks removed ({share:g} of N); maps an identity plus noise (the "
        "bytes depend only on which tensors a repair rewrites). Limits: an unrepaired "
        "variant at most 0.1% of its model's weights, a repaired one at most 5%.",
        "",
        "| model | weights | variant | blocks (runs, maps) | manifest | share | within | "
        "write | full copy | its write | pull | pulled = full |",
        rule(12),
    ]
    for m in results:
        for v in m["variants"]:
            full = f"{_size(v['full_bytes'])} | {v['full_s']:.2f} s" if "full_s" in v else "- | -"
            pull = f"{v['pull_s']:.2f} s" if "pull_s" in v else "-"
            same = {True: "yes", False: "**no**", None: "-"}[v.get("pulled_equals_full")]
            lines.append(
                f"| {m['model']} | {m['weights_bytes'] / 2**30:.2f} GiB {m['dtype']} | "
                f"{v['kind']} ({v['layout']}) | {v['removed']} ({v['runs']}, {v['maps']}) | "
                f"{_size(v['manifest_bytes'])} | {100 * v['share']:.4f}% | "
                f"{'yes' if v['within'] else '**no**'} | {v['manifest_s']:.2f} s | "
                f"{full} | {pull} | {same} |"
            )
    lines += [
        "",
        "Once per model: the base, stored as a job that writes manifests stores it, and the "
        "first pull of the repaired one-run variant on a node that never had the base (from "
        "that copy: fetched, converted, fingerprinted, written out).",
        "",
        "| model | base stored as | bytes | of the weights | stored in | first pull |",
        rule(6),
    ]
    for m in results:
        first = f"{m['first_pull_s']:.1f} s" if "first_pull_s" in m else "-"
        lines.append(
            f"| {m['model']} | {m['base_stored_as']} | {_size(m['base_stored_bytes'])} | "
            f"{100 * m['base_stored_bytes'] / m['weights_bytes']:.1f}% | "
            f"{m['base_stored_s']:.2f} s | {first} |"
        )
    return "\n".join(lines)


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--models",
        nargs="*",
        default=list(MODELS),
        help="packaged aliases or checkpoint directories",
    )
    p.add_argument("--big", default="none", help="big_model.py's shape to add (13b, small) or none")
    p.add_argument("--share", type=float, default=0.25, help="the blocks removed, a share of N")
    p.add_argument("--work", type=Path, help="where the variants and the big checkpoint go")
    p.add_argument("--json", type=Path, required=True)
    p.add_argument("--page", type=Path, help="the results page to write the table into")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    from benchmarks.big_model import SHAPES, write_checkpoint

    args = parse_args(argv)
    work = args.work or Path(tempfile.mkdtemp(prefix="lorp-storage-"))
    models = list(args.models)
    if args.big != "none":
        if args.big not in SHAPES:
            raise SystemExit(f"--big: one of {', '.join(SHAPES)} or none, got {args.big!r}")
        big = work / f"big-{args.big}"
        if not (big / "config.json").is_file():
            write_checkpoint(big, SHAPES[args.big])
        models.append(str(big))
    results = [measure_model(ref, args.share, work / "variant") for ref in models]
    args.json.write_text(json.dumps({"share": args.share, "models": results}, indent=2))
    if args.page is not None:
        replace_section(args.page, BEGIN, END, page(results, args.share), "Measured")
    ok = all(
        v["within"] and v.get("pulled_equals_full", True) and v.get("first_pull_same", True)
        for m in results
        for v in m["variants"]
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
