"""Writes the reference pages from the code's own definitions at every `mkdocs build`
(mkdocs-gen-files), so they cannot drift from it:

- `reference/job-spec.md`: every section and field of `JobSpec`, its type, its default and
  the docstring the dataclass gives it;
- `reference/catalog-schema.md`: the catalog's typed core columns, `CatalogRow`'s fields
  in their order, each with its type (`CORE_SCHEMA`) and its docstring, then the figures
  and what each means (`FIGURES`). A core column without a docstring stops the build.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
import sys
import textwrap
import typing
from pathlib import Path
from typing import Any

import mkdocs_gen_files

ROOT = Path(__file__).resolve().parents[1]
FRAGMENTS = Path(__file__).resolve().parent / "fragments"
"""Hand-written parts of the generated pages (excluded from the site as pages)."""
sys.path.insert(0, str(ROOT))

from pipeline.catalog.row import CORE_SCHEMA, FIGURES, CatalogRow  # noqa: E402
from pipeline.spec.job import JobSpec  # noqa: E402


def field_docs(cls: type) -> dict[str, str]:
    """A dataclass's attribute docstrings (the string right after each field)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for node, after in zip(body, body[1:], strict=False):
        named = isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
        if named and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant):
            docs[node.target.id] = " ".join(str(after.value.value).split())
    return docs


def type_name(tp: Any) -> str:
    text = str(tp).replace("typing.", "").replace("NoneType", "None")
    text = re.sub(r"<class '([\w.]+)'>", lambda m: m.group(1).rsplit(".", 1)[-1], text)
    return re.sub(r"\bpipeline(?:\.\w+)*\.(\w+)", r"\1", text)


def default_of(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        return f"`{f.default!r}`"
    if f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
        return "see below" if dataclasses.is_dataclass(value) else f"`{value!r}`"
    return "required"


def section(cls: type, path: str, out: list[str], seen: set[type]) -> None:
    """One table for `cls` at `path`, then one for each nested dataclass."""
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    title = f"`{path}`" if path else "The job (top level)"
    out += [f"## {title}", "", f"`{cls.__name__}`: {cls.__doc__.splitlines()[0]}", ""]
    out += ["| field | type | default | meaning |", "| --- | --- | --- | --- |"]
    nested = []
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        inner = [a for a in (typing.get_args(tp) or (tp,)) if dataclasses.is_dataclass(a)]
        name = f"{path}.{f.name}" if path else f.name
        meaning = docs.get(f.name, "").replace("|", "\\|").replace("<", "&lt;")
        kind = type_name(tp).replace(" | ", " or ")
        out.append(f"| `{f.name}` | `{kind}` | {default_of(f)} | {meaning} |")
        for a in inner:
            if a not in seen:
                seen.add(a)
                suffix = "[]" if typing.get_origin(tp) is tuple else ""
                nested.append((a, name + suffix))
    out.append("")
    for a, name in nested:
        section(a, name, out, seen)


def job_spec_page() -> str:
    notes = (FRAGMENTS / "job-spec-notes.md").read_text()
    out = ["# Job spec reference", "", notes.strip(), ""]
    section(JobSpec, "", out, {JobSpec})
    return "\n".join(out) + "\n"


def fragment() -> tuple[str, str]:
    """(text before the tables, text after them) of catalog-columns.md, split at its
    `<!-- tables -->` line."""
    before, _, after = (FRAGMENTS / "catalog-columns.md").read_text().partition("<!-- tables -->")
    return before, after


def cell(text: str) -> str:
    return text.replace("|", "\\|")


def catalog_page() -> str:
    before, after = fragment()
    meanings = field_docs(CatalogRow)
    core = {f.name: str(f.type) for f in CORE_SCHEMA}
    missing = sorted(set(core) - set(meanings))
    if missing:
        raise SystemExit(
            f"pipeline/catalog/row.py: core columns without a meaning {missing} "
            "(each CatalogRow field needs its docstring)"
        )
    out = ["# Catalog schema", "", before.strip(), "", "## Core columns", ""]
    out += ["`pipeline.catalog.row.CatalogRow`'s fields, in their order.", ""]
    out += ["| column | type | meaning |", "| --- | --- | --- |"]
    out += [f"| `{name}` | `{tp}` | {cell(meanings[name])} |" for name, tp in core.items()]
    figures = [f"| `{n}` | {cell(m)} |" for n, m in FIGURES.items()]
    out += ["", "## Figures", "", "Float columns added as a job measures them.", ""]
    out += ["| column | meaning |", "| --- | --- |", *figures, "", after.strip()]
    return "\n".join(out) + "\n"


with mkdocs_gen_files.open("reference/job-spec.md", "w") as fh:
    fh.write(job_spec_page())
with mkdocs_gen_files.open("reference/catalog-schema.md", "w") as fh:
    fh.write(catalog_page())
