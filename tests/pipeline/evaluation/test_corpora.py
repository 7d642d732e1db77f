"""Corpora by name (`pipeline.evaluation.corpora`): what each hub short name resolves to, a
hub that cannot be reached failing in one line, and the packaged held-out corpus `lee`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.evaluation.corpora import (
    EVAL_SPLITS,
    HUB_CORPORA,
    hub_corpus,
    load_any_corpus,
    metric_name,
)
from tests.helpers.paths import REPO

ROOT = REPO


@pytest.mark.parametrize("name", ["c4", "allenai/c4"])
def test_c4_is_the_first_en_shard_of_each_split(name: str) -> None:
    corpus = hub_corpus(name)
    assert corpus is not None
    assert corpus.load_args("train") == {
        "path": "allenai/c4",
        "split": "train",
        "data_files": {"train": "en/c4-train.00000-of-01024.json.gz"},
    }
    assert corpus.load_args("validation") == {
        "path": "allenai/c4",
        "split": "validation",
        "data_files": {"validation": "en/c4-validation.00000-of-00008.json.gz"},
    }
    assert EVAL_SPLITS[name] == "validation"
    assert metric_name(name) == "ppl_c4"


def test_c4_refuses_a_split_with_no_pinned_file() -> None:
    corpus = hub_corpus("c4")
    assert corpus is not None
    with pytest.raises(ValueError, match=r"allenai/c4 has no split 'test' here"):
        corpus.load_args("test")
    # Through the loader: one line naming the dataset, before any download.
    with pytest.raises(ValueError, match=r"^dataset 'c4' \(test\) cannot be loaded: .*") as err:
        load_any_corpus("c4", "test")
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("name", ["wikitext2", "wikitext"])
def test_wikitext2_is_the_raw_v1_config(name: str) -> None:
    corpus = hub_corpus(name)
    assert corpus is not None
    assert corpus.load_args("test") == {
        "path": "Salesforce/wikitext",
        "name": "wikitext-2-raw-v1",
        "split": "test",
    }
    assert EVAL_SPLITS[name] == "test"


def test_every_table_entry_pins_its_eval_split() -> None:
    for name, corpus in HUB_CORPORA.items():
        assert corpus.load_args(corpus.eval_split)["split"] == corpus.eval_split, name
    assert hub_corpus("ptb") is None and EVAL_SPLITS["ptb"] == "test"
    assert hub_corpus("someone/dataset") is None


def test_an_unknown_short_name_is_not_sent_to_the_hub() -> None:
    with pytest.raises(ValueError, match=r"^unknown corpus 'c5': not a file or an alias"):
        load_any_corpus("c5", "train")


LOAD = """
import sys
from pipeline.evaluation.corpora import load_any_corpus
try:
    load_any_corpus(sys.argv[1], sys.argv[2])
except ValueError as exc:
    print(f"ValueError: {exc}")
"""


@pytest.mark.parametrize(
    ("name", "split"), [("allenai/c4", "train"), ("c4", "validation"), ("wikitext2", "test")]
)
def test_an_unreachable_hub_fails_in_one_line_naming_the_dataset(
    name: str, split: str, tmp_path: Path
) -> None:
    # An empty cache too, so nothing cached on this machine can answer instead.
    env = os.environ | {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path)}
    out = subprocess.run(
        [sys.executable, "-c", LOAD, name, split],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert len(lines) == 1, out.stdout
    assert lines[0].startswith(f"ValueError: dataset {name!r} ({split}) cannot be loaded: ")
    repo = hub_corpus(name).repo  # type: ignore[union-attr]
    assert repo in lines[0]
