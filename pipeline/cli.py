"""`lorp run`, `plan`, `status`, `catalog`, `pull` and `gc`: the pipeline's subcommands,
plugged into the `lorp` console script through the `lorp.commands` entry-point group. Heavy
imports (Ray, MLflow) happen inside the commands, so `lorp select` stays fast."""

from __future__ import annotations

import argparse
import logging
import sys


def add_run(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "run",
        help="run a job spec: capture, select, prune, evaluate, record",
        description="Run jobs/*.yaml on the embedded local Ray or the cluster in RAY_ADDRESS.",
    )
    p.add_argument("spec", metavar="JOB.yaml")
    p.add_argument("--force", action="store_true", help="redo grid points already done")
    p.add_argument(
        "--force-speed",
        action="store_true",
        help="time every variant again (the speed pass only; points already done stay)",
    )
    p.add_argument("-q", "--quiet", action="store_true", help="no progress lines")
    p.set_defaults(func=run_command)


def add_plan(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan",
        help="what a job spec would do, without running it; exit 2 when it is refused",
        description="Print the plan of jobs/*.yaml: every model's size and memory decisions, "
        "the grid, what is already done, the last run's stage times, and every problem.",
    )
    p.add_argument("spec", metavar="JOB.yaml")
    p.add_argument("--json", action="store_true", help="the plan as one JSON object")
    p.set_defaults(func=plan_command)


def plan_command(args: argparse.Namespace) -> int:
    """`lorp plan JOB.yaml`: 0 when the job can run, 2 when it is refused."""
    from pipeline.plan.report import plan_job, plan_json, plan_lines
    from pipeline.spec.parse import load_spec

    spec = load_spec(args.spec)
    outline = plan_job(spec)
    if args.json:
        print(plan_json(outline))
    else:
        print("\n".join(plan_lines(outline, spec.resources.max_concurrent_points)))
    return 0 if outline.ok else 2


def talk(quiet: bool) -> None:
    """Progress lines on stderr, one per capture and point, unless --quiet."""
    logger = logging.getLogger("pipeline")
    if quiet or logger.handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


def run_command(args: argparse.Namespace) -> int:
    """`lorp run JOB.yaml`: the job through `pipeline.driver.run.run_job`, its summary printed."""
    from pipeline.driver.run import Stopped, run_job
    from pipeline.events.progress import Progress
    from pipeline.plan.report import plan_job, plan_lines
    from pipeline.spec.parse import load_spec
    from pipeline.tracking.runs import redact

    spec = load_spec(args.spec)
    outline = plan_job(spec)  # the plan first, and nothing runs when it is refused
    if not outline.ok:  # one line per problem, as any bad input gets
        print("\n".join(outline.problems), file=sys.stderr)
        return 2
    if not args.quiet:
        print("\n".join(plan_lines(outline, spec.resources.max_concurrent_points)), file=sys.stderr)
    talk(args.quiet)
    progress = Progress(bar=False if args.quiet else None)
    try:
        summary = run_job(spec, force=args.force, force_speed=args.force_speed, progress=progress)
    except Stopped as stop:
        done = stop.summary
        print(
            f"stopped by {stop.name}: {done}; `lorp run {args.spec}` resumes from here",
            file=sys.stderr,
        )
        leave_if_preparing(stop.exit_code)
        return stop.exit_code
    uri = redact(summary.tracking_uri)
    print(f"catalog      {summary.catalog.resolve()}")
    print(f"mlflow       {uri}")
    print(f"             browse: mlflow ui --host 127.0.0.1 --backend-store-uri {uri}")
    print(f"checkpoints  {summary.checkpoints}")
    if summary.storage:
        print(f"storage      {summary.storage} (the catalog above is its working copy)")
    print(
        f"grid points  {summary.done} done, {summary.skipped} already done, "
        f"{len(summary.failed)} failed; S captured {summary.captured}, from cache {summary.cached}"
    )
    for line in summary.degraded:
        print(f"degraded     {line}")
    for line in summary.refused:
        print(f"not repaired {line}")
    for failure in summary.failed:
        print(f"failed: {failure}", file=sys.stderr)
    code = 1 if summary.failed else 0
    leave_if_preparing(code)  # a failed model's preparation may still be inside Ray
    return code


