"""Writes the reference pages from the code's own definitions at every `mkdocs build`
(mkdocs-gen-files), so they cannot drift from it:

- `reference/job-spec.md`: every section and field of `JobSpec`, its type, its default and
  the docstring the dataclass gives it;
- `reference/catalog-schema.md`: the catalog's typed core columns from `CORE_SCHEMA`, each
  with its meaning from `fragments/catalog-columns.md`. A core column without a meaning,
  or a meaning for a column the schema does not have, stops the build.
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

from pipeline.records.catalog import CORE_SCHEMA  # noqa: E402
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


def column_meanings() -> tuple[str, dict[str, str], str]:
    """(text before the table, column -> meaning, text after) of catalog-columns.md; a row
    may name several columns (`params`, `params_dense`)."""
    text = (FRAGMENTS / "catalog-columns.md").read_text()
    lines = text.splitlines()
    rows = [i for i, line in enumerate(lines) if line.startswith("| `")]
    meanings = {}
    for i in rows:
        cells = [c.strip() for c in lines[i].strip("|").split("|")]
        for name in re.findall(r"`([^`]+)`", cells[0]):
            meanings[name] = cells[-1]
    before = "\n".join(lines[: rows[0] - 2])
    after = "\n".join(lines[rows[-1] + 1 :])
    return before, meanings, after


def catalog_page() -> str:
    before, meanings, after = column_meanings()
    core = {f.name: str(f.type) for f in CORE_SCHEMA}
    missing = sorted(set(core) - set(meanings))
    unknown = sorted(n for n in meanings if n not in core and "<" not in n and n not in METRICS)
    if missing or unknown:
        raise SystemExit(
            f"docs/fragments/catalog-columns.md: core columns without a meaning {missing}, "
            f"meanings of no column {unknown}"
        )
    out = ["# Catalog schema", "", before.strip(), "", "## Core columns", ""]
    out += ["Typed in `pipeline.records.catalog.CORE_SCHEMA`, in its order.", ""]
    out += ["| column | type | meaning |", "| --- | --- | --- |"]
    out += [f"| `{name}` | `{tp}` | {meanings[name]} |" for name, tp in core.items()]
    metric_rows = [f"| `{n}` | {m} |" for n, m in meanings.items() if n not in core]
    out += ["", "## Figures", "", "Float columns added as a job measures them.", ""]
    out += ["| column | meaning |", "| --- | --- |", *metric_rows, "", after.strip()]
    return "\n".join(out) + "\n"


METRICS = {
    "ppl_ratio", "acc_avg", "latency_ms", "latency_dense_ms", "speedup", "speedup_std",
    "speedup_low", "speedup_high", "speedup_measured", "speed_runs", "speed_resolved",
    "serve_output_tps", "serve_ttft_ms", "serve_tpot_ms", "serve_speedup",
    "serve_speedup_measured", "serve_speedup_low", "serve_speedup_high", "serve_resolved",
    "peak_mem_gib", "weight_bytes", "kv_bytes_per_token", "prefill_flops_per_token",
    "decode_bytes_per_token", "predicted_prefill_speedup", "predicted_decode_speedup",
    "n_evals", "select_s", "repair_residual", "repair_held_residual",
    "prefill_flops_per_token_4k", "decode_bytes_per_token_4k", "predicted_decode_speedup_4k",
    "prefill_flops_per_token_32k", "decode_bytes_per_token_32k",
    "predicted_decode_speedup_32k",
}  # fmt: skip
"""Figures (float columns outside the core schema) the meanings table may name."""


with mkdocs_gen_files.open("reference/job-spec.md", "w") as fh:
    fh.write(job_spec_page())
with mkdocs_gen_files.open("reference/catalog-schema.md", "w") as fh:
    fh.write(catalog_page())
