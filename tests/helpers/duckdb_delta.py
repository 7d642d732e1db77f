"""Reading the shared catalog with DuckDB's own Delta reader (`delta_scan`), as a data team
would: the extension comes from the `duckdb-ext-delta` wheel (`make test` installs it),
not from DuckDB's download site."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def extension_dir() -> str:
    import duckdb_ext  # noqa: F401  (a namespace package of the duckdb-ext-* wheels)

    (root,) = list(duckdb_ext.__path__)
    return str(Path(root) / "extensions")


def duckdb_rows(table: str, columns: str = "*") -> list[tuple[Any, ...]]:
    """`columns` of every row of the Delta table at the local path `table`."""
    import duckdb

    with duckdb.connect() as con:
        con.execute("SET extension_directory = ?", [extension_dir()])
        con.execute("SET autoinstall_known_extensions = false")
        con.execute("LOAD delta")
        return con.execute(f"SELECT {columns} FROM delta_scan(?)", [table]).fetchall()
