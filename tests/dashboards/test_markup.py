"""The HTML builder (`dashboards.markup`): text and attributes escaped unless `Markup`."""

from __future__ import annotations

from dashboards.markup import Markup, el


def test_markup_escapes_text_and_attributes() -> None:
    html = el("td", "<b>&", Markup("<i>ok</i>"), class_="l", data_v='"x"', hidden=True)
    assert html == '<td class="l" data-v="&quot;x&quot;" hidden>&lt;b&gt;&amp;<i>ok</i></td>'