def leave_if_preparing(code: int) -> None:
    """Exit at once when a model's preparation thread is still inside a Ray call (a stop
    while it waited, e.g. for a node that offers what its capture asks): Ray's exit
    handler would tear its core worker down under that thread, a segmentation fault (rc
    139) instead of `code`. Everything is recorded by then; Ray's own processes end with
    the driver (kernel fate-sharing, or Ray's reaper)."""
    import os
    import threading

    if not any(t.name.startswith("lorp-prepare-") and t.is_alive() for t in threading.enumerate()):
        return
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def add_status(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "status",
        help="how far a job is: points done, failed and left",
        description="Summarise a run directory's job, while it runs or after it ended.",
    )
    p.add_argument("run_dir", metavar="RUN_DIR")
    p.set_defaults(func=status)


def status(args: argparse.Namespace) -> int:
    from pathlib import Path

    from pipeline.events.status import format_status, run_status

    for line in format_status(run_status(Path(args.run_dir))):
        print(line)
    return 0


def add_catalog(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("catalog", help="work with catalogs")
    csub = p.add_subparsers(dest="catalog_command", required=True, parser_class=type(p))
    m = csub.add_parser(
        "merge",
        help="combine catalogs (files, jobs' storages, shared ones) into one parquet file",
    )
    m.add_argument("catalogs", nargs="+", metavar="CATALOG")
    m.add_argument("--out", required=True, metavar="OUT.parquet")
    m.set_defaults(func=merge)
    g = csub.add_parser(
        "migrate",
        help="turn a shared catalog of the format before Delta (jobs/, parts/) into a Delta table",
        description="Its rows take the run id legacy:<job>; each job's next run takes its "
        "own over. The old files stay (no Delta reader reads them); remove them once no "
        "older lorp writes there.",
    )
    g.add_argument("catalog", metavar="CATALOG")
    g.set_defaults(func=catalog_migrate)
    _add_catalog_reads(csub)


def _add_catalog_reads(csub: argparse._SubParsersAction) -> None:
    """`lorp catalog ls` and `lorp catalog best`."""
    ls = csub.add_parser(
        "ls",
        help="the rows of a catalog (a job's or the shared one), folded and filtered",
        description="CATALOG: a job's catalog table or a parquet catalog file, a run "
        "directory, a job's storage, or a shared catalog (directory or URI).",
    )
    ls.add_argument("catalog", metavar="CATALOG")
    for name in ("model", "family", "method", "repair", "protocol", "job"):
        ls.add_argument(f"--{name}", default=None)
    ls.add_argument("--budget", type=int, default=None)
    ls.add_argument(
        "--degraded", choices=("yes", "no"), default=None, help="only degraded rows, or none"
    )
    ls.add_argument("--json", action="store_true", help="one JSON object per row")
    ls.add_argument(
        "--as-of",
        default=None,
        metavar="VERSION|TIME",
        help="a shared catalog as it was: a table version (a number) or a time (ISO 8601)",
    )
    ls.set_defaults(func=catalog_ls)
    b = csub.add_parser(
        "best",
        help="the best non-degraded variant of a model at a budget, within one protocol",
        description="The ranking the registry's aliases use (`best-<budget>` is the "
        "reference protocol's; --protocol names another).",
    )
    b.add_argument("catalog", metavar="CATALOG")
    b.add_argument("--model", required=True)
    b.add_argument("--budget", type=int, required=True)
    b.add_argument("--protocol", default=None, help="default: the model's reference protocol")
    b.add_argument(
        "--granularity",
        default="block",
        choices=("block", "attention", "mlp", "mixed"),
        help="what the budget counts (default: whole blocks)",
    )
    b.add_argument("--json", action="store_true", help="the row as one JSON object")
    b.add_argument(
        "--as-of",
        default=None,
        metavar="VERSION|TIME",
        help="a shared catalog as it was: a table version (a number) or a time (ISO 8601)",
    )
    b.set_defaults(func=catalog_best)


def merge(args: argparse.Namespace) -> int:
    from pipeline.catalog.shared import open_catalog
    from pipeline.catalog.table import merge_catalogs, newest_per_key, write_catalog

    rows = []
    for location in args.catalogs:  # a file as before (its checks), anything else by location
        got = merge_catalogs([location]) if location.endswith(".parquet") else None
        rows += got if got is not None else open_catalog(location)
    rows = newest_per_key(rows)
    write_catalog(args.out, rows)
    print(f"wrote {args.out}: {len(rows)} rows from {len(args.catalogs)} catalogs")
    return 0


def catalog_migrate(args: argparse.Namespace) -> int:
    """`lorp catalog migrate CATALOG`."""
    from pipeline.catalog.shared import SharedCatalog

    shared = SharedCatalog(args.catalog)
    n = shared.migrate()
    version = shared.table.version()
    if version is None:
        raise FileNotFoundError(f"no shared catalog at {shared.uri()!r}: nothing to migrate")
    said = f"{n} row(s) migrated" if n else "already a Delta table: nothing migrated"
    print(f"{shared.uri()}: {said} (table version {version})")
    return 0


LS_COLUMNS = ("job", "run", "model", "method_label", "budget", "protocol", "degraded", "ppl_ratio")
"""`run`: the first 8 digits of the row's `run_id` (two jobs of one name are two runs)."""


def _shown(row: dict, column: str) -> str:
    if column == "run":
        return str(row.get("run_id") or "-")[:8]
    return str(row.get(column))


def _json_line(row: dict) -> str:
    import json
    import math

    def plain(v: object) -> object:
        return None if isinstance(v, float) and not math.isfinite(v) else v

    return json.dumps({k: plain(v) for k, v in row.items()}, default=str, sort_keys=True)


def catalog_ls(args: argparse.Namespace) -> int:
    """`lorp catalog ls CATALOG`: rows, filtered; a table, or JSON lines with --json."""
    from pipeline.catalog.shared import matches, open_catalog

    rows = open_catalog(args.catalog, args.as_of)
    degraded = None if args.degraded is None else args.degraded == "yes"
    want = {k: getattr(args, k) for k in ("model", "family", "method", "repair", "protocol")}
    want |= {"job": args.job, "budget": args.budget, "degraded": degraded}
    rows = [r for r in rows if matches(r, **want)]
    rows.sort(key=lambda r: (r["model"], r["protocol"], r["budget"], r["method_label"], r["job"]))
    if args.json:
        for r in rows:
            print(_json_line(r))
        return 0
    shown = [[_shown(r, c) for c in LS_COLUMNS] for r in rows]
    widths = [max([len(c)] + [len(s[i]) for s in shown]) for i, c in enumerate(LS_COLUMNS)]
    for line in [list(LS_COLUMNS), *shown]:
        print("  ".join(v.ljust(w) for v, w in zip(line, widths, strict=True)).rstrip())
    print(f"{len(rows)} row(s)", file=sys.stderr)
    return 0


def catalog_best(args: argparse.Namespace) -> int:
    """`lorp catalog best CATALOG --model M --budget B [--protocol P]`."""
    from pipeline.catalog import ranking
    from pipeline.catalog.shared import open_catalog

    rows = [r for r in open_catalog(args.catalog, args.as_of) if r["model"] == args.model]
    if not rows:
        raise ValueError(f"--model: {args.model!r} has no rows in {args.catalog}")
    protocol = args.protocol or ranking.reference_protocol(rows)
    known = ranking.protocols(rows)
    if protocol not in known:
        raise ValueError(f"--protocol: {protocol!r} is not one of {args.model}'s: {known}")
    row = ranking.best(rows, args.budget, protocol, args.granularity)
    if row is None:
        units = "" if args.granularity == "block" else f" {args.granularity} sub-layers"
        raise ValueError(
            f"--budget: no non-degraded variant of {args.model} at {args.budget}{units} "
            f"under {protocol}"
        )
    if args.json:
        print(_json_line(dict(row)))
        return 0
    column = ranking.rank_column(row) or "acc_avg"
    where = row.get("model_uri") or "not registered"
    print(
        f"{row['method_label']} at {row['budget']} ({protocol}; job {row['job']}): "
        f"{column} {row.get(column)}; {where}"
    )
    return 0


def add_pull(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "pull",
        help="copy a registered variant's checkpoint out of the MLflow Model Registry",
        description="Copy the checkpoint directory that a model version points at into DIR "
        "(atomically): models:/<name>/<version> or models:/<name>@<alias> (best-8, dense).",
    )
    p.add_argument("uri", metavar="URI")
    p.add_argument("--out", required=True, metavar="DIR")
    p.add_argument(
        "--tracking-uri",
        default=None,
        help="the MLflow store holding the registry (default: $MLFLOW_TRACKING_URI)",
    )
    p.add_argument("--overwrite", action="store_true", help="replace an existing DIR")
    p.set_defaults(func=pull)


def pull(args: argparse.Namespace) -> int:
    from pipeline.tracking.registry_loading import pull as pull_version

    out, mv = pull_version(
        args.uri, args.out, tracking_uri=args.tracking_uri, overwrite=args.overwrite
    )
    method, budget = mv.tags.get("method_label", "?"), mv.tags.get("budget", "?")
    print(f"wrote {out}: {mv.name} version {mv.version} ({method}, budget {budget})")
    return 0


def add_gc(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "gc",
        help="find (or with --delete remove) stored variants no catalog row references",
        description="List the variant directories of a job's storage that no row of its "
        "catalog, nor of any shared catalog named, references: checkpoints of points whose "
        "rows are gone, copies a killed writer left. A dry run unless --delete; nothing of a "
        "job that may be running is touched.",
    )
    p.add_argument(
        "location",
        metavar="JOB.yaml|STORAGE",
        help="a job spec (its storage and shared catalog) or a storage",
    )
    p.add_argument(
        "--catalog",
        action="append",
        default=[],
        metavar="CATALOG",
        help="a shared catalog whose rows count too (repeatable)",
    )
    p.add_argument("--delete", action="store_true", help="remove what is found")
    p.set_defaults(func=gc)


def gc(args: argparse.Namespace) -> int:
    from pipeline.driver.cleanup import find_garbage, remove
    from pipeline.spec.parse import load_spec

    location, catalogs = args.location, list(args.catalog)
    if location.endswith((".yaml", ".yml")):
        spec = load_spec(location)
        location = spec.storage or spec.output_dir
        catalogs += [spec.catalog] if spec.catalog else []
    found = find_garbage(location, catalogs)
    where = found.storage.uri()
    if found.running:
        print(f"gc {where}: its job is {found.running}; nothing removed")
        return 0
    verb = "removed" if args.delete else "would remove"
    for rel, size in found.unreferenced:
        print(f"{verb} {rel} ({size / 2**20:.1f} MiB)")
    total = f"{len(found.unreferenced)} not referenced ({found.bytes / 2**20:.1f} MiB)"
    print(f"gc {where}: {found.referenced} variant(s) referenced by catalog rows, {total}")
    if args.delete:
        remove(found)
    elif found.unreferenced:
        print("dry run: nothing removed; --delete removes them")
    return 0
