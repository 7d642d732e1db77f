"""`lorp dashboard RUN_DIR`: write the static site for a run directory (or catalogs)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


def add_dashboard(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "dashboard",
        help="write the fleet dashboard (static HTML) for a run directory or a catalog",
        description="Reads RUN_DIR's catalog (a run directory, a job's storage, or a shared "
        "catalog: directory or URI; or --catalog files) and the cached S files.",
    )
    p.add_argument(
        "run_dir",
        metavar="RUN_DIR",
        help="a run directory, a job's storage URI, or a shared catalog (`catalog:`)",
    )
    p.add_argument("--catalog", nargs="*", default=None, help="catalogs to show instead")
    p.add_argument(
        "--out", default=None, help="a directory or storage URI (default: RUN_DIR/dashboard)"
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pipeline.storage.store import is_remote

    if is_remote(args.run_dir) or (args.out and is_remote(args.out)):
        return run_remote(args)
    index = write(args, Path(args.run_dir), Path(args.out or Path(args.run_dir) / "dashboard"))
    print(f"dashboard    {index.resolve()}")
    print(
        f"             preview: python -m http.server --bind 127.0.0.1 --directory {index.parent}"
    )
    return 0


def write(
    args: argparse.Namespace, run_dir: Path, out: Path, rows: list[dict[str, Any]] | None = None
) -> Path:
    from dashboards.site import build_site, legacy_tracking
    from pipeline.catalog.shared import SharedCatalog, open_catalog
    from pipeline.catalog.table import merge_catalogs, newest_per_key

    shared = not args.catalog and run_dir.is_dir() and SharedCatalog(str(run_dir)).is_shared()
    if rows is not None:  # read from a remote run directory
        rows = newest_per_key(rows)
    elif args.catalog:
        rows = merge_catalogs(args.catalog)
    else:
        rows = newest_per_key(open_catalog(str(run_dir)))
    # Rows name their own store and experiment; only older catalogs need RUN_DIR's store.
    return build_site(
        rows,
        out,
        fallback_tracking=legacy_tracking(run_dir, rows),
        # the job's timeline (copied here when remote); a shared catalog has no one job's
        events_file=None if shared else run_dir / "events.jsonl",
    )


def run_remote(args: argparse.Namespace) -> int:
    """RUN_DIR or --out in a job's storage: the catalog comes from there, and the site is
    built locally, then uploaded with its completion marker."""
    import tempfile

    from pipeline.storage.store import Storage, is_remote

    with tempfile.TemporaryDirectory(prefix="lorp-dashboard-") as tmp:
        run_dir = Path(args.run_dir)
        if is_remote(args.run_dir):
            from pipeline.catalog.shared import open_catalog

            run_dir, store = Path(tmp) / "run", Storage(args.run_dir)
            rows = open_catalog(args.run_dir)  # a job's catalog, or a shared one
            for name in ("events.jsonl",):
                store.get_file(name, run_dir / name)
        index = write(args, run_dir, Path(tmp) / "site", rows if is_remote(args.run_dir) else None)
        out = Storage(args.out) if args.out else Storage(args.run_dir).sub("dashboard")
        uri = out.put_dir(index.parent)
    print(f"dashboard    {uri}")
    return 0
