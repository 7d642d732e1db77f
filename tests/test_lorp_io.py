"""Atomic writes, the provenance record, kept blocks and the module graph of lorp/."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

import lorp
from lorp import kept_layers, provenance
from lorp.atomic import atomic_dir, atomic_file

LORP_DIR = Path(lorp.__file__).parent


def test_atomic_file_replaces_or_leaves_nothing(tmp_path: Path) -> None:
    target = tmp_path / "sub" / "a.json"
    with atomic_file(target) as tmp:
        assert tmp.parent == target.parent and tmp.name.startswith(".a.json.")
        tmp.write_text("1")
        assert not target.exists()
    assert target.read_text() == "1"
    with pytest.raises(RuntimeError, match="boom"), atomic_file(target) as tmp:
        tmp.write_text("2")
        raise RuntimeError("boom")
    assert target.read_text() == "1" and [p.name for p in target.parent.iterdir()] == ["a.json"]


def test_atomic_dir_commit_overwrite_and_cleanup(tmp_path: Path) -> None:
    out = tmp_path / "ckpt"
    with atomic_dir(out) as tmp:
        # The pipeline deletes `*/.*.partial` leftovers of killed writers on resume.
        assert tmp.name.startswith(".ckpt.") and tmp.name.endswith(".partial")
        assert tmp.match(".*.partial")
        (tmp / "w").write_text("v1")
    assert (out / "w").read_text() == "v1"
    with pytest.raises(FileExistsError, match="already exists"), atomic_dir(out) as tmp:
        (tmp / "w").write_text("v2")
    with atomic_dir(out, overwrite=True) as tmp:
        (tmp / "w").write_text("v3")
    assert (out / "w").read_text() == "v3"
    with pytest.raises(KeyboardInterrupt), atomic_dir(tmp_path / "x") as tmp:
        raise KeyboardInterrupt
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_kept_layers() -> None:
    assert kept_layers(6, [4, 1, 1]) == [0, 2, 3, 5]
    assert kept_layers(3, []) == [0, 1, 2]


def test_provenance_has_one_layout() -> None:
    manual = provenance(
        source_model="m",
        source_fingerprint="f",
        method="manual",
        options={},
        budget=2,
        n_blocks=6,
        pruned=[4, 1],
    )
    grid = provenance(
        source_model="m",
        source_fingerprint="f",
        method="lorp",
        options={"variant": "paper", "thresholds": (1.0, 0.7)},
        budget=2,
        n_blocks=6,
        pruned=(1, 4),
        stats_hash="h",
        details={"rls": float("inf")},
        grid_key="g",
        job="demo",
        calibration={"dataset": "ptb"},
    )
    assert (
        manual.keys()
        == grid.keys()
        == {
            "lorp_version",
            "source_model",
            "source_fingerprint",
            "method",
            "options",
            "budget",
            "n_blocks",
            "pruned",
            "kept",
            "stats_hash",
            "details",
            "grid_key",
            "job",
            "calibration",
            "repair",
        }
    )
    assert manual["repair"] is None  # set only by a repaired grid point
    assert manual["pruned"] == grid["pruned"] == [1, 4] and manual["kept"] == [0, 2, 3, 5]
    assert manual["lorp_version"] == lorp.__version__ and manual["grid_key"] is None
    assert grid["options"]["thresholds"] == [1.0, 0.7] and grid["details"] == {"rls": None}
    assert json.loads(json.dumps(grid)) == grid
    with pytest.raises(ValueError, match=r"pruned blocks must be in \[0, 5\], got \[6\]"):
        provenance(
            source_model="m",
            source_fingerprint=None,
            method="manual",
            options={},
            budget=1,
            n_blocks=6,
            pruned=[6],
        )


def _imports(path: Path, module: str) -> set[str]:
    """Every lorp module `path` imports, at the top or inside a function."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("lorp")}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("lorp"):
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names}
    return out - {module}


def test_no_import_cycle_in_lorp() -> None:
    modules = {}
    for path in LORP_DIR.rglob("*.py"):
        parts = path.relative_to(LORP_DIR.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[name] = path
    graph = {m: _imports(p, m) & set(modules) for m, p in modules.items()}
    state: dict[str, int] = {}

    def visit(m: str, trail: list[str]) -> None:
        state[m] = 1
        for dep in sorted(graph[m]):
            if state.get(dep) == 1:
                raise AssertionError(" -> ".join([*trail, m, dep]))
            if dep not in state:
                visit(dep, [*trail, m])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [])
    assert (
        "lorp.cache" in graph["lorp.models.fingerprint"]
        and "lorp.models.loading" not in graph["lorp.models.fingerprint"]
    )
