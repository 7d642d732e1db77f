"""The packaged code corpus (`code`): the Python source of four well-known pure-Python
projects, split into train, valid and test by file, so no file is in two splits.

The projects (`CODE_PACKAGES`) are installed with every lorp (torch needs networkx and
jinja2; click and requests come with its tooling), pinned in
`constraints/packaged-models.txt`, and read as files, never imported. They are four
styles of Python a code model serves: numerical library code with long docstrings
(networkx), a template engine's parser and compiler (jinja2), a command-line framework
(click) and an HTTP client (requests). Each file is one document, headed by a comment
naming its path. Files shorter than `MIN_FILE_CHARS` (empty `__init__`s) and exact copies
are dropped.

A file's split comes from its content hash (`CODE_SPLITS`: 1 in 10 test, 1 in 10 valid):
it never moves, whatever other files the projects add. Within a split the files are
interleaved round-robin over the projects (each project's in hash order), so the first
windows a perplexity evaluation takes, which are the first tokens of the split, cover
every project rather than one.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
from pathlib import Path

CODE_PACKAGES: dict[str, str] = {
    "networkx": "networkx==3.6.1",
    "jinja2": "jinja2==3.1.6",
    "click": "click==8.5.1",
    "requests": "requests==2.34.2",
}
"""Import name -> the pinned distribution the corpus is built from."""
CODE_SPLITS = {"test": 0, "valid": 1}
"""Split -> the residue of a file's hash (mod 10) that puts it there; the rest is train."""
MIN_FILE_CHARS = 200


def code_documents(split: str) -> tuple[str, ...]:
    """The split's files, each a document (module docstring); a one-line ValueError for an
    unknown split or a project that is not installed."""
    if split not in ("train", *CODE_SPLITS):
        raise ValueError(f"corpus 'code' has no split {split!r} (splits: train, valid, test)")
    seen: set[str] = set()
    per_package: list[list[tuple[str, str]]] = []
    for package, pinned in CODE_PACKAGES.items():
        files = []
        for path, text in _sources(package, pinned):
            digest = hashlib.sha256(text.encode()).hexdigest()
            if digest in seen or len(text) < MIN_FILE_CHARS:
                continue
            seen.add(digest)
            if _split_of(digest) == split:
                files.append((digest, f"# {path}\n{text}"))
        per_package.append([doc for _, doc in sorted(files)])
    return tuple(_round_robin(per_package))


def code_versions() -> dict[str, str]:
    """The installed version of each project (what the corpus read)."""
    return {p: importlib.metadata.version(p) for p in CODE_PACKAGES}


def _split_of(digest: str) -> str:
    residue = int(digest[:8], 16) % 10
    return next((s for s, r in CODE_SPLITS.items() if r == residue), "train")


def _sources(package: str, pinned: str) -> list[tuple[str, str]]:
    """(path relative to the site directory, text) of every .py file of `package`."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"corpus 'code' needs {package}: pip install --no-deps {pinned}")
    root = Path(spec.submodule_search_locations[0])
    out = []
    for path in sorted(root.rglob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        out.append((str(path.relative_to(root.parent)), text))
    return out


def _round_robin(groups: list[list[str]]) -> list[str]:
    out = []
    for i in range(max((len(g) for g in groups), default=0)):
        out.extend(g[i] for g in groups if i < len(g))
    return out
