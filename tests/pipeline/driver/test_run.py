"""The job's story (`pipeline.driver.run`): a stop signal asks the fleet to stop and the
old handlers come back after; a job whose output directory cannot be written, or whose
model cannot be planned, is refused in one line before any file is made."""

from __future__ import annotations

import os
import re
import signal
import threading
from pathlib import Path
from types import FrameType, SimpleNamespace

import pytest

from pipeline.driver.run import run_job, stop_signals
from pipeline.spec.checks import SpecError
from pipeline.spec.parse import parse_spec
from tests.helpers.job_specs import tiny_job


def earlier(signum: int, frame: FrameType | None) -> None:
    """The handler the process had before the driver's."""


@pytest.fixture
def handlers() -> object:
    """SIGTERM and SIGINT set to `earlier`, put back as they were after the test."""
    old = {s: signal.signal(s, earlier) for s in (signal.SIGTERM, signal.SIGINT)}
    yield earlier
    for s, h in old.items():
        signal.signal(s, h)


def test_sigterm_asks_the_fleet_to_stop_and_the_old_handlers_come_back(handlers) -> None:  # type: ignore[no-untyped-def]
    fleet = SimpleNamespace(stop_requested=0)  # what `stop_signals` touches of a `Fleet`
    with stop_signals(fleet):  # type: ignore[arg-type]
        assert signal.getsignal(signal.SIGTERM) is not earlier
        os.kill(os.getpid(), signal.SIGTERM)
        assert fleet.stop_requested == signal.SIGTERM
        os.kill(os.getpid(), signal.SIGINT)  # a second signal changes nothing
        assert fleet.stop_requested == signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) is earlier
    assert signal.getsignal(signal.SIGINT) is earlier


def test_ctrl_c_asks_the_fleet_to_stop_even_when_the_loop_raises(handlers) -> None:  # type: ignore[no-untyped-def]
    fleet = SimpleNamespace(stop_requested=0)
    with pytest.raises(RuntimeError, match="the loop broke"), stop_signals(fleet):  # type: ignore[arg-type]
        os.kill(os.getpid(), signal.SIGINT)
        raise RuntimeError("the loop broke")
    assert fleet.stop_requested == signal.SIGINT
    assert (
        signal.getsignal(signal.SIGINT) is earlier and signal.getsignal(signal.SIGTERM) is earlier
    )


def test_a_driver_off_the_main_thread_leaves_the_handlers_alone(handlers) -> None:  # type: ignore[no-untyped-def]
    seen = []

    def drive() -> None:
        with stop_signals(SimpleNamespace(stop_requested=0)):  # type: ignore[arg-type]
            seen.append(signal.getsignal(signal.SIGTERM))

    thread = threading.Thread(target=drive)
    thread.start()
    thread.join()
    assert seen == [earlier]


def files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def test_an_unwritable_output_dir_is_refused_before_any_file(tmp_path: Path) -> None:
    import ray

    (tmp_path / "taken").write_text("a file where the run directory would go")
    spec = tiny_job(tmp_path, tmp_path / "no-model", "grid")
    spec |= {"output_dir": str(tmp_path / "taken" / "grid")}
    before = files(tmp_path)
    target, taken = repr(str(tmp_path / "taken" / "grid")), repr(str(tmp_path / "taken"))
    why = f"output_dir: {target} cannot be written: {taken} is a file, not a directory"
    with pytest.raises(SpecError, match=f"^{re.escape(why)}$"):
        run_job(parse_spec(spec))
    assert files(tmp_path) == before and not ray.is_initialized()


def test_a_model_that_cannot_be_planned_is_refused_before_any_file(tmp_path: Path) -> None:
    spec = parse_spec(tiny_job(tmp_path, tmp_path / "no-model", "grid"))
    with pytest.raises(SpecError, match=r"^models\[0\]\.ref: "):
        run_job(spec)
    assert files(tmp_path) == []  # no run directory, no cache, no MLflow store
