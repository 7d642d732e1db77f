"""The code's shape, read from its source: what may import what in `lorp/` and `pipeline/`,
how long a function and a module may be, which module writes the job's records, and where
each module's tests live (docs: Architecture)."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers.paths import REPO

ROOT = REPO
PIPELINE_LAYERS = [
    {"storage"},
    {"spec"},
    {"cluster", "evaluation"},
    {"catalog"},
    {"events"},
    {"messages"},
    {"plan"},
    {"tracking"},
    {"stages"},
    {"driver"},
    {"cli"},
]
"""`pipeline/`, bottom to top: a module imports only modules of its own layer and below."""
LORP_LAYERS = [
    {"version", "cache", "atomic"},
    {"models", "data", "experts"},
    {"locality"},
    {"repair"},
    {"scoring"},
    {"methods"},
    {"peers"},
    {"provenance", "serving_cost"},
    {"cli", ""},
]
"""`lorp/`, bottom to top: checkpoints, text and a mixture's experts (cut from the
checkpoint as its blocks are) below the paper's core (`locality`), the core below the
repair, the repair below the selection methods (`window` ranks by it), the published peer recipes
(a selection and its own repair each) above both, and the command
line (and the package's public API, "") on top."""
WRITERS = {
    "Tracker",
    "Catalog",
    "EventLog",
    "register_model",
    "move_aliases",
    "materialize_aliases",
}
"""What writes a job's records: catalog commits, MLflow runs, events, registry versions and
aliases, the aliases written out (and their tags)."""
WRITER_MODULES = {
    "pipeline.tracking.runs",
    "pipeline.catalog.table",
    "pipeline.events.log",
    "pipeline.tracking.registry",
    "pipeline.tracking.aliases",
    "pipeline.tracking.materialized",
}
"""The modules that define them: importing one whole (`import ... as c`, `from ... import
catalog`) counts as a use; importing a reader from one (`read_events`) does not."""
MAX_MODULE_LINES = 500


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _layer(module: str, package: str, layers: list[set[str]]) -> int | None:
    parts = module.split(".")
    if parts[0] != package:
        return None
    name = parts[1] if len(parts) > 1 else ""
    found = [i for i, names in enumerate(layers) if name in names]
    assert found, f"{module}: in no layer of the layout (docs: Architecture)"
    return found[0]


def layer(module: str) -> int | None:
    """The layer of a `pipeline` or `lorp` module (each package has its own); None
    outside them and for `pipeline`'s own __init__ (a docstring)."""
    if module == "pipeline":
        return None
    if module.startswith("pipeline"):
        return _layer(module, "pipeline", PIPELINE_LAYERS)
    return _layer(module, "lorp", LORP_LAYERS)


def imports(
    tree: ast.AST, module: str, is_package: bool = False
) -> Iterator[tuple[str, list[str], int]]:
    """(module, names, line) of every import, in functions and TYPE_CHECKING too; a
    relative import is resolved against `module` (a package's `__init__` is its own
    package), so `from .records.catalog import Catalog` is `pipeline.catalog.table`."""
    package = module.split(".") if is_package else module.split(".")[:-1]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, [], node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                target = ".".join([*base, *([node.module] if node.module else [])])
            else:
                target = node.module or ""
            names = [a.name for a in node.names]
            yield target, names, node.lineno
            for name in names:  # `from pipeline.catalog import table`: the module itself
                yield f"{target}.{name}", [], node.lineno


def source_imports(path: Path) -> Iterator[tuple[str, list[str], int]]:
    return imports(ast.parse(path.read_text()), module_name(path), path.name == "__init__.py")


def sources(folder: str) -> list[Path]:
    return sorted((ROOT / folder).rglob("*.py"))


def upward_imports(path: Path, found: Iterator[tuple[str, list[str], int]]) -> list[str]:
    me = layer(module_name(path))
    if me is None:
        return []
    wrong = []
    for target, _, line in found:
        if target.split(".")[0] != module_name(path).split(".")[0]:
            continue  # each package's layers are its own; lorp never imports pipeline
        other = layer(target)
        if other is not None and other > me:
            wrong.append(f"{path.relative_to(ROOT)}:{line} imports {target}")
    return wrong


@pytest.mark.parametrize("folder", ["pipeline", "lorp"])
def test_no_module_imports_one_above_it(folder: str) -> None:
    wrong = [w for path in sources(folder) for w in upward_imports(path, source_imports(path))]
    assert not wrong, "\n".join(wrong)


def test_the_layer_check_sees_relative_and_aliased_imports() -> None:
    """Fed imports that once slipped through: each is caught, in both packages."""
    caught = {
        "pipeline/storage/store.py": "from ..catalog.table import Catalog",
        "pipeline/spec/job.py": "import pipeline.catalog.table as c",
        "pipeline/plan/grid.py": "from ..driver import fleet",
        "pipeline/cluster/model_source.py": "from pipeline.plan.grid import ModelPlan",
        "lorp/models/surgery.py": "from ..repair import fold",
        "lorp/locality/rls.py": "from lorp.methods import registry",
        "lorp/data/windows.py": "import lorp.locality.similarity as s",
    }
    for rel, line in caught.items():
        path = ROOT / rel
        found = imports(ast.parse(line), module_name(path))
        assert upward_imports(path, found), f"{rel}: {line!r} was not caught"
    ok = imports(ast.parse("from .shape import ModelShape"), "lorp.models.memory")
    assert not upward_imports(ROOT / "lorp/models/memory.py", ok)


def _graph(folder: str) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in sources(folder):
        targets = {t for t, _, _ in source_imports(path)}
        me = module_name(path)  # a package importing its own modules is no cycle
        graph[me] = {t for t in targets if t.startswith(f"{folder}.") and t != me}
    return graph


@pytest.mark.parametrize("folder", ["pipeline", "lorp", "benchmarks"])
def test_no_import_cycle(folder: str) -> None:
    graph = _graph(folder)
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


@pytest.mark.parametrize(
    ("folder", "limit"), [("pipeline", 50), ("dashboards", 50), ("benchmarks", 50), ("lorp", 80)]
)
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


@pytest.mark.parametrize("folder", ["lorp", "pipeline", "dashboards", "benchmarks"])
def test_no_module_over_500_lines(folder: str) -> None:
    """Split by meaning where a module grows past this, each part named for its concern."""
    long = [
        f"{p.relative_to(ROOT)} {n}"
        for p in sources(folder)
        if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES
    ]
    assert not long, "\n".join(long)


def test_lorp_keeps_its_top_level_small() -> None:
    """Subpackages named for what they hold; at most 8 modules beside them."""
    top = sorted(p.name for p in (ROOT / "lorp").glob("*.py"))
    assert len(top) <= 8, top


def writer_users(found: Iterator[tuple[str, list[str], int]]) -> bool:
    for target, names, _ in found:
        if WRITERS & set(names) or (not names and target in WRITER_MODULES):
            return True
    return False


def test_records_are_written_from_the_recorder_only() -> None:
    """The classes and functions that write catalog commits, MLflow runs, events and
    registry versions are used by the recorder and nowhere else in the driver (the
    modules that define them aside)."""
    users = {
        module_name(path)
        for path in sources("pipeline")
        if module_name(path) not in WRITER_MODULES and writer_users(source_imports(path))
    }
    assert users == {"pipeline.driver.recorder"}, users


def test_the_writer_check_sees_module_imports() -> None:
    for line in (
        "import pipeline.catalog.table as c",
        "from pipeline.tracking import registry",
        "from ..tracking.runs import Tracker",
        "from ..events import log",
    ):
        assert writer_users(imports(ast.parse(line), "pipeline.driver.fleet")), line
    for line in (
        "from .rows import row",
        "from pipeline.events.log import read_events",
    ):
        assert not writer_users(imports(ast.parse(line), "pipeline.driver.fleet")), line


def test_the_lorp_package_imports_no_fleet_library() -> None:
    banned = ("ray", "mlflow", "vllm", "pipeline")
    wrong = [
        f"{path.relative_to(ROOT)}:{line} imports {target}"
        for path in sources("lorp")
        for target, _, line in source_imports(path)
        if target.split(".")[0] in banned
    ]
    assert not wrong, "\n".join(wrong)


def untested_modules() -> list[str]:
    """Modules of lorp/, pipeline/, dashboards/ and benchmarks/ without a test file beside
    them (`tests/<folder>/test_<name>.py`) and without a row in tests/integration/README.md."""
    listed = set(re.findall(r"`([\w/]+\.py)`", (ROOT / "tests/integration/README.md").read_text()))
    missing = []
    for folder in ("lorp", "pipeline", "dashboards", "benchmarks"):
        for path in sources(folder):
            rel = path.relative_to(ROOT)
            if path.name == "__init__.py" or rel.as_posix() in listed:
                continue
            if not (ROOT / "tests" / rel.parent / f"test_{path.name}").is_file():
                missing.append(rel.as_posix())
    return missing


def test_every_module_has_its_tests_where_its_name_says() -> None:
    """lorp/x/y.py is tested in tests/lorp/x/test_y.py, or tests/integration/README.md
    says where it is exercised and why it has no file of its own."""
    assert not untested_modules(), untested_modules()


def test_the_integration_readme_names_only_modules_that_exist() -> None:
    text = (ROOT / "tests/integration/README.md").read_text()
    gone = [
        m
        for m in re.findall(r"`((?:lorp|pipeline|dashboards|benchmarks)/[\w/]+\.py)`", text)
        if not (ROOT / m).is_file()
    ]
    assert not gone, gone


def test_the_plan_does_not_import_the_driver() -> None:
    """Planning is below the driver: it hands the driver values and never calls up."""
    wrong = [
        f"{path.relative_to(ROOT)}:{line} imports {target}"
        for path in sources("pipeline/plan")
        for target, _, line in source_imports(path)
        if target.startswith(("pipeline.driver", "pipeline.stages", "pipeline.cli"))
    ]
    assert not wrong, "\n".join(wrong)


MAX_WHOLE_SPEC = 10


def whole_spec_takers(folder: str) -> list[str]:
    """Functions with a parameter annotated `JobSpec`: each reads the whole job."""
    out = []
    for path in sources(folder):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                args = [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]
                if any(a.annotation and "JobSpec" in ast.unparse(a.annotation) for a in args):
                    out.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}")
    return out


