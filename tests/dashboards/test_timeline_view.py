"""The job's timeline as data (`dashboards.timeline_view`): rows of worker slots, bars,
lanes and the headline figures, from hand-made events."""

from __future__ import annotations

import pytest

from tests.helpers.dashboard_data import timeline_events


def test_timeline_view_rows_bars_and_figures() -> None:
    from dashboards.timeline_view import timeline_view
    from pipeline.events.timeline import summarise

    events = timeline_events()
    tv = timeline_view(events)
    assert tv is not None and tv["job"] == "tl<job>"
    # One row per worker, by node then first start; the driver's row last.
    assert [r["key"] for r in tv["rows"]] == ["n1/pid 1", "n1/pid 2", "n2/pid 7", "driver"]
    assert tv["rows"][1]["busy"] == 38.0 and tv["rows"][3]["busy"] == 0.0
    assert tv["makespan"] == 42.0 and tv["t0"] == 1000.0
    # Bars: seconds since the attempt's first span, on their worker's row.
    bars = {(b["stage"], b["model"]): b for b in tv["bars"]}
    assert len(tv["bars"]) == 8  # the earlier attempt's span and the cut one are not drawn
    assert (bars["point", "b"]["row"], bars["point", "b"]["start"], bars["point", "b"]["end"]) == (
        1,
        12.0,
        40.0,
    )
    assert bars["point", "b"]["failed"] and not bars["load", "b"]["failed"]
    assert (bars["gate", "a"]["row"], bars["losses", "a"]["row"]) == (3, 2)
    # Overlapping spans on one row (the driver's prepares) take a lane each; a later span
    # goes back to the first free lane.
    assert [r["lanes"] for r in tv["rows"]] == [1, 1, 1, 2]
    lanes = [bars[k]["lane"] for k in [("prepare", "a"), ("prepare", "b"), ("gate", "a")]]
    assert lanes == [0, 1, 0]
    tip = bars["point", "b"]["tip"]
    assert tip.startswith("b p1: point, 28.00 s (from 12.00 s) on n1/pid 2") and "FAILED" in tip
    assert "selection lorp, step 2" in bars["losses", "a"]["tip"]
    assert tv["stages"] == ["load", "capture", "losses", "point", "prepare", "gate"]
    # Headline figures are summarise's: busy 78 slot-s over 4 slots x 42 s; chain a = 40 s.
    u = summarise(events[:-1])  # summarise itself expects every span to have its times
    h = tv["headline"]
    assert h["utilisation"] == u.utilisation == pytest.approx(78 / 168)
    assert (h["slots"], h["kind"], h["busy"], h["lower_bound"]) == (4.0, "CPU", 78.0, 40.0)
    assert (h["chain"], h["chain_model"], h["ratio"]) == (40.0, "a", pytest.approx(42 / 40))
    a, b = tv["models"]
    assert (a["model"], a["first"], a["last"], a["busy"], a["spans"]) == ("a", 0.0, 42.0, 40.0, 5)
    assert a["stages"] == ["prepare", "load", "capture", "losses", "gate"]
    assert (b["first"], b["last"], b["busy"], b["failed"]) == (0.5, 40.0, 38.0, 1)
    assert b["stages"] == ["prepare", "load", "point"]
    assert [r["unit"] for r in tv["running"]] == ["u1"]
    # No span in the latest attempt (an old run, or one just started): no view.
    assert timeline_view(events[:2] + [{"event": "start"}]) is None
    assert timeline_view([]) is None
