"""The fleet pages' figures (`dashboards.figures`): Gantt bars sit where their times say."""

from __future__ import annotations

import pytest

from tests.helpers.dashboard_data import timeline_events


def test_gantt_bars_sit_where_their_times_say() -> None:
    import xml.etree.ElementTree as ET

    from dashboards.figures import Gantt, gantt_svg, stage_colour, time_ticks
    from dashboards.timeline_view import timeline_view

    tv = timeline_view(timeline_events())
    svg = ET.fromstring(gantt_svg(tv))
    assert (svg.get("data-bars"), svg.get("data-rows")) == ("8", "4")
    rects = [r for r in svg.iter("rect") if r.get("data-stage")]
    assert len(rects) == 8
    g = Gantt(42.0, (1, 1, 1, 2))  # the driver's overlapping spans take two lanes
    assert float(svg.get("height")) == 5 * g.row_h + g.axis_h
    px = g.plot / 42.0
    for r in rects:
        start, end, row = (
            float(r.get("data-start")),
            float(r.get("data-end")),
            int(r.get("data-row")),
        )
        assert float(r.get("x")) == pytest.approx(g.label + start * px, abs=0.01)
        assert float(r.get("width")) == pytest.approx((end - start) * px, abs=0.01)
        lane = int(r.get("data-lane"))
        top = min(row, 3) * g.row_h + lane * g.row_h  # rows above: one lane each
        assert float(r.get("y")) == pytest.approx(top + (g.row_h - g.bar_h) / 2)
        assert r.get("fill") == stage_colour(r.get("data-stage"))
        assert r.find("title").text  # a tooltip on every bar
    point = next(r for r in rects if r.get("data-stage") == "point")
    assert float(point.get("x")) == pytest.approx(170 + 12 * 880 / 42, abs=0.01)  # 421.43
    assert float(point.get("width")) == pytest.approx(28 * 880 / 42, abs=0.01)  # 586.67
    assert point.get("data-row") == "1" and point.get("data-failed") == "true"
    assert point.get("stroke") == "#b3263a"
    prep_b = next(
        r for r in rects if r.get("data-stage") == "prepare" and r[0].text.startswith("b:")
    )
    assert float(prep_b.get("y")) == pytest.approx(4 * 18 + 2.5)  # the driver's 2nd lane
    assert sum(r.get("fill") == "url(#gantt-failed)" for r in svg.iter("rect")) == 1  # hatched
    # Row labels, bottom to top the driver last; tick labels in s under a 2-minute span.
    labels = [t.find("title").tail for t in svg.iter("text") if t.get("class") == "worker"]
    assert labels == ["n1/pid 1", "n1/pid 2", "n2/pid 7", "driver"]
    ticks = [t.text for t in svg.iter("text") if t.get("class") == "tick"]
    assert ticks == ["0 s", "5 s", "10 s", "15 s", "20 s", "25 s", "30 s", "35 s", "40 s"]
    assert time_ticks(600.0)[1] == (60, "1 min") and time_ticks(4 * 3600.0)[1] == (1800, "0.5 h")
