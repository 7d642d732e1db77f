"""The dashboard built from a real demo-sized catalog, opened in headless Chromium.

The catalog comes from the real pipeline; `with_gate_and_accuracy` then marks some
variants degraded and adds zero-shot columns (the tiny job runs no zero-shot tasks), so
the badges, intervals and the "all degraded" overview cell are exercised on real rows.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from dashboards.site import build_site, legacy_tracking
from pipeline.catalog.table import read_catalog
from pipeline.driver.run import run_job
from pipeline.spec.parse import parse_spec
from tests.helpers.paths import REPO
from tests.helpers.ray_cluster import local_ray
from tests.helpers.tiny_models import save_tiny_ptb

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
ARTIFACTS = REPO / "test-artifacts"
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
        # Speed off: the pipeline's speed pass is checked by the CLI test; here its columns
        # are written in by `with_gate_and_accuracy`, as accuracy is.
        "evaluation": {"perplexity": ["ptb"], "seq_len": 48, "max_windows": 2, "speed": False},
        "checkpoints": "none",
        "repair": ["none"],
        "resources": {"capture_workers": 1},  # one model load per model, as tiny_job's
    }
    with local_ray():
        run_job(parse_spec(spec))
    return read_catalog(root / "run" / "catalog"), root


def with_gate_and_accuracy(rows: list[dict]) -> list[dict]:
    """Every tiny-qwen3 variant at budget 2 degraded; arc_easy on 60 items (under 100),
    boolq on 3270 (comparable) for every row; speed figures under the bound N/(N-k)."""
    out = []
    for r in rows:
        r = dict(r)
        r["degraded"] = r["model"] == "tiny-qwen3" and r["budget"] == 2
        r.update(acc_arc_easy=40.0, n_arc_easy=60.0, acc_boolq=62.0, n_boolq=3270.0)
        n, k = r["n_blocks"], r["budget"]
        speedup = 1.0 + 0.9 * (n / (n - k) - 1.0)
        r.update(speedup=speedup, speedup_std=0.01, latency_dense_ms=10.0)
        r.update(latency_ms=10.0 / speedup, peak_mem_gib=0.5 * (n - k) / n)
        out.append(r)
    return out


def _site(catalog, out: Path) -> Path:  # type: ignore[no-untyped-def]
    rows, root = catalog
    rows = with_gate_and_accuracy(rows)
    # As `lorp dashboard` does: the rows' own tracking columns, else the run's sqlite store.
    return build_site(
        rows,
        out,
        fallback_tracking=legacy_tracking(root / "run", rows),
        events_file=root / "run" / "events.jsonl",  # the job's timeline page
    )


def test_site_files_and_content(catalog, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    index = _site(catalog, tmp_path / "site")
    pages = sorted(p.name for p in (tmp_path / "site").iterdir())
    assert pages == [
        "index.html",
        "model-tiny-llama.html",
        "model-tiny-qwen3.html",
        "timeline.html",
    ]
    text = index.read_text()
    # Nothing fetched at view time: no external src/href (MLflow links point at loopback).
    assert not re.findall(r'(?:src|href)="https?://(?!127\.0\.0\.1)', text)
    assert "<script src" not in text and "<link" not in text and "@import" not in text
    # Run links and the command that serves them come from the run's own records.
    assert len(re.findall(r'href="http://127\.0\.0\.1:5000/#/experiments/\w+/runs/\w+"', text)) == 2
    assert "mlflow ui --host 127.0.0.1 --backend-store-uri " in text
    if catalog[0][0].get("tracking_uri"):  # catalogs that record their store name it
        assert f"--backend-store-uri {catalog[0][0]['tracking_uri']}<" in text
    page = (tmp_path / "site" / "model-tiny-qwen3.html").read_text()
    assert page.count('class="layer-map"') == 6  # 3 methods x 2 budgets
    assert page.count('data-degraded="true"') == 3  # the three budget-2 variants
    assert page.count('class="cluster-strip"') == 1
    assert "Table 2 layout" in page and "Table 3 layout" in page and "<figcaption>" in page
    # arc_easy: 40% of 60 items -> +- 1.96 * sqrt(0.4 * 0.6 / 60) = 12.40, marked.
    assert "40.00 \u00b1 12.40" in page and "62.00 \u00b1 1.66" in page
    assert "bound N/(N-k)" in page


def test_pages_in_headless_chromium(catalog, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    import playwright.sync_api as playwright

    assert CHROMIUM, "the dashboard tests need Debian's chromium (make test installs it)"
    index = _site(catalog, tmp_path / "site")
    ARTIFACTS.mkdir(exist_ok=True)
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=CHROMIUM,
            args=[
                "--no-sandbox",
                "--disable-gpu",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--no-first-run",
            ],
        )
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        errors: list[str] = []
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(index.as_uri())
        check_overview(page)
        page.screenshot(path=str(ARTIFACTS / "dashboard-overview.png"), full_page=True)

        page.click("text=tiny-qwen3")
        check_model_page(page)
        page.screenshot(path=str(ARTIFACTS / "dashboard-model.png"), full_page=True)

        page.go_back()
        page.click("nav.pages >> text=job timeline")
        check_timeline_page(page, catalog[1] / "run" / "events.jsonl")
        page.screenshot(path=str(ARTIFACTS / "dashboard-timeline.png"), full_page=True)
        browser.close()
    assert errors == []
    assert (ARTIFACTS / "dashboard-overview.png").stat().st_size > 10_000


def check_overview(page) -> None:  # type: ignore[no-untyped-def]
    rows = page.locator("#overview tbody tr")
    assert rows.count() == 2  # one row per model
    # Best per budget skips degraded variants; every budget-2 variant of qwen3 is degraded.
    qwen = page.locator("#overview tbody tr", has_text="tiny-qwen3")
    assert "none (all degraded)" in qwen.inner_text()
    assert "none (all degraded)" not in rows.filter(has_text="tiny-llama").inner_text()
    # Filtering by family hides the other model; sorting by N puts the 6-block one first.
    page.select_option('select[data-filter="family"]', "Qwen3")
    assert page.locator("#overview tbody tr:visible").count() == 1
    page.select_option('select[data-filter="family"]', "")
    page.locator("#overview th", has_text="N").first.click()
    assert rows.first.inner_text().startswith("tiny-llama")
    assert page.locator("table.jobs code", has_text="--backend-store-uri").count() == 1


def check_model_page(page) -> None:  # type: ignore[no-untyped-def]
    assert page.locator("svg.layer-map").count() == 6
    assert page.locator("svg.cluster-strip").count() == 1
    assert page.locator("figure").count() >= 4
    # Degraded variants: a visible badge in the maps and in every table, rows tinted.
    badges = page.locator(".maps .badge.degraded")
    assert badges.count() == 3 and badges.first.is_visible()
    assert page.locator("table.sortable tr.degraded").count() == 3 * 3  # ppl, acc, speed
    # Intervals: the small task carries a visible dagger, the large one none.
    acc = page.locator("table.sortable", has=page.locator("th", has_text="acc_arc_easy"))
    assert acc.locator("td[data-flag=small] .mark.small").first.is_visible()
    assert "\u00b1 12.40" in acc.inner_text() and "\u00b1 1.66" in acc.inner_text()
    # Sorting a later table sorts by its own column (the header index is per table).
    acc.locator("th", has_text="acc_boolq").click()
    assert acc.locator("tbody tr").count() == 7


def check_timeline_page(page, events_file: Path) -> None:  # type: ignore[no-untyped-def]
    """The job's Gantt chart: one bar per span of the latest attempt, the utilisation
    figure `summarise` gives, the driver's row last."""
    from pipeline.events.log import read_events
    from pipeline.events.timeline import attempt, spans_of, summarise

    events = read_events(events_file)
    spans = spans_of(attempt(events))
    assert page.url.endswith("/timeline.html") and len(spans) > 0
    bars = page.locator("svg.gantt rect[data-stage]")
    assert bars.count() == len(spans)
    assert page.locator("svg.gantt").get_attribute("data-bars") == str(len(spans))
    assert {"load", "capture", "point"} <= set(page.locator("ul.legend li").all_inner_texts())
    util = summarise(events)
    assert util is not None
    shown = page.locator('td[data-figure="utilisation"]').inner_text()
    assert shown.startswith(f"{100 * util.utilisation:.1f}% ")
    slots = f"{util.slots:g} {util.kind}"
    assert page.locator('td[data-figure="slots"]').inner_text() == slots
    assert util.chain_model in page.locator('td[data-figure="chain"]').inner_text()
    assert page.locator("h1").inner_text() == "Timeline: dash"
    names = "els => els.map(e => e.lastChild.textContent)"  # the label after its <title>
    workers = page.eval_on_selector_all("svg.gantt text.worker", names)
    assert workers[-1] == "driver" and len(workers) >= 2
    # Bars are on screen, each with its tooltip.
    first = bars.first
    assert first.is_visible() and first.locator("title").text_content()
    assert page.locator("#timeline-models tbody tr").count() == 2  # one row per model


