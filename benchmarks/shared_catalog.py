"""The organisation's shared catalog (a Delta Lake table) under many jobs at once.

    python benchmarks/shared_catalog.py [--writers 7] [--changes 200] [--kill 0]
        [--pace 1.0 0.05] [--location DIR|URI] [--read-rows 3200 100000]
        [--json out.json] [--page out.md]

`--writers` processes, each one job as `lorp run` is (its own catalog, its run id, a
background publisher: `pipeline.catalog.shared.JobPublisher`), hand `--changes`
changes each to one shared catalog: a row put, then figures added to it, as points end.
Writers 0 and 1 share a job name with different storages (two teams' `nightly`). The
last `--kill` writers are killed with SIGKILL midway. Reader processes read the table
without pause throughout. Each writer logs every change it handed over; afterwards the
table is checked against the logs:

- every surviving writer's rows are there exactly once, each with its last logged value;
- a killed writer's rows are a subset of its log, each once, with a value it logged;
- no reader ever failed, none saw a run's row count drop.

Reported: publish_ms_p50 / p95 (a change handed over -> the commit that published it),
commits and changes per commit, conflicts retried, read_s for the table at its end and for
`--read-rows` synthetic rows, and the table's size before and after maintenance
(compaction, checkpoint, vacuum). `--page` writes the docs' results page.

Absolute times are this machine's disk (or moto's S3) and its cores shared by every
process: the figures say whether a change reaches the table within a second with seven
jobs committing at once, and whether a read stays a fraction of a second at fleet size.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.pages import rule  # noqa: E402
from pipeline.catalog.shared import JobPublisher, SharedCatalog  # noqa: E402
from pipeline.catalog.table import Catalog  # noqa: E402

NIGHTLY = "nightly"


def row(job: str, i: int) -> dict[str, Any]:
    return {
        "grid_key": f"{job}-{i:05d}",
        "job": job,
        "model": f"m{i // 24:03d}",
        "method_label": ["lorp", "shortgpt", "streamline"][i % 3],
        "budget": 1 + i // 3 % 8,
        "created_at": f"2026-12-01T00:{i // 60 % 60:02d}:{i % 60:02d}",
        "ppl_ptb": 10.0 + i,
        "pruned_layers": [1, 2, 3],
        "protocol": "ptb2048-00000000",
    }


def job_name(index: int) -> str:
    return NIGHTLY if index < 2 else f"team-{index:02d}"


def writer(location: str, index: int, changes: int, pace: float, log: str, out: Any) -> None:
    """One job: `changes` changes (a put, then updates of that row), each logged after it
    was handed over; its latencies and commit count are put on `out` at its end."""
    job, run_id = job_name(index), f"run-{index:02d}"
    notes: list[str] = []
    with tempfile.TemporaryDirectory() as tmp, open(log, "a") as logged:
        box: list[Catalog] = []
        publisher = JobPublisher(
            SharedCatalog(location),
            job,
            f"/storage/{index}",
            run_id,
            lambda: box[0].rows,
            notes.append,
        )
        box.append(Catalog(Path(tmp) / Catalog.NAME, publish=publisher, job=job))
        publisher.open()
        box[0].compact()
        for i in range(changes):
            key = f"{job}-{i // 3:05d}"
            if i % 3 == 0:
                box[0].put(row(job, i // 3))
            else:
                box[0].update(key, {"speedup": float(i)})
            logged.write(json.dumps([run_id, key, box[0].by_key()[key].get("speedup")]) + "\n")
            logged.flush()
            time.sleep(pace)  # points end apart; a change is one small hand-over
        box[0].compact()
        publisher.close(retention_hours=168, maintenance_hours=1e9)
    out.put(
        {
            "index": index,
            "latencies": publisher.latencies,
            "commits": publisher.published,
            "conflicts": publisher.shared.table.conflicts,
            "commit_s": publisher.commit_seconds,
            "notes": notes,
        }
    )


def reader(location: str, stop: Any, out: Any) -> None:
    shared, reads, failures, drops, last = SharedCatalog(location), 0, [], 0, {}
    while not stop.is_set():
        try:
            rows = shared.read()
        except Exception as exc:  # noqa: BLE001 (counted: a reader must never fail)
            failures.append(str(exc)[:200])
            continue
        reads += 1
        counts: dict[str, int] = {}
        for r in rows:
            counts[r["run_id"]] = counts.get(r["run_id"], 0) + 1
        drops += sum(counts.get(k, 0) < v for k, v in last.items())
        last = counts
        time.sleep(0.25)  # dashboards and `lorp catalog ls` reading again and again
    out.put({"reads": reads, "failures": failures, "drops": drops})


def check(rows: list[dict[str, Any]], logs: dict[int, Path], killed: set[int]) -> dict[str, int]:
    """The table against every writer's log (the module docstring)."""
    got: dict[str, list[tuple[str, Any]]] = {}
    for r in rows:
        got.setdefault(r["run_id"], []).append((r["grid_key"], r.get("speedup")))
    lost = doubled = wrong = 0
    for index, log in logs.items():
        entries = [json.loads(line) for line in log.read_text().splitlines() if line.endswith("]")]
        final = {key: value for _, key, value in entries}
        seen = {(key, value) for _, key, value in entries}
        mine = got.get(f"run-{index:02d}", [])
        keys = [k for k, _ in mine]
        doubled += len(keys) - len(set(keys))
        if index in killed:
            wrong += sum((k, v) not in seen for k, v in mine)
        else:
            lost += len(set(final) - set(keys))
            wrong += sum(final.get(k, "missing") != v for k, v in mine)
    return {"rows_lost": lost, "rows_doubled": doubled, "rows_wrong": wrong}


