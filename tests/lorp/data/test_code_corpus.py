"""The packaged code corpus: four projects' Python files, split by file hash."""

from __future__ import annotations

import pytest

from lorp.data.corpora import alias_domain, load_corpus


def test_the_code_corpus_splits_by_file_and_covers_every_project() -> None:
    from lorp.data.code_corpus import CODE_PACKAGES

    splits = {s: load_corpus("code", s).documents for s in ("train", "valid", "test")}
    names = {s: {d.split("\n", 1)[0] for d in docs} for s, docs in splits.items()}
    assert not names["train"] & names["test"] and not names["valid"] & names["test"]
    assert not names["train"] & names["valid"]
    assert len(splits["test"]) > 40 and len(splits["train"]) > 8 * len(splits["test"]) // 2
    first = [d.split("\n", 1)[0].split("/")[0] for d in splits["test"][: len(CODE_PACKAGES)]]
    assert first == ["# " + p for p in CODE_PACKAGES]  # round-robin over the projects
    assert load_corpus("code", "validation").documents == splits["valid"]
    assert alias_domain("code") == "code" and alias_domain("lee") == "prose"
    assert alias_domain("mine.txt") is None
    with pytest.raises(ValueError, match="corpus 'code' has no split 'dev2'"):
        load_corpus("code", "dev2")