def shared_catalog(catalog, root: Path) -> tuple[Path, str, str]:  # type: ignore[no-untyped-def]
    """A shared catalog of two jobs: the module's job (protocol A), and another job that
    measured tiny-llama again on 32-token windows (protocol B; perplexities made 10%
    higher, one variant's far lower at twice the parameters, so the front has a choice)."""
    import json

    from pipeline.catalog.protocol import protocol_id
    from pipeline.catalog.shared import SharedCatalog

    rows = with_gate_and_accuracy(catalog[0])
    other = []
    for r in rows:
        if r["model"] != "tiny-llama":
            continue
        ev = json.loads(r["evaluation"]) | {"seq_len": 32}
        r = dict(r, job="other", grid_key=r["grid_key"] + "-b", evaluation=json.dumps(ev))
        r["protocol"] = protocol_id(ev, r["dtype"])
        r["ppl_ptb"] = 1.1 * r["ppl_ptb"]
        other.append(r)
    shared = SharedCatalog(str(root / "shared"))
    shared.publish("run-dash", rows)
    shared.publish("run-other", other)
    return root / "shared", rows[0]["protocol"], other[0]["protocol"]


def front_points(rows: list[dict], protocol: str) -> set[tuple[float, float]]:
    """tiny-llama's Pareto front (params against ppl_ptb) by brute force: the passing
    variants no other passing variant matches or beats on both."""
    pts = [
        (float(r["params"]), float(r["ppl_ptb"]))
        for r in rows
        if r["model"] == "tiny-llama"
        and r["protocol"] == protocol
        and r["method"] != "dense"
        and not r["degraded"]
    ]
    return {p for p in pts if not any(q != p and q[0] <= p[0] and q[1] <= p[1] for q in pts)}


