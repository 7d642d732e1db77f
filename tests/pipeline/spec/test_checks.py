"""The shared checks of every spec section (`pipeline.spec.checks`): storage and catalog
locations that cannot be opened, booleans."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.spec.checks import SpecError
from pipeline.spec.parse import parse_spec
from tests.helpers.job_specs import tiny_job


def test_a_bad_storage_fails_at_the_spec(tmp_path: Path) -> None:
    spec = tiny_job(tmp_path, tmp_path / "model")
    with pytest.raises(SpecError, match=r"^storage: 'xx://a' cannot be opened: .*xx://a"):
        parse_spec(spec | {"storage": "xx://a"})
    assert parse_spec(spec | {"storage": str(tmp_path / "shared")}).storage
    with pytest.raises(SpecError, match=r"^catalog: 'yy://b' cannot be opened: .*yy://b"):
        parse_spec(spec | {"catalog": "yy://b"})
    with pytest.raises(SpecError, match=r"^tracking.reference: expected true or false, got str"):
        parse_spec(spec | {"tracking": {"reference": "yes"}})
