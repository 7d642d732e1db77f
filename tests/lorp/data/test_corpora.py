"""Corpora read as documents from the packaged PTB and from local files of every format; a bad
one refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from lorp.data.corpora import load_corpus


def test_ptb_splits() -> None:
    train, test = load_corpus("ptb", "train"), load_corpus("ptb", "test")
    assert len(train.documents) == 1 and train.documents[0].startswith("aer banknote")
    assert load_corpus("ptb", "validation").split == "valid"
    assert train.fingerprint != test.fingerprint
    with pytest.raises(ValueError, match="no split 'dev2'"):
        load_corpus("ptb", "dev2")


def test_local_files(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("one document")
    (tmp_path / "b.jsonl").write_text('{"text": "x y"}\n{"text": "z"}\n')
    (tmp_path / "c.json").write_text(json.dumps(["p", "q", ""]))
    pq.write_table(pa.table({"text": ["d1", "d2", None]}), tmp_path / "d.parquet")
    assert load_corpus(str(tmp_path / "a.txt")).documents == ("one document",)
    assert load_corpus(str(tmp_path / "b.jsonl")).documents == ("x y", "z")
    assert load_corpus(str(tmp_path / "c.json")).documents == ("p", "q")
    assert load_corpus(str(tmp_path / "d.parquet")).documents == ("d1", "d2")
    (tmp_path / "empty.txt").write_text("  \n")
    with pytest.raises(ValueError, match="is empty"):
        load_corpus(str(tmp_path / "empty.txt"))
    unknown = "unknown corpus 'c4x': not a file or an alias \\(ptb, lee, wiki, code\\)"
    with pytest.raises(ValueError, match=unknown):
        load_corpus("c4x")
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "e.parquet")
    with pytest.raises(ValueError, match="no 'text' column"):
        load_corpus(str(tmp_path / "e.parquet"))


def test_the_held_out_news_corpus_is_packaged() -> None:
    test, valid = load_corpus("lee", "test"), load_corpus("lee", "valid")
    assert len(test.documents) == 300 and len(valid.documents) == 50
    assert test.documents[0].startswith("Hundreds of people have been forced to vacate")
    assert "£" in " ".join(valid.documents)  # the Latin-1 file decoded, not mangled
    assert sum(len(d.split()) for d in test.documents) == 59_890
    with pytest.raises(ValueError, match="corpus 'lee' has no split 'train'"):
        load_corpus("lee", "train")
