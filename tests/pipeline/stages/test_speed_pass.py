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

    def peak(task, dense_dir, layers, checkpoint, units=()):  # type: ignore[no-untyped-def]
        measured.append(tuple(layers) or tuple(units))
        return {"peak_mem_gib": float(len(layers)) + len(units) / 10}

    timed: dict = {}  # type: ignore[type-arg]

    def timings(dense, copies, *a, **kw):  # type: ignore[no-untyped-def]
        from lorp.models.architectures import decoder_blocks

        for k, (m, removed) in copies.items():  # what each copy runs without, and its bound's k
            timed[k] = (len(decoder_blocks(m)), type(decoder_blocks(m)[1].mlp).__name__, removed)
        return {k: {"speedup": 1.0 + len(k) / 10} for k in [*copies, ""]}

    monkeypatch.setattr(speed, "timed_speedups", timings)
    monkeypatch.setattr(speed_pass, "_peak_memory", peak)
    variants = (
        ("d", (), None),
        ("a", (1,), None),
        ("b", (2,), None),
        ("c", (1, 2), None),
        ("uu", (), None),
    )
    task = SpeedTask(
        model=ModelSource(ref=str(where), kind="dir"),
        storage=str(tmp_path),
        variants=variants,
        seq_len=8,
        budget_s=10.0,
        n_blocks=6,
        units={"uu": (3, 4)},
    )
    out = speed_pass.measure_speed(task)
    assert measured == [(), (1,), (1, 2), (3, 4)]
    assert {k: v["peak_mem_gib"] for k, v in out.items()} == {
        "d": 0,
        "a": 1,
        "b": 1,
        "c": 2,
        "uu": 0.2,
    }
    # the sub-layer variant (mlp.1, attn.2) is timed with its sub-layers gone, all 6 blocks
    # kept, and its bound counts the 2 blocks it touches
    assert timed["uu"] == (6, "Removed", 2) and timed["a"][0] == 5
    assert out["uu"]["speedup"] == 1.2 and out["d"]["speedup"] == 1.0
