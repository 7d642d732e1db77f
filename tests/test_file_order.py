"""The suite's files go out longest first, as measured; a new integration file goes out
with the longest, a new quick one with the quick ones; a run records each file's seconds
only where it is asked to, in the process that sees every report."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

from tests.helpers.file_order import DurationRecorder, order, recorder

TESTS = Path("/repo/tests")


class Item(SimpleNamespace):
    def get_closest_marker(self, name: str) -> object:
        return name if name in self.marks else None


def item(name: str, test: str, *marks: str) -> Item:
    return Item(path=TESTS / name, nodeid=f"tests/{name}::{test}", marks=marks)


def test_files_go_out_longest_first_and_keep_their_tests_order() -> None:
    items = [
        item("lorp/test_a.py", "one"),
        item("lorp/test_a.py", "two"),
        item("integration/test_job.py", "job", "integration"),
        item("integration/test_two.py", "job", "integration"),
        item("integration/test_new.py", "job", "integration"),
        item("lorp/test_new.py", "quick"),
        item("integration/test_new.py", "unmarked"),  # its file is a job's all the same
    ]
    measured = {
        "lorp/test_a.py": 3.0,
        "integration/test_job.py": 90.0,
        "integration/test_two.py": 200.0,
    }
    order(items, TESTS, measured)  # type: ignore[arg-type]
    assert [(i.path.name, i.nodeid.split("::")[1]) for i in items] == [
        ("test_two.py", "job"),
        ("test_new.py", "job"),  # unmeasured integration: as long as the longest measured
        ("test_new.py", "unmarked"),
        ("test_job.py", "job"),
        ("test_a.py", "one"),
        ("test_a.py", "two"),
        ("test_new.py", "quick"),
    ]


def test_a_passing_run_records_each_files_seconds(tmp_path: Path) -> None:
    out = tmp_path / "durations.json"
    rec = DurationRecorder(out)
    for nodeid, seconds in (
        ("tests/a.py::x", 1.25),
        ("tests/a.py::y", 2.0),
        ("tests/b.py::z", 0.5),
    ):
        rec.pytest_runtest_logreport(SimpleNamespace(nodeid=nodeid, duration=seconds))  # type: ignore[arg-type]
    rec.pytest_sessionfinish(None, 1)  # type: ignore[arg-type]
    assert not out.exists()  # a failed run measures nothing worth ordering by
    rec.pytest_sessionfinish(None, 0)  # type: ignore[arg-type]
    assert json.loads(out.read_text()) == {"a.py": 3.2, "b.py": 0.5}
    controller, worker = SimpleNamespace(), SimpleNamespace(workerinput={})
    env = {"LORP_TEST_DURATIONS": str(out)}
    assert recorder(controller, env) is not None  # type: ignore[arg-type]
    assert recorder(worker, env) is None and recorder(controller, {}) is None  # type: ignore[arg-type]
