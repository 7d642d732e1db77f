"""The job's own fields (`pipeline.spec.job`): the repair list, ridge, followers and
distillation settings."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import pytest

from pipeline.spec.checks import SpecError
from pipeline.spec.parse import parse_spec
from tests.helpers.job_specs import tiny_job


def test_the_repair_ridge_is_auto_or_a_positive_number() -> None:
    from pipeline.spec.checks import SpecError
    from pipeline.spec.parse import parse_spec

    base = {"name": "r", "models": [{"ref": "x"}], "budgets": [1], "methods": [{"name": "lorp"}]}
    assert parse_spec(base).ridge_value is None  # auto: chosen on held-out windows
    assert parse_spec(base | {"repair_ridge": 0.01}).ridge_value == 0.01
    for bad, shown in (("fast", "'fast'"), (0, "0")):
        with pytest.raises(
            SpecError, match=f"repair_ridge: must be auto or a number > 0, got {shown}"
        ):
            parse_spec(base | {"repair_ridge": bad})
    assert parse_spec(base).repair_followers == 1
    assert parse_spec(base | {"repair_followers": 0}).repair_followers == 0
    for bad, says in ((-1, "must be an integer >= 0, got -1"), (1.5, "expected an integer")):
        with pytest.raises(SpecError, match=f"repair_followers: {says}"):
            parse_spec(base | {"repair_followers": bad})
    assert parse_spec(base).repair_distill == 0  # least squares only, unless asked
    assert not parse_spec(base).distills
    job = parse_spec(base | {"repair_distill": 2})
    assert job.distill_epochs(job.methods[0]) == 2 and job.distills
    own = [{"name": "lorp", "repair_distill": 3}, {"name": "shortgpt"}]
    one = parse_spec(base | {"methods": own})  # a method's own epochs, the job's elsewhere
    assert [one.distill_epochs(m) for m in one.methods] == [3, 0] and one.distills
    assert not parse_spec(base | {"methods": own, "repair": ["none"]}).distills
    with pytest.raises(SpecError, match="methods.0..repair_distill: must be an integer >= 0"):
        parse_spec(base | {"methods": [{"name": "lorp", "repair_distill": -1}]})
    with pytest.raises(SpecError, match="repair_distill: must be an integer >= 0, got -1"):
        parse_spec(base | {"repair_distill": -1})
    for bad, says in (
        ("fast", "expected a number, got str 'fast'"),
        (0, "must be a number in .0, 1., got 0"),
        (2, "must be a number in .0, 1., got 2"),
    ):
        with pytest.raises(SpecError, match=f"repair_distill_lr: {says}"):
            parse_spec(base | {"repair_distill_lr": bad})


@pytest.mark.integration
@pytest.mark.parametrize(
    ("repair", "message"),
    [
        (["lineer"], "repair[0]: must be one of none, linear, got 'lineer'"),
        ([], "repair: at least one of none, linear is needed"),
        (["linear", "linear"], "repair: 'linear' appears twice"),
    ],
)
def test_bad_repair_lists_fail_with_the_field(tmp_path: Path, repair: list, message: str) -> None:
    with pytest.raises(SpecError) as info:
        parse_spec(tiny_job(tmp_path, tmp_path / "m", repair=repair))
    assert str(info.value) == message


CHECKPOINT_BASE = {
    "name": "c",
    "models": [{"ref": "x"}],
    "budgets": [1],
    "methods": [{"name": "lorp"}],
}


def test_checkpoints_are_manifests_unless_the_spec_says_otherwise() -> None:
    assert parse_spec(CHECKPOINT_BASE).checkpoints == "manifest"
    for value in ("full", "none", "manifest"):
        spec = parse_spec(CHECKPOINT_BASE | {"checkpoints": value})
        assert spec.checkpoints == value and spec.saves_checkpoints == (value != "none")
    with pytest.raises(
        SpecError, match="^checkpoints: must be one of manifest, full, none, got 'delta'$"
    ):
        parse_spec(CHECKPOINT_BASE | {"checkpoints": "delta"})


@pytest.mark.parametrize(
    ("older", "read_as"),
    [
        ({"save_checkpoints": False}, "none"),
        ({"save_checkpoints": True}, "manifest"),
        ({"checkpoint_format": "full"}, "full"),
        ({"save_checkpoints": True, "checkpoint_format": "full"}, "full"),
        ({"save_checkpoints": False, "checkpoint_format": "manifest"}, "none"),
    ],
)
def test_the_older_checkpoint_fields_still_run_with_one_notice(
    older: dict,
    read_as: str,
    caplog: pytest.LogCaptureFixture,  # type: ignore[type-arg]
) -> None:
    with caplog.at_level(logging.WARNING, logger="pipeline"):
        spec = parse_spec(CHECKPOINT_BASE | older)
        again = dataclasses.replace(spec, name="d")  # checked again: no second notice
    assert spec.checkpoints == again.checkpoints == read_as
    assert spec.save_checkpoints is None and spec.checkpoint_format is None
    spelled = ", ".join(f"{k}: {str(v).lower()}" for k, v in older.items())
    assert [r.getMessage() for r in caplog.records] == [
        f"job spec: {spelled}: read as `checkpoints: {read_as}`, the field that replaces it"
    ]


def test_checkpoints_beside_an_older_spelling_or_a_bad_older_value_is_refused() -> None:
    with pytest.raises(
        SpecError, match=r"^checkpoints: set it alone \(save_checkpoints is its older spelling\)$"
    ):
        parse_spec(CHECKPOINT_BASE | {"checkpoints": "full", "save_checkpoints": True})
    with pytest.raises(
        SpecError, match="^checkpoint_format: must be one of full, manifest, got 'delta'$"
    ):
        parse_spec(CHECKPOINT_BASE | {"checkpoint_format": "delta"})


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            {"tracking": {"materialize": "all"}},
            "tracking.materialize: must be one of none, best, got 'all'",
        ),
        (
            {"tracking": {"materialize": "best", "register": False}},
            "tracking.materialize: needs tracking.register: true (it writes out the registry's "
            "aliases)",
        ),
        (
            {"tracking": {"materialize": "best"}, "checkpoints": "none"},
            "tracking.materialize: needs stored variants (checkpoints: manifest or full), got "
            "checkpoints: none",
        ),
    ],
)
def test_materialize_is_refused_where_it_has_nothing_to_write(
    overrides: dict, message: str
) -> None:
    assert parse_spec(CHECKPOINT_BASE).tracking.materialize == "none"
    assert parse_spec(CHECKPOINT_BASE | {"tracking": {"materialize": "best"}}).tracking
    with pytest.raises(SpecError) as info:
        parse_spec(CHECKPOINT_BASE | overrides)
    assert str(info.value) == message


@pytest.mark.parametrize(
    ("granularity", "methods", "message"),
    [
        (["layer"], [{"name": "shortgpt"}], "granularity[0]: must be one of"),
        ([], [{"name": "shortgpt"}], "granularity: at least one of block"),
        (["attention", "attention"], [{"name": "shortgpt"}], "granularity: "),
        (
            ["block", "mlp"],
            [{"name": "lorp-loss"}],
            "methods[0]: 'lorp-loss' has no sub-layer form",
        ),
    ],
)
def test_a_granularity_or_a_method_without_its_form_is_refused_in_one_line(
    tmp_path: Path, granularity: list, methods: list, message: str
) -> None:
    spec = tiny_job(tmp_path, tmp_path / "m", granularity=granularity, methods=methods)
    with pytest.raises(SpecError) as exc:
        parse_spec(spec)
    assert message in str(exc.value) and "\n" not in str(exc.value)


def test_granularity_is_block_unless_the_spec_says_otherwise(tmp_path: Path) -> None:
    spec = parse_spec(tiny_job(tmp_path, tmp_path / "m"))
    assert spec.granularity == ("block",) and not spec.sublayers
    one = [{"name": "lorp"}, {"name": "shortgpt"}]
    mixed = parse_spec(
        tiny_job(tmp_path, tmp_path / "m", granularity=["block", "mixed"], methods=one)
    )
    assert mixed.granularity == ("block", "mixed") and mixed.sublayers


def test_a_method_label_that_a_sub_layer_point_would_take_is_refused(tmp_path: Path) -> None:
    methods = [{"name": "shortgpt"}, {"name": "lorp", "label": "shortgpt-attention"}]
    spec = tiny_job(tmp_path, tmp_path / "m", methods=methods, granularity=["block", "attention"])
    with pytest.raises(SpecError) as exc:
        parse_spec(spec)
    assert str(exc.value) == (
        "methods: 'shortgpt-attention' appears twice (a sub-layer point's label is "
        "<label>-<granularity>)"
    )
