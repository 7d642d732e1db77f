"""The documentation site builds strictly, and its generated reference pages say what the
code defines: every `JobSpec` field and every core catalog column, with no drift."""

from __future__ import annotations

import dataclasses
import html
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.catalog.row import CORE_SCHEMA
from pipeline.spec.job import JobSpec
from tests.helpers.paths import REPO

ENV = os.environ | {"NO_MKDOCS_2_WARNING": "1", "DISABLE_MKDOCS_2_WARNING": "true"}


def build(root: Path, site: Path) -> subprocess.CompletedProcess[str]:
    mkdocs = Path(sys.executable).with_name("mkdocs")
    cmd = [str(mkdocs), "build", "--strict", "-f", str(root / "mkdocs.yml"), "-d", str(site)]
    return subprocess.run(cmd, cwd=root, env=ENV, capture_output=True, text=True, timeout=300)


def copy_site(tmp: Path) -> Path:
    """The docs and the code they are generated from, in a scratch copy to break."""
    root = tmp / "repo"
    for name in ("docs", "pipeline", "lorp"):
        shutil.copytree(REPO / name, root / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "mkdocs.yml", root / "mkdocs.yml")
    return root


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    run = build(REPO, out)
    assert run.returncode == 0, run.stderr[-3000:]
    return out


def text_of(site: Path, page: str) -> str:
    return (site / page / "index.html").read_text()


def test_the_job_spec_page_has_every_field_of_every_section(site: Path) -> None:
    page = text_of(site, "reference/job-spec")
    sections = [JobSpec]
    while sections:
        cls = sections.pop()
        for f in dataclasses.fields(cls):
            assert f"<code>{f.name}</code>" in page, f"{cls.__name__}.{f.name}"
            inner = getattr(f.default_factory, "__dataclass_fields__", None)
            if inner is not None:
                sections.append(f.default_factory)  # type: ignore[arg-type]
    assert "Per capture worker (one loaded model, many shards)." in page  # a docstring


def test_the_catalog_page_has_every_core_column_with_its_type(site: Path) -> None:
    page = text_of(site, "reference/catalog-schema")
    for field in CORE_SCHEMA:
        kind = html.escape(str(field.type), quote=False)
        assert f"<code>{field.name}</code></td>\n<td><code>{kind}</code>" in page, field.name


def test_a_core_column_without_a_meaning_stops_the_build(tmp_path: Path) -> None:
    root = copy_site(tmp_path)
    row = root / "pipeline" / "catalog" / "row.py"
    text = row.read_text()
    field = '    """The lorp that wrote it."""\n'
    assert field in text
    row.write_text(text.replace(field, field + "    new_column: str | None = None\n"))
    run = build(root, tmp_path / "site")
    assert run.returncode != 0
    assert "core columns without a meaning ['new_column']" in run.stderr + run.stdout


def test_a_broken_link_and_a_page_left_out_of_the_nav_fail_the_build(tmp_path: Path) -> None:
    root = copy_site(tmp_path)
    (root / "docs" / "orphan.md").write_text("# Orphan\n")
    run = build(root, tmp_path / "orphan")
    assert run.returncode != 0 and "orphan.md" in run.stderr
    (root / "docs" / "orphan.md").unlink()
    index = root / "docs" / "index.md"
    index.write_text(index.read_text() + "\n[gone](guides/no-such-page.md)\n")
    run = build(root, tmp_path / "broken")
    assert run.returncode != 0 and "no-such-page.md" in run.stderr