def collect(results: Any, procs: list[Any], n: int) -> list[Any]:
    """`n` results from the queue `results`; fails, instead of waiting for ever, once one
    of `procs` has died without putting its own."""
    out: list[Any] = []
    while len(out) < n:
        try:
            out.append(results.get(timeout=1))
        except queue.Empty:
            if dead := [p for p in procs if p.exitcode not in (None, 0)]:
                for p in procs:
                    p.kill()
                raise RuntimeError(f"{dead[0].name} exited with code {dead[0].exitcode}") from None
    return out


def run(
    location: str, writers: int, changes: int, kill: int, work: Path, pace: float = 0.05
) -> dict[str, Any]:
    """The writers and two readers on `location`; the checked result."""
    work.mkdir(parents=True, exist_ok=True)
    cpu_before = _children_cpu()
    logs = {i: work / f"writer-{i}.log" for i in range(writers)}
    doomed = set(range(writers - kill, writers))  # the last ones: never a `nightly` pair's
    got, read, wall = _jobs(location, changes, pace, logs, doomed)
    rows = SharedCatalog(location).read()
    latencies = sorted(t for g in got for t in g["latencies"])
    commits = sum(g["commits"] for g in got)
    commit_s = sorted(t for g in got for t in g["commit_s"])
    return {
        "writers": writers,
        "changes_per_writer": changes,
        "killed": kill,
        "pace_s": pace,
        "wall_s": round(wall, 2),
        "publish_ms_p50": round(1000 * statistics.median(latencies), 1),
        "publish_ms_p95": round(1000 * latencies[int(0.95 * (len(latencies) - 1))], 1),
        "publish_ms_max": round(1000 * latencies[-1], 1),
        "commits": commits,
        "commit_ms_p50": round(1000 * statistics.median(commit_s), 1),
        "commit_ms_p95": round(1000 * commit_s[int(0.95 * (len(commit_s) - 1))], 1),
        "conflicts_retried": sum(g["conflicts"] for g in got),
        "changes_per_commit": round(len(latencies) / max(commits, 1), 2),
        "cpu_ms_per_change": round(
            1000 * (_children_cpu() - cpu_before) / max(len(latencies), 1), 1
        ),
        "reads": sum(r["reads"] for r in read),
        "reader_failures": [f for r in read for f in r["failures"]],
        "reader_drops": sum(r["drops"] for r in read),
        "rows": len(rows),
        "run_ids": len({r["run_id"] for r in rows}),
        "nightly_run_ids": len({r["run_id"] for r in rows if r["job"] == NIGHTLY}),
        "notes": sorted({n for g in got for n in g["notes"]}),
        **check(rows, logs, doomed),
    }


