"""benchmarks/paired.py by value: the paired bootstrap on hand cases, McNemar's exact
p-value and the smallest detectable difference against binomial sums done by hand."""

from __future__ import annotations

import math
import sys

import pytest

from tests.helpers.paths import REPO

sys.path.insert(0, str(REPO))

from benchmarks.paired import (  # noqa: E402
    combined,
    detectable,
    discordant,
    interval_side,
    mcnemar_exact,
    mcnemar_side,
    paired_bootstrap,
)


def test_a_constant_difference_has_no_width() -> None:
    """Every resampling of windows that differ by 0.1 nats means 0.1: the interval is the
    point, exp(0.1)."""
    ratio, low, high = paired_bootstrap([3.0, 3.2, 2.9], [2.9, 3.1, 2.8])
    assert ratio == low == high == pytest.approx(math.exp(0.1))


def test_two_windows_give_the_hand_interval() -> None:
    """Differences 0 and x: a resampled mean is 0, x/2 or x with chances 1/4, 1/2, 1/4,
    so the 2.5th and 97.5th percentiles are 0 and x, the estimate exp(x/2)."""
    x = math.log(2.0)
    ratio, low, high = paired_bootstrap([1.0, 1.0 + x], [1.0, 1.0], draws=4000, seed=3)
    assert (ratio, low, high) == pytest.approx((math.sqrt(2.0), 1.0, 2.0))


def test_the_interval_holds_the_estimate_and_inverts_with_the_sides() -> None:
    a = [3.1, 2.7, 3.4, 3.0, 2.9, 3.3, 3.2, 2.8]
    b = [3.0, 2.8, 3.1, 3.0, 2.6, 3.3, 3.0, 2.9]
    ratio, low, high = paired_bootstrap(a, b)
    assert low < ratio < high
    assert paired_bootstrap(a, b) == (ratio, low, high)  # seed 0: the same each time
    back = paired_bootstrap(b, a)
    assert back == pytest.approx((1 / ratio, 1 / high, 1 / low))
    assert interval_side(low, high) == "tie"
    assert (interval_side(0.9, 0.99), interval_side(1.01, 1.2)) == ("first", "second")
    with pytest.raises(ValueError, match="equal"):
        paired_bootstrap(a, b[:-1])


def test_mcnemar_exact_p_by_hand() -> None:
    """b = 1, c = 6: 2 (C(7,0) + C(7,1)) / 2^7 = 16/128; b = 0, c = 6: 2/64."""
    assert mcnemar_exact(1, 6) == pytest.approx(0.125)
    assert mcnemar_exact(6, 1) == pytest.approx(0.125)
    assert mcnemar_exact(0, 6) == pytest.approx(0.03125)
    assert mcnemar_exact(5, 5) == mcnemar_exact(0, 0) == 1.0
    assert (mcnemar_side(0, 6), mcnemar_side(6, 0), mcnemar_side(1, 6)) == (
        "second",
        "first",
        "tie",
    )
    assert discordant("1101", "1010") == (2, 1)


def test_smallest_detectable_difference_by_hand() -> None:
    """10 discordant of 100 items: b = 1, c = 9 gives 2 x 11/1024 = 0.021 (rejected),
    b = 2, c = 8 gives 2 x 56/1024 = 0.109 (not): a gap of 8 items, 8 points. 7 of 200:
    0 against 7 (2/128) is the least, 3.5 points. 5 discordant can never reject (2/32)."""
    assert detectable(100, 10) == pytest.approx(8.0)
    assert detectable(200, 7) == pytest.approx(3.5)
    assert detectable(200, 6) == pytest.approx(3.0)
    assert detectable(100, 5) is None and detectable(100, 0) is None


def test_the_verdict_is_the_side_every_deciding_test_names() -> None:
    assert combined(["tie", "first", "first"]) == "first"
    assert combined(["tie", "tie"]) == combined([]) == "tie"
    assert combined(["first", "second", "tie"]) == "tie"  # they disagree: cannot tell
