"""The dashboard built from a real demo-sized catalog, opened in headless Chromium."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import ray
from tiny_models import save_tiny_ptb

from dashboards.site import build_site
from pipeline.catalog import read_catalog
from pipeline.run import run_job
from pipeline.spec import parse_spec

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
ARTIFACTS = Path(__file__).resolve().parents[1] / "test-artifacts"
pytestmark = [pytest.mark.integration]


@pytest.fixture(scope="module")
def catalog(tmp_path_factory) -> tuple[list[dict], Path]:  # type: ignore[no-untyped-def]
    root = tmp_path_factory.mktemp("dash")
    spec = {
        "name": "dash",
        "output_dir": str(root / "run"),
        "cache_dir": str(root / "cache"),
        "models": [
            {"ref": str(save_tiny_ptb("llama", root / "llama")), "name": "tiny-llama"},
            {"ref": str(save_tiny_ptb("qwen3", root / "qwen3", n_blocks=8)), "name": "tiny-qwen3"},
        ],
        "budgets": [1, 2],
        "methods": [{"name": "lorp"}, {"name": "shortgpt"}, {"name": "streamline"}],
        "calibration": {
            "dataset": "ptb",
            "samples": 8,
            "seq_len": 48,
            "shards": 2,
            "batch_size": 4,
        },
        "evaluation": {"perplexity": ["ptb"], "seq_len": 48, "max_windows": 2, "speed_repeats": 1},
        "save_checkpoints": False,
    }
    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING")
    try:
        run_job(parse_spec(spec))
    finally:
        ray.shutdown()
    return read_catalog(root / "run" / "catalog.parquet"), root


def test_site_files_and_content(catalog, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    rows, _ = catalog
    index = build_site(rows, tmp_path / "site")
    pages = sorted(p.name for p in (tmp_path / "site").iterdir())
    assert pages == ["index.html", "model-tiny-llama.html", "model-tiny-qwen3.html"]
    text = index.read_text()
    # Nothing fetched at view time: no external src/href (MLflow links point at loopback).
    assert not re.findall(r'(?:src|href)="https?://(?!127\.0\.0\.1)', text)
    assert "<script src" not in text and "<link" not in text and "@import" not in text
    page = (tmp_path / "site" / "model-tiny-qwen3.html").read_text()
    assert page.count('class="layer-map"') == 6  # 3 methods x 2 budgets
    assert "Table 2 layout" in page and "<figcaption>" in page


@pytest.mark.skipif(CHROMIUM is None, reason="Debian chromium is not installed")
def test_pages_in_headless_chromium(catalog, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    playwright = pytest.importorskip("playwright.sync_api")
    rows, _ = catalog
    index = build_site(rows, tmp_path / "site")
    ARTIFACTS.mkdir(exist_ok=True)
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=CHROMIUM,
            args=["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run"],
        )  # fmt: skip
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        errors: list[str] = []
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(index.as_uri())
        assert page.locator("#overview tbody tr").count() == 2  # one row per model
        # Filtering by family hides the other model; sorting by N puts the 6-block one first.
        page.select_option('select[data-filter="family"]', "Qwen3")
        assert page.locator("#overview tbody tr:visible").count() == 1
        page.select_option('select[data-filter="family"]', "")
        page.locator("#overview th", has_text="N").first.click()
        assert page.locator("#overview tbody tr").first.inner_text().startswith("tiny-llama")
        page.screenshot(path=str(ARTIFACTS / "dashboard-overview.png"), full_page=True)

        page.click("text=tiny-qwen3")
        assert page.locator("svg.layer-map").count() == 6
        assert page.locator("figure").count() >= 4
        page.screenshot(path=str(ARTIFACTS / "dashboard-model.png"), full_page=True)
        browser.close()
    assert errors == []
    assert (ARTIFACTS / "dashboard-overview.png").stat().st_size > 10_000
