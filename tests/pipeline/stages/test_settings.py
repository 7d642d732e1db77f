"""Where a job's S files and selections are cached (`pipeline.stages.settings.stats_store`):
its `cache_dir`, else `stats/` in its storage, else lorp's cache (`$LORP_CACHE/stats`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.stages.settings import stats_store


@pytest.fixture(autouse=True)
def lorp_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("LORP_CACHE", str(tmp_path / "lorp-cache"))
    return tmp_path / "lorp-cache"


def test_the_jobs_cache_dir_comes_first(tmp_path: Path) -> None:
    store = stats_store(str(tmp_path / "mine"), str(tmp_path / "shared"))
    assert store.uri() == str((tmp_path / "mine").resolve())


def test_without_a_cache_dir_s_is_cached_in_the_storages_stats(tmp_path: Path) -> None:
    store = stats_store(None, str(tmp_path / "shared"))
    assert store.uri() == str((tmp_path / "shared" / "stats").resolve())
    uri = stats_store(None, (tmp_path / "shared").as_uri())  # a file:// storage alike
    assert uri.local_path() == (tmp_path / "shared" / "stats").resolve()


def test_with_neither_s_is_cached_in_lorps_cache(lorp_cache: Path) -> None:
    assert stats_store(None, None).uri() == str((lorp_cache / "stats").resolve())
    assert stats_store("", "").uri() == str((lorp_cache / "stats").resolve())  # empty: unset
