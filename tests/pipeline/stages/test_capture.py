"""Capture workers (`pipeline.stages.capture`): how many, from the spec."""

from __future__ import annotations

from pipeline.stages.capture import capture_workers


def test_capture_workers_come_from_the_spec() -> None:
    assert capture_workers(3, None) == 3  # one per shard, whatever the cluster holds now
    assert capture_workers(3, 8) == 3 and capture_workers(3, 2) == 2