def _jobs(
    location: str, changes: int, pace: float, logs: dict[int, Path], doomed: set[int]
) -> tuple[list[Any], list[Any], float]:
    """A writer process per log and two readers; the `doomed` writers killed midway.
    The surviving writers' results, the readers', and the wall time of the writers."""
    ctx = mp.get_context("spawn")
    results, read_q, stop = ctx.Queue(), ctx.Queue(), ctx.Event()
    readers = [ctx.Process(target=reader, args=(location, stop, read_q)) for _ in range(2)]
    procs = [
        ctx.Process(
            target=writer,
            args=(location, i, changes, pace, str(log), results),
            name=f"writer-{i}",
        )
        for i, log in logs.items()
    ]
    start = time.perf_counter()
    for p in [*readers, *procs]:
        p.start()
    try:
        for i in sorted(doomed):  # midway: half its changes logged
            _kill_midway(procs[i], logs[i], changes)
        alive = [p for i, p in enumerate(procs) if i not in doomed]
        got = collect(results, alive, len(procs) - len(doomed))
        for p in procs:
            p.join(timeout=120)
        wall = time.perf_counter() - start
        stop.set()
        read = [read_q.get(timeout=120) for _ in readers]
    finally:  # a failed writer stops the rest
        stop.set()
        for p in [*procs, *readers]:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return got, read, wall


def _kill_midway(proc: Any, log: Path, changes: int) -> None:
    """SIGKILL to the writer `proc` once half its changes are logged."""
    while not log.exists() or len(log.read_text().splitlines()) < changes // 2:
        if proc.exitcode is not None:
            raise RuntimeError(f"{proc.name} exited with code {proc.exitcode}")
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGKILL)


def _children_cpu() -> float:
    """CPU seconds of every finished child process (the writers and the readers)."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def read_at(n_rows: int, work: Path) -> dict[str, Any]:
    """A table of `n_rows` synthetic rows (one commit per 400, as 8 jobs' nights would
    leave it): read time before and after maintenance, and its size."""
    location = str(work / f"synthetic-{n_rows}")
    shared = SharedCatalog(location)
    for start in range(0, n_rows, 400):
        batch = [row(f"team-{i // 400:03d}", i) for i in range(start, min(start + 400, n_rows))]
        shared.publish(f"run-{start // 400:04d}", batch)
    before = shared.table.size_bytes(), _timed(shared.read)
    shared.table.maintain(retention_hours=0)
    after = shared.table.size_bytes(), _timed(shared.read)
    return {
        "rows": n_rows,
        "commits": shared.table.version(),
        "read_s": before[1],
        "bytes": before[0],
        "read_s_maintained": after[1],
        "bytes_maintained": after[0],
    }


def _timed(fn: Any) -> float:
    fn()  # warm: imports, page cache
    t0 = time.perf_counter()
    fn()
    return round(time.perf_counter() - t0, 4)


PAGE = """# Shared catalog: seven jobs on one Delta table

Written by `python benchmarks/shared_catalog.py {args}` on this machine (2 cores, local
disk); rerun it to refresh this page. {writers} writer processes (jobs), {changes} changes
each, {killed} killed with SIGKILL midway, two readers reading throughout; once per pace
(the seconds between two changes of one job).

{table}

A change no longer waits for its write: a point hands it over and returns; the job's
publisher commits what came meanwhile as one MERGE, so the per-change figure is the time
to the commit that carried it, conflicts with the other writers retried included. The
old format's figure was the time of one small file write in the point's own thread.

Every process here shares the same 2 cores. A change costs about {cpu} ms of CPU in all
(two delta-rs MERGEs: the job's own catalog, itself a Delta table, commits it first in
the point's thread, then the publisher commits it to the shared table; the readers'
share included), so two cores carry about {capacity} changes a second. At a pace of
{fast} s seven jobs offer {offered_fast} a second: the cores are saturated and the
figures measure the queue for them, not the table. At {slow} s they offer
{offered_slow} a second, still about 35 times what a night of the fleet lorp is built
for (30 checkpoints, about 60 points each, three changes a point, over eight hours:
0.2 a second), and a change reaches the table within the figures of the first column.
On a cluster each job's driver has its own machine.

Each job writes its own partition (`run_id=`) and compacts it every 25 commits, so jobs
conflict only when a commit adds a column to the schema, or with a maintenance or a
migration; the retried conflicts above are of those kinds (each job's first `speedup`
adds a column).

