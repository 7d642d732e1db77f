"""The parquet catalog: one row per grid point, written atomically after every point.

Core columns are typed (`CORE_SCHEMA`); metric columns (`ppl_<corpus>`, `acc_<task>`,
`latency_ms`, ...) are float64 and appear as evaluations add them. `merge_catalogs`
combines many jobs' catalogs into the organisation-wide one, one row per grid key (the
newest wins).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

CORE_SCHEMA = pa.schema(
    [
        ("grid_key", pa.string()),
        ("job", pa.string()),
        ("model", pa.string()),
        ("model_ref", pa.string()),
        ("family", pa.string()),
        ("fingerprint", pa.string()),
        ("n_blocks", pa.int64()),
        ("method", pa.string()),
        ("method_label", pa.string()),
        ("variant", pa.string()),
        ("options", pa.string()),
        ("budget", pa.int64()),
        ("pruned_layers", pa.list_(pa.int64())),
        ("kept_layers", pa.list_(pa.int64())),
        ("stages", pa.string()),
        ("rls", pa.float64()),
        ("k", pa.int64()),
        ("calibration", pa.string()),
        ("stats_file", pa.string()),
        ("params", pa.int64()),
        ("params_dense", pa.int64()),
        ("checkpoint", pa.string()),
        ("eval_backend", pa.string()),
        ("mlflow_run_id", pa.string()),
        ("created_at", pa.string()),
        ("lorp_version", pa.string()),
    ]
)
CORE = set(CORE_SCHEMA.names)


def read_catalog(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    path = Path(path)
    if not path.is_file():
        return []
    return pq.read_table(path).to_pylist()


def to_table(rows: Sequence[Mapping[str, Any]]) -> pa.Table:
    metric_names = sorted({k for r in rows for k in r if k not in CORE})
    fields = list(CORE_SCHEMA) + [pa.field(m, pa.float64()) for m in metric_names]
    schema = pa.schema(fields)
    columns = {f.name: [r.get(f.name) for r in rows] for f in fields}
    return pa.Table.from_pydict(columns, schema=schema)


def write_catalog(path: str | os.PathLike[str], rows: Sequence[Mapping[str, Any]]) -> Path:
    """Write all rows atomically (temporary file, then rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    table = to_table(rows)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        pq.write_table(table, tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def upsert(rows: list[dict[str, Any]], row: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Rows with `row` replacing any row of the same grid key."""
    return [r for r in rows if r["grid_key"] != row["grid_key"]] + [dict(row)]


def merge_catalogs(paths: Iterable[str | os.PathLike[str]]) -> list[dict[str, Any]]:
    """One row per grid key across catalogs; the newest `created_at` wins."""
    best: dict[str, dict[str, Any]] = {}
    for path in paths:
        if not Path(path).is_file():
            raise FileNotFoundError(f"catalog not found: {str(path)!r}")
        try:
            rows = read_catalog(path)
        except pa.ArrowInvalid as exc:
            raise ValueError(f"{str(path)!r} is not a parquet catalog ({exc})") from None
        for row in rows:
            if "grid_key" not in row:
                raise ValueError(f"{str(path)!r} is not a lorp catalog (no grid_key column)")
            current = best.get(row["grid_key"])
            if current is None or row["created_at"] >= current["created_at"]:
                best[row["grid_key"]] = row
    return sorted(best.values(), key=lambda r: (r["model"], r["method_label"], r["budget"]))
