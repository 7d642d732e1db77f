"""`calibration:` (`pipeline.spec.calibration`): a weighted mix of corpora, and its bad parts
named."""

from __future__ import annotations

import pytest

from tests.helpers.spec_dicts import calibration_job as _spec


def test_a_calibration_mix_is_parsed_and_bad_parts_named() -> None:
    from pipeline.spec.checks import SpecError

    cal = _spec([{"name": "ptb", "weight": 3}, {"name": "wiki"}]).calibration
    assert cal.corpora == ["ptb", "wiki"] and cal.parts == [("ptb", 3.0), ("wiki", 1.0)]
    assert _spec("ptb").calibration.parts == [("ptb", 1.0)]
    with pytest.raises(SpecError, match=r"calibration\.dataset\[1\]\.weight: must be a number > 0"):
        _spec([{"name": "ptb"}, {"name": "wiki", "weight": -1}])
    with pytest.raises(SpecError, match="'ptb' appears twice"):
        _spec([{"name": "ptb"}, {"name": "ptb", "weight": 2}])