def test_few_functions_take_the_whole_job_spec() -> None:
    """A function takes the spec section it reads (`EvaluationSpec`, `RepairSettings`, a
    `ModelPlan`'s calibration), not the whole `JobSpec`; a few at the top take the job."""
    takers = whole_spec_takers("pipeline") + whole_spec_takers("dashboards")
    assert len(takers) <= MAX_WHOLE_SPEC, "\n".join(takers)


MAX_FMT_SKIPS = {"code": 10, "tests": 20}
"""`# fmt: skip` lines at most, in lorp/, pipeline/, dashboards/ and benchmarks/ together
(code), and in tests/: size limits hold on code as `ruff format` writes it, so a line is
packed only where it is a literal table whose alignment is the point."""


def fmt_skips(folders: tuple[str, ...]) -> int:
    return sum(
        line.rstrip().endswith("# fmt: skip")
        for folder in folders
        for path in sources(folder)
        for line in path.read_text().splitlines()
    )


def test_size_limits_hold_on_formatted_code() -> None:
    code = fmt_skips(("lorp", "pipeline", "dashboards", "benchmarks"))
    tests = fmt_skips(("tests",))
    assert code <= MAX_FMT_SKIPS["code"] and tests <= MAX_FMT_SKIPS["tests"], (code, tests)
