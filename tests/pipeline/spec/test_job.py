"""The job's own fields (`pipeline.spec.job`): the repair list, ridge, followers and
distillation settings."""

from __future__ import annotations

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


def test_the_checkpoint_format_is_full_or_manifest() -> None:
    base = {"name": "c", "models": [{"ref": "x"}], "budgets": [1], "methods": [{"name": "lorp"}]}
    assert parse_spec(base).checkpoint_format == "full"
    assert parse_spec(base | {"checkpoint_format": "manifest"}).checkpoint_format == "manifest"
    with pytest.raises(
        SpecError, match="^checkpoint_format: must be one of full, manifest, got 'delta'$"
    ):
        parse_spec(base | {"checkpoint_format": "delta"})