def test_a_shared_catalog_in_headless_chromium(catalog, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """`lorp dashboard <shared catalog>`: one overview line per model and protocol, a
    protocol filter, one page per protocol with its Pareto front."""
    import playwright.sync_api as playwright

    from pipeline.catalog.shared import open_catalog
    from tests.helpers.cli_runner import lorp

    assert CHROMIUM, "the dashboard tests need Debian's chromium (make test installs it)"
    location, a, b = shared_catalog(catalog, tmp_path)
    out = lorp("dashboard", str(location), "--out", str(tmp_path / "site"))
    assert out.returncode == 0, out.stderr
    rows = open_catalog(str(location))
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        page.goto((tmp_path / "site" / "index.html").as_uri())
        lines = page.locator("#overview tbody tr")
        assert lines.count() == 3  # tiny-llama under A and B, tiny-qwen3 under A
        assert "2 models, 2 protocol(s)" in page.locator("h1").inner_text()
        page.select_option('select[data-filter="protocol"]', b)
        assert page.locator("#overview tbody tr:visible").count() == 1
        page.locator("#overview tbody tr:visible a").first.click()
        assert page.url.endswith(f"model-tiny-llama-{b}.html")
        assert page.locator(f'code[data-protocol="{b}"]').count() == 1
        front = page.locator('p.front[data-front="ppl_ptb:params"]').inner_text()
        shown = set(re.findall(r"\(([^,()]+), ([^()]+)\)", front))
        assert shown == {(f"{x:.6g}", f"{y:.4f}") for x, y in front_points(rows, b)}
        assert len(shown) >= 1
        page.screenshot(path=str(ARTIFACTS / "dashboard-shared.png"), full_page=True)
        browser.close()
