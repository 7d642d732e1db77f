"""The code's shape, read from its source: what may import what in `pipeline/`, how long a
function may be, and which module writes the job's records (README, Layout)."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYERS = [
    {"storage"},
    {"spec"},
    {"evaluation", "plan"},
    {"records", "cluster", "messages"},
    {"stages"},
    {"prepare", "recorder"},
    {"fleet"},
    {"run"},
    {"cli"},
]
"""Bottom to top: a module imports only modules of its own layer and those below."""
WRITERS = {"Tracker", "Catalog", "EventLog", "register_model"}
"""What writes a job's records: catalog parts, MLflow runs, events, registry versions."""


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer(module: str) -> int | None:
    """The layer of a `pipeline` module; None outside `pipeline`."""
    parts = module.split(".")
    if parts[0] != "pipeline" or len(parts) < 2:
        return None
    found = [i for i, names in enumerate(LAYERS) if parts[1] in names]
    assert found, f"{module}: in no layer of the layout (README, Layout)"
    return found[0]


def imports(tree: ast.AST) -> Iterator[tuple[str, list[str], int]]:
    """(module, names, line) of every absolute import, in functions and TYPE_CHECKING too."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, [], node.lineno
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module, [a.name for a in node.names], node.lineno


def sources(folder: str) -> list[Path]:
    return sorted((ROOT / folder).rglob("*.py"))


def test_no_module_in_pipeline_imports_one_above_it() -> None:
    wrong = []
    for path in sources("pipeline"):
        me = layer(module_name(path))
        if me is None:
            continue  # the package's own __init__: a docstring
        for target, _, line in imports(ast.parse(path.read_text())):
            other = layer(target)
            if other is not None and other > me:
                wrong.append(f"{path.relative_to(ROOT)}:{line} imports {target}")
    assert not wrong, "\n".join(wrong)


def test_no_import_cycle_among_pipeline_modules() -> None:
    graph: dict[str, set[str]] = {}
    for path in sources("pipeline"):
        targets = {t for t, _, _ in imports(ast.parse(path.read_text()))}
        graph[module_name(path)] = {t for t in targets if t.startswith("pipeline.")}
    state: dict[str, int] = {}

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                raise AssertionError(" -> ".join([*trail, node, nxt]))
            if nxt in graph and not state.get(nxt):
                visit(nxt, [*trail, node])
        state[node] = 2

    for node in sorted(graph):
        if not state.get(node):
            visit(node, [])


@pytest.mark.parametrize(("folder", "limit"), [("pipeline", 50), ("dashboards", 50), ("lorp", 80)])
def test_no_function_over_its_folders_length(folder: str, limit: int) -> None:
    """Lines from `def` to the function's last line; a nested function counts in its
    parent too."""
    long = []
    for path in sources(folder):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                n = node.end_lineno - node.lineno + 1  # type: ignore[operator]
                if n > limit:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} {n}")
    assert not long, "\n".join(long)


def test_records_are_written_from_the_recorder_only() -> None:
    """The classes and functions that write catalog parts, MLflow runs, events and
    registry versions are used by the recorder and nowhere else in the driver."""
    users = set()
    for path in sources("pipeline"):
        for _, names, _ in imports(ast.parse(path.read_text())):
            if WRITERS & set(names) or "model_registry" in names:
                users.add(module_name(path))
    assert users == {"pipeline.recorder"}, users


def test_the_lorp_package_imports_no_fleet_library() -> None:
    banned = ("ray", "mlflow", "vllm", "pipeline")
    wrong = [
        f"{path.relative_to(ROOT)}:{line} imports {target}"
        for path in sources("lorp")
        for target, _, line in imports(ast.parse(path.read_text()))
        if target.split(".")[0] in banned
    ]
    assert not wrong, "\n".join(wrong)