The synthetic tables are written one commit per job (400 rows each), so maintenance has
nothing to compact there; a real night leaves a file per commit in each job's partition,
which the job's end compacts once `catalog_maintenance_hours` have passed.
"""

ROWS = [
    (
        "publish p50, a change handed over -> committed",
        "{publish_ms_p50} ms",
        "9-12 ms (a part written)",
    ),
    ("publish p95", "{publish_ms_p95} ms", "21-27 ms"),
    ("one commit (a batch), p50 / p95", "{commit_ms_p50} / {commit_ms_p95} ms", "-"),
    ("conflicts retried", "{conflicts_retried}", "-"),
    ("changes per commit", "{changes_per_commit}", "1"),
    ("CPU per change, all processes", "{cpu_ms_per_change} ms", "-"),
    ("rows lost / doubled / wrong", "{rows_lost} / {rows_doubled} / {rows_wrong}", "0 / 0 / -"),
    ("reader failures / row-count drops", "{failures} / {reader_drops}", "0 / 0"),
]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--writers", type=int, default=7)
    p.add_argument("--changes", type=int, default=200)
    p.add_argument("--kill", type=int, default=0)
    p.add_argument(
        "--pace",
        type=float,
        nargs="+",
        default=[1.0, 0.05],
        help="seconds between a job's changes; one run per pace",
    )
    p.add_argument("--location", default=None, help="default: a temporary directory")
    p.add_argument("--read-rows", type=int, nargs="*", default=[3200, 100_000])
    p.add_argument("--json", default=None)
    p.add_argument("--page", default=None)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="lorp-shared-") as tmp:
        work = Path(tmp)
        runs = []
        for i, pace in enumerate(args.pace):
            where = args.location or str(work / f"catalog-{i}")
            if args.location and i:
                where = f"{args.location.rstrip('/')}-{i}"
            runs.append(run(where, args.writers, args.changes, args.kill, work / f"{i}", pace))
        result = {**runs[0], "also": runs[1:]}
        result["read"] = [read_at(n, work) for n in args.read_rows]
    print(json.dumps(result, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    if args.page:
        write_page(args, result)
    for x in runs:
        if x["rows_lost"] or x["rows_doubled"] or x["rows_wrong"]:
            return 1
        if x["reader_failures"] or x["reader_drops"]:
            return 1
    return 0


def write_page(args: argparse.Namespace, r: dict[str, Any]) -> None:
    runs = [r, *r.get("also", [])]
    reads = {x["rows"]: x for x in r["read"]}
    head = " | ".join(f"pace {x['pace_s']} s" for x in runs)
    lines = [
        f"| figure | {head} | before (parquet snapshots + parts) |",
        rule(len(runs) + 2, tight=True),
    ]
    for name, cell, before in ROWS:
        cells = " | ".join(cell.format(**x, failures=len(x["reader_failures"])) for x in runs)
        lines.append(f"| {name} | {cells} | {before} |")
    blank = " |" * (len(runs) - 1)  # the read figures are the same tables for every pace
    for n, before in ((3200, "0.05 s (fold)"), (100_000, "not measured")):
        if n in reads:
            x = reads[n]
            read = f"{x['read_s']} s ({x['read_s_maintained']} s after maintenance)"
            lines.append(f"| read {n:,} rows | {read} |{blank} {before} |")
    if 100_000 in reads:
        x = reads[100_000]
        size = f"{x['bytes'] / 1e6:.2f} MB before, {x['bytes_maintained'] / 1e6:.2f} MB after"
        lines.append(f"| table size, 100,000 rows | {size} maintenance |{blank} - |")
    cpu = statistics.median(x["cpu_ms_per_change"] for x in runs)
    fast, slow = min(x["pace_s"] for x in runs), max(x["pace_s"] for x in runs)
    shown = " ".join(sys.argv[1:]).split(" --page")[0].split(" --json")[0]
    Path(args.page).write_text(
        PAGE.format(
            args=shown,
            writers=r["writers"],
            changes=r["changes_per_writer"],
            killed=r["killed"],
            table="\n".join(lines),
            cpu=round(cpu),
            capacity=round(2000 / cpu),
            fast=fast,
            slow=slow,
            offered_fast=round(r["writers"] / fast),
            offered_slow=round(r["writers"] / slow),
        )
    )


if __name__ == "__main__":
    sys.exit(main())
