"""A tiny HTML builder: every text and attribute value is escaped unless it is `Markup`.

Pages are assembled from `el(tag, *children, **attrs)` calls, so no caller formats HTML
by hand and a model or method name can never inject markup. Trusted fragments (the SVG
that `figures.py` writes, the inline CSS and script) are wrapped in `Markup` once.
"""

from __future__ import annotations

import html
from collections.abc import Iterable
from typing import Any

VOID = frozenset({"meta", "br", "hr", "img", "input", "link"})


class Markup(str):
    """A string that is already HTML: inserted as is, never escaped again."""

    __slots__ = ()


def esc(value: Any) -> Markup:
    """`value` as HTML text (Markup passes through unchanged)."""
    if isinstance(value, Markup):
        return value
    return Markup(html.escape(str(value)))


def _attr_name(key: str) -> str:
    # class_ -> class, data_v -> data-v: Python keywords and identifiers to HTML names.
    return key.rstrip("_").replace("_", "-")


def attributes(attrs: dict[str, Any]) -> str:
    """` name="value"` pairs; None/False omit the attribute, True writes it bare."""
    out = []
    for key, value in attrs.items():
        if value is None or value is False:
            continue
        name = _attr_name(key)
        out.append(f" {name}" if value is True else f' {name}="{html.escape(str(value))}"')
    return "".join(out)


def _flatten(children: Iterable[Any]) -> Iterable[Any]:
    for child in children:
        if child is None:
            continue
        if isinstance(child, (list, tuple)) or (
            not isinstance(child, str) and isinstance(child, Iterable)
        ):
            yield from _flatten(child)
        else:
            yield child


def frag(*children: Any) -> Markup:
    """Children concatenated, each escaped unless Markup; None is skipped, lists flattened."""
    return Markup("".join(esc(c) for c in _flatten(children)))


def el(tag: str, *children: Any, **attrs: Any) -> Markup:
    """`<tag attrs>children</tag>` (void tags have no children and no end tag)."""
    start = f"<{tag}{attributes(attrs)}>"
    if tag in VOID:
        return Markup(start)
    return Markup(f"{start}{frag(*children)}</{tag}>")


def document(title: str, body: Any, *, css: str, script: str) -> Markup:
    """A whole page with its style and script inline (nothing fetched at view time)."""
    head = el("head", el("meta", charset="utf-8"), el("title", title), el("style", Markup(css)))
    return Markup(
        "<!doctype html>"
        + el("html", head, el("body", body, el("script", Markup(script))), lang="en")
    )
