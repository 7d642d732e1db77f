"""The results pages the benchmark scripts write (docs/results/): a page's marked section
rewritten, the rest of the page kept, and the markdown tables in it.

A script owns the part of its page between two markers, `<!-- name:begin -->` and
`<!-- name:end -->`; the prose around them is written by hand and never touched. Nothing
here imports more than the standard library: the GPU script runs it on a device image
that has torch, transformers and `lorp/` only.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any


def markers(name: str) -> tuple[str, str]:
    """The begin and end markers of the section `name` of a page."""
    return f"<!-- {name}:begin -->", f"<!-- {name}:end -->"


def replace_section(
    path: Path, begin: str, end: str, body: str, heading: str, new_page: str | None = None
) -> None:
    """Put `body` between the `begin`/`end` markers of `path`, or append it under `heading`
    where the page has no such markers. `new_page`: the text of the page where it does not
    exist yet (its title, perhaps with the markers)."""
    if new_page is not None and not path.exists():
        path.write_text(new_page)
    text = path.read_text()
    block = f"{begin}\n{body}\n{end}"
    if begin in text:
        text = text[: text.index(begin)] + block + text[text.index(end) + len(end) :]
    else:
        text += f"\n## {heading}\n\n{block}\n"
    path.write_text(text)


def row(cells: Iterable[Any]) -> str:
    """One markdown table row: `| a | b |`."""
    return f"| {' | '.join(str(c) for c in cells)} |"


def rule(columns: int, tight: bool = False) -> str:
    """The rule under a table's header: `| --- | --- |`, or `|---|---|` where `tight`."""
    return "|---" * columns + "|" if tight else "| --- " * columns + "|"


def table(head: Sequence[str], rows: Iterable[Iterable[Any]], tight: bool = False) -> list[str]:
    """A markdown table's lines: its header, the rule, a line per row."""
    return [row(head), rule(len(head), tight), *(row(r) for r in rows)]


def by_model(rows: Iterable[Mapping[str, Any]]) -> dict[str, list[Any]]:
    """Catalog (or result) rows grouped by their `model`, models in name order, each
    model's rows in the order given."""
    out: dict[str, list[Any]] = {}
    for r in rows:
        out.setdefault(r["model"], []).append(r)
    return dict(sorted(out.items()))


def cpu_line(cpuinfo: str | None = None, cores: int | None = None) -> str:
    """The CPU a page's figures were measured on, in one line: its model name, the cores
    this process may use and its bfloat16 matrix units (AMX, AVX-512 BF16, or none),
    from `/proc/cpuinfo` (`cpuinfo`: that file's text). Timings from different CPUs are
    not comparable: one idle core's bfloat16 matmul was about four times float32's on a
    CPU with AMX and 2.3 times on one with AVX-512 BF16 alone."""
    if cpuinfo is None:
        info = Path("/proc/cpuinfo")
        cpuinfo = info.read_text() if info.exists() else ""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    flags = set(fields.get("flags", "").split())
    if "amx_bf16" in flags:
        units = "AMX bfloat16 tiles"
    elif "avx512_bf16" in flags:
        units = "AVX-512 BF16, no AMX"
    else:
        units = "no bfloat16 matrix units"
    if cores is None:
        affinity = getattr(os, "sched_getaffinity", None)
        cores = len(affinity(0)) if affinity else os.cpu_count() or 1
    return (
        f"{fields.get('model name', 'an unnamed CPU')}, {cores} core{'s' * (cores != 1)}, {units}"
    )
