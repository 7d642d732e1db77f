"""benchmarks/pages.py: a results page's marked section rewritten with the rest kept,
appended where the page has none, a new page started; and the markdown tables."""

from __future__ import annotations

from pathlib import Path

from benchmarks.pages import by_model, cpu_line, markers, replace_section, row, rule, table


def test_the_marked_section_is_rewritten_and_the_rest_kept(tmp_path: Path) -> None:
    begin, end = markers("x")
    assert (begin, end) == ("<!-- x:begin -->", "<!-- x:end -->")
    page = tmp_path / "x.md"
    page.write_text(f"# X\n\nprose\n\n{begin}\nold\n{end}\n\nafter\n")
    replace_section(page, begin, end, "new", "Figures")
    assert page.read_text() == f"# X\n\nprose\n\n{begin}\nnew\n{end}\n\nafter\n"
    other = markers("y")
    replace_section(page, *other, "more", "More figures")
    assert page.read_text().endswith(f"after\n\n## More figures\n\n{other[0]}\nmore\n{other[1]}\n")


def test_a_new_page_starts_from_its_text(tmp_path: Path) -> None:
    begin, end = markers("x")
    page = tmp_path / "new.md"
    replace_section(page, begin, end, "body", "Figures", f"# New\n\n{begin}\n{end}\n")
    assert page.read_text() == f"# New\n\n{begin}\nbody\n{end}\n"
    replace_section(page, begin, end, "again", "Figures", "# Not written: the page exists\n")
    assert page.read_text() == f"# New\n\n{begin}\nagain\n{end}\n"
    bare = tmp_path / "bare.md"
    replace_section(bare, begin, end, "body", "Figures", "# Bare\n")
    assert bare.read_text() == f"# Bare\n\n## Figures\n\n{begin}\nbody\n{end}\n"


def test_tables_and_rows() -> None:
    assert row(["a", 1, 2.5]) == "| a | 1 | 2.5 |"
    assert rule(3) == "| --- | --- | --- |"
    assert rule(2, tight=True) == "|---|---|"
    assert table(("x", "y"), [(1, 2)], tight=True) == ["| x | y |", "|---|---|", "| 1 | 2 |"]
    rows = [{"model": "b", "i": 0}, {"model": "a", "i": 1}, {"model": "b", "i": 2}]
    assert {m: [r["i"] for r in rs] for m, rs in by_model(rows).items()} == {"a": [1], "b": [0, 2]}
    assert list(by_model(rows)) == ["a", "b"]


AMD = (
    "processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu avx512f avx512_bf16\n\nprocessor\t: 1\n"
)


def test_cpu_line_names_the_bfloat16_units_the_timings_ran_on() -> None:
    assert cpu_line(AMD, cores=2) == "AMD EPYC, 2 cores, AVX-512 BF16, no AMX"
    intel = "model name\t: Intel(R) Xeon(R)\nflags\t: avx512_bf16 amx_bf16 amx_tile\n"
    assert cpu_line(intel, cores=2) == "Intel(R) Xeon(R), 2 cores, AMX bfloat16 tiles"
    assert cpu_line("", cores=1) == "an unnamed CPU, 1 core, no bfloat16 matrix units"
