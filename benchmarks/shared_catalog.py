"""The organisation's shared catalog under a night's load: many jobs publishing at once.

    python benchmarks/shared_catalog.py [--jobs 16] [--rows 200] [--json out.json]

`--jobs` processes (each one job, as `lorp run` would be) publish `--rows` rows each into
one shared catalog directory (`pipeline.records.shared_catalog`), every row followed by
two updates (speed, gate), compacting (snapshot replaced, parts deleted) every 50 rows
and at the end, as a job does at its start and end; meanwhile a reader process folds the
whole catalog without pause, as `lorp catalog ls` or the aliases would. Reported:

- publish_ms_p50 / p95   one change (a part) published, as the job's catalog records it
- fold_s_busy            one fold of the catalog while the jobs write (median of the
                         reader's folds that found rows)
- fold_s_final           one fold of the final catalog (jobs x rows rows, parts folded)
- rows_lost, rows_doubled, reader_drops   correctness: always 0 (a drop is a reader that
                         saw a job's row count fall, i.e. read around a compaction)

16 jobs x 200 rows is about one night of the fleet the guide sizes (30 checkpoints x 2-8
budgets x a few methods x 2 repairs, several teams). Absolute times are this machine's
disk and 2 cores shared by every process; the figures say whether a fold stays a
fraction of a second and whether a change stays one small write at that size.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import queue
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipeline.records.catalog import Catalog  # noqa: E402
from pipeline.records.shared_catalog import SharedCatalog  # noqa: E402


def row(job: str, i: int) -> dict[str, Any]:
    return {
        "grid_key": f"{job}-{i:05d}", "job": job, "model": f"m{i // 24:03d}",
        "method_label": ["lorp", "shortgpt", "streamline"][i % 3], "budget": 1 + i // 3 % 8,
        "created_at": f"2026-12-01T00:{i // 60 % 60:02d}:{i % 60:02d}", "ppl_ptb": 10.0 + i,
        "pruned_layers": [1, 2, 3], "protocol": "ptb2048-00000000",
    }  # fmt: skip


def publish(location: str, job: str, rows: int, out: Any) -> None:
    shared = SharedCatalog(location)
    with tempfile.TemporaryDirectory() as tmp:
        cat = Catalog(Path(tmp) / Catalog.NAME, publish=shared, job=job)
        times = []
        for i in range(rows):
            key = f"{job}-{i:05d}"
            for op, arg in (("put", row(job, i)), ("speed", {"speedup": 1.2}),
                            ("gate", {"degraded": False})):  # fmt: skip
                start = time.perf_counter()
                cat.put(arg) if op == "put" else cat.update(key, arg)
                times.append(time.perf_counter() - start)
            if i % 50 == 49:
                cat.compact()
        cat.compact()
    out.put(times)


def read(location: str, jobs: list[str], stop: Any, out: Any) -> None:
    shared = SharedCatalog(location)
    folds, drops, last = [], 0, dict.fromkeys(jobs, 0)
    while not stop.is_set():
        start = time.perf_counter()
        rows = shared.read()
        if rows:  # the folds of an empty catalog (before the first part) say nothing
            folds.append(time.perf_counter() - start)
        for j in jobs:
            n = sum(r["job"] == j for r in rows)
            drops += n < last[j]
            last[j] = n
    out.put((folds, drops))


def collect(results: Any, procs: list[Any], n: int) -> list[Any]:
    """`n` results from the queue `results`; fails, instead of waiting for ever, once one
    of `procs` has died without putting its own."""
    out: list[Any] = []
    while len(out) < n:
        try:
            out.append(results.get(timeout=1))
        except queue.Empty:
            if dead := [p for p in procs if p.exitcode not in (None, 0)]:
                raise RuntimeError(f"{dead[0].name} exited with code {dead[0].exitcode}") from None
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--jobs", type=int, default=16)
    p.add_argument("--rows", type=int, default=200)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    jobs = [f"team-{i:02d}" for i in range(args.jobs)]
    with tempfile.TemporaryDirectory(prefix="lorp-shared-") as tmp:
        location = str(Path(tmp) / "catalog")
        times_q, read_q, stop = mp.Queue(), mp.Queue(), mp.Event()
        reader = mp.Process(target=read, args=(location, jobs, stop, read_q), name="reader")
        writers = [mp.Process(target=publish, args=(location, j, args.rows, times_q), name=j)
                   for j in jobs]  # fmt: skip
        try:
            reader.start()
            start = time.perf_counter()
            for w in writers:
                w.start()
            times = [t for got in collect(times_q, writers, len(writers)) for t in got]
            for w in writers:
                w.join()
            wall = time.perf_counter() - start
            stop.set()
            ((folds, drops),) = collect(read_q, [reader], 1)
            reader.join()
        finally:  # a failed job or reader stops the rest
            stop.set()
            for proc in [*writers, reader]:
                if proc.is_alive():
                    proc.terminate()
                    proc.join()
        SharedCatalog(location).read()  # warm: imports, page cache
        t0 = time.perf_counter()
        rows = SharedCatalog(location).read()
        fold_final = time.perf_counter() - t0
    keys = [(r["job"], r["grid_key"]) for r in rows]
    times.sort()
    result = {
        "jobs": args.jobs,
        "rows_per_job": args.rows,
        "changes": len(times),
        "wall_s": round(wall, 2),
        "publish_ms_p50": round(1000 * statistics.median(times), 3),
        "publish_ms_p95": round(1000 * times[int(0.95 * (len(times) - 1))], 3),
        "fold_s_busy": round(statistics.median(folds), 4) if folds else None,
        "fold_s_busy_max": round(max(folds), 4) if folds else None,
        "reader_folds": len(folds),
        "fold_s_final": round(fold_final, 4),
        "rows": len(rows),
        "rows_lost": args.jobs * args.rows - len(set(keys)),
        "rows_doubled": len(keys) - len(set(keys)),
        "reader_drops": drops,
    }
    print(json.dumps(result, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    ok = not (result["rows_lost"] or result["rows_doubled"] or result["reader_drops"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
