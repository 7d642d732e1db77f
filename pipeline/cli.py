"""`lorp run` and `lorp catalog merge`: the pipeline's subcommands, plugged into the `lorp`
console script through the `lorp.commands` entry-point group. Heavy imports (Ray, MLflow)
happen inside the commands, so `lorp select` stays fast."""

from __future__ import annotations

import argparse
import sys


def add_run(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "run",
        help="run a job spec: capture, select, prune, evaluate, record",
        description="Run jobs/*.yaml on the embedded local Ray or the cluster in RAY_ADDRESS.",
    )
    p.add_argument("spec", metavar="JOB.yaml")
    p.add_argument("--force", action="store_true", help="redo grid points already done")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pipeline.run import run_job
    from pipeline.spec import load_spec
    from pipeline.tracking import redact

    spec = load_spec(args.spec)
    summary = run_job(spec, force=args.force)
    uri = redact(summary.tracking_uri)
    print(f"catalog      {summary.catalog.resolve()}")
    print(f"mlflow       {uri}")
    browse = f"mlflow ui --host 127.0.0.1 --backend-store-uri {uri}"
    print(f"             browse: {browse}")
    print(f"checkpoints  {summary.checkpoints.resolve()}")
    print(
        f"grid points  {summary.done} done, {summary.skipped} already done, "
        f"{len(summary.failed)} failed; S captured {summary.captured}, from cache {summary.cached}"
    )
    for failure in summary.failed:
        print(f"failed: {failure}", file=sys.stderr)
    return 1 if summary.failed else 0


def add_catalog(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("catalog", help="work with catalogs")
    csub = p.add_subparsers(dest="catalog_command", required=True, parser_class=type(p))
    m = csub.add_parser("merge", help="combine the catalogs of many jobs into one")
    m.add_argument("catalogs", nargs="+", metavar="CATALOG.parquet")
    m.add_argument("--out", required=True, metavar="OUT.parquet")
    m.set_defaults(func=merge)


def merge(args: argparse.Namespace) -> int:
    from pipeline.catalog import merge_catalogs, write_catalog

    rows = merge_catalogs(args.catalogs)
    write_catalog(args.out, rows)
    print(f"wrote {args.out}: {len(rows)} rows from {len(args.catalogs)} catalogs")
    return 0
