"""`lorp dashboard RUN_DIR`: write the static site for a run directory (or catalogs)."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_dashboard(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "dashboard",
        help="write the fleet dashboard (static HTML) for a run directory",
        description="Reads RUN_DIR/catalog.parquet (or --catalog files) and the cached S files.",
    )
    p.add_argument("run_dir", metavar="RUN_DIR")
    p.add_argument("--catalog", nargs="*", default=None, help="catalogs to show instead")
    p.add_argument("--out", default=None, help="default: RUN_DIR/dashboard")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from dashboards.site import build_site, legacy_tracking
    from pipeline.catalog import merge_catalogs

    run_dir = Path(args.run_dir)
    catalogs = args.catalog or [str(run_dir / "catalog.parquet")]
    rows = merge_catalogs(catalogs)
    # Rows name their own store and experiment; only older catalogs need RUN_DIR's store.
    index = build_site(
        rows,
        Path(args.out) if args.out else run_dir / "dashboard",
        fallback_tracking=legacy_tracking(run_dir, rows),
    )
    print(f"dashboard    {index.resolve()}")
    print(
        f"             preview: python -m http.server --bind 127.0.0.1 --directory {index.parent}"
    )
    return 0
