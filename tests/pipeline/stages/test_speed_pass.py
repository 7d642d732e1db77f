"""The speed pass (`pipeline.stages.speed_pass`): variants grouped to fit memory, each group
its share of the model's time budget."""

from __future__ import annotations

import pytest

from pipeline.evaluation import speed
from pipeline.stages.speed_pass import _groups


def test_groups_fit_the_memory_budget() -> None:
    items = [("a", 1), ("b", 2), ("c", 3), ("d", 4)]
    assert _groups(items, lambda n: n, 5) == [[("a", 1), ("b", 2)], [("c", 3)], [("d", 4)]]
    assert _groups(items, lambda n: n, 100) == [items]
    assert _groups(items, lambda n: 10 * n, 1) == [[i] for i in items]  # one each, at least


def test_groups_share_the_models_time_budget(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Variants that do not fit memory together are timed in groups; each group gets the
    budget left divided by the groups left, so the first cannot spend the last's time."""
    from pipeline.cluster.model_source import ModelSource
    from pipeline.messages import SpeedTask
    from pipeline.stages import speed_pass
    from tests.helpers.tiny_models import save_tiny_ptb

    where = save_tiny_ptb("llama", tmp_path / "tiny")
    budgets: list[float] = []

    def timed(dense, copies, seq_len, *, budget_s, **kw):  # type: ignore[no-untyped-def]
        budgets.append(budget_s)
        return {k: {"speedup": 1.0} for k in copies} | {"": {"speedup": 1.0}}

    monkeypatch.setattr(speed, "timed_speedups", timed)
    monkeypatch.setattr(speed_pass, "_free_bytes", lambda model: 1.0)  # one variant per group
    monkeypatch.setattr(speed_pass, "_peak_memory", lambda *a: {})
    task = SpeedTask(
        model=ModelSource(ref=str(where), kind="dir"),
        storage=str(tmp_path),
        variants=(("d", (), None), ("a", (1,), None), ("b", (2,), None), ("c", (1, 2), None)),
        seq_len=8,
        budget_s=90.0,
        n_blocks=6,
    )
    out = speed_pass.measure_speed(task)
    assert set(out) == {"d", "a", "b", "c"}
    # 90 s over 3 groups: the first gets a third; a scripted group takes no time, so the
    # second gets half of the 90 s still left and the last all of it
    assert budgets == pytest.approx([30.0, 45.0, 90.0], abs=0.5)


def test_peak_memory_once_per_kept_size(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Variants that keep as many blocks of the same bytes share one fresh-process
    measurement: here blocks 1 and 2 are alike, so 3 sizes for 4 variants."""
    from pipeline.cluster.model_source import ModelSource
    from pipeline.messages import SpeedTask
    from pipeline.stages import speed_pass
    from tests.helpers.tiny_models import save_tiny_ptb

    where = save_tiny_ptb("llama", tmp_path / "tiny")
    measured: list[tuple[int, ...]] = []

    def peak(task, dense_dir, layers, checkpoint):  # type: ignore[no-untyped-def]
        measured.append(tuple(layers))
        return {"peak_mem_gib": float(len(layers))}

    monkeypatch.setattr(speed, "timed_speedups", lambda dense, copies, *a, **kw: {
        k: {"speedup": 1.0} for k in [*copies, ""]})  # fmt: skip
    monkeypatch.setattr(speed_pass, "_peak_memory", peak)
    variants = (("d", (), None), ("a", (1,), None), ("b", (2,), None), ("c", (1, 2), None))
    task = SpeedTask(
        model=ModelSource(ref=str(where), kind="dir"), storage=str(tmp_path),
        variants=variants, seq_len=8, budget_s=10.0, n_blocks=6,
    )  # fmt: skip
    out = speed_pass.measure_speed(task)
    assert measured == [(), (1,), (1, 2)]
    assert {k: v["peak_mem_gib"] for k, v in out.items()} == {"d": 0, "a": 1, "b": 1, "c": 2}
