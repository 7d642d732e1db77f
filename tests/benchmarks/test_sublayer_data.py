"""benchmarks/sublayer_data.py: the windows the sub-layer benchmarks measure on, in batches
(`prepared` loads a packaged model; the benchmarks' runs exercise it)."""

from __future__ import annotations

import sys

import torch

from tests.helpers.paths import REPO

sys.path.insert(0, str(REPO))

from benchmarks.sublayer_data import batches_of  # noqa: E402


def test_windows_are_cut_into_batches_in_order_the_last_one_short() -> None:
    windows = torch.arange(5 * 3).reshape(5, 3)
    got = batches_of(windows.tolist(), size=2)
    assert [b.shape[0] for b in got] == [2, 2, 1]
    assert torch.equal(torch.cat(got), windows)
