"""The pipeline's subcommands (`pipeline.cli`): `lorp run` refuses bad input in one line,
exit code 2, nothing written; `lorp catalog ls` refuses what is not a catalog."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from lorp.cli import main
from tests.helpers.cli_runner import lorp
from tests.helpers.spec_dicts import GOOD

LORP = shutil.which("lorp") or str(Path(sys.executable).parent / "lorp")


def run_cli(tmp_path: Path, text: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    spec = tmp_path / "job.yaml"
    spec.write_text(text)
    code = main(["run", str(spec)])
    return code, capsys.readouterr().err


def test_cli_malformed_yaml(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, err = run_cli(tmp_path, "name: [unclosed\nmodels: x\n", capsys)
    assert code == 2 and "malformed YAML at line 2" in err and err.count("\n") == 1


@pytest.mark.parametrize(
    ("models", "budgets", "message"),
    [
        ([{"ref": "no-such-model"}], [2], "models[0].ref: unknown model 'no-such-model'"),
        (
            [{"ref": "smollm2-135m"}],
            [29],
            "budgets[0]: budget must leave the 2 boundary blocks: 1 <= blocks <= 28",
        ),
        ([{"ref": "smollm2-135m"}], [0.001], "budgets[0]: budget must leave the 2 boundary blocks"),
    ],
)
def test_cli_model_level_errors_write_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], models: list, budgets: list, message: str
) -> None:
    data = GOOD | {"models": models, "budgets": budgets, "output_dir": str(tmp_path / "run")}
    code, err = run_cli(tmp_path, yaml.safe_dump(data), capsys)
    assert code == 2 and message in err and err.count("\n") == 1, err
    assert not (tmp_path / "run").exists()


def test_seq_len_above_model_maximum(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = GOOD | {"calibration": {"seq_len": 100000}, "output_dir": str(tmp_path / "run")}
    code, err = run_cli(tmp_path, yaml.safe_dump(data), capsys)
    assert (
        code == 2
        and "calibration.seq_len: 100000 (+1 BOS unless bos: never) exceeds smollm2-135m's "
        "max_position_embeddings 8192"
        in err
    )
    assert not (tmp_path / "run").exists()


def test_missing_spec_file_via_console_script(tmp_path: Path) -> None:
    out = subprocess.run(
        [LORP, "run", str(tmp_path / "nope.yaml")], capture_output=True, text=True, timeout=300
    )
    assert (
        out.returncode == 2 and "job spec not found" in out.stderr and out.stderr.count("\n") == 1
    )


@pytest.mark.integration
def test_catalog_ls_refuses_what_is_not_a_catalog(tmp_path: Path) -> None:
    (tmp_path / "x.parquet").write_text("no")
    out = lorp("catalog", "ls", str(tmp_path / "x.parquet"))
    assert out.returncode != 0 and "is not a parquet catalog" in out.stderr
    out = lorp("catalog", "ls", str(tmp_path))
    assert out.returncode != 0 and "no catalog at" in out.stderr
    out = lorp("catalog", "ls", str(tmp_path / "missing"))
    assert out.returncode != 0 and "catalog not found" in out.stderr
    assert os.path.exists(tmp_path / "x.parquet")


def _cut_weights(model: Path) -> None:
    """A copy cut off halfway (a full disk, a killed transfer)."""
    f = model / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def _garbled_header(model: Path) -> None:
    f = model / "model.safetensors"
    f.write_bytes(b"\xff" * 8 + f.read_bytes()[8:])


def _no_weights(model: Path) -> None:
    (model / "model.safetensors").unlink()


def _no_weights_pickle_allowed(model: Path) -> dict[str, Any]:
    """Neither safetensors nor .bin weights, in an entry that allows pickled weights."""
    (model / "model.safetensors").unlink()
    return {"allow_pickle": True}


def _emptied(model: Path) -> None:
    """A file created and never written (a transfer killed before its first byte)."""
    (model / "model.safetensors").write_bytes(b"")


def _cut_stray_copy(model: Path) -> None:
    """A second file cut off beside whole weights (a `cp` into the directory interrupted):
    the weights check reads the checkpoint's own file; the fingerprint reads every one."""
    f = model / "model.safetensors"
    (model / "model-copy.safetensors").write_bytes(f.read_bytes()[: f.stat().st_size // 2])


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (
            _cut_weights,
            r"model\.safetensors' is truncated: its header lists [\d,]+ bytes, "
            r"the file holds [\d,]+$",
        ),
        (
            _garbled_header,
            r"model\.safetensors' is truncated or not a safetensors file \(its "
            r"header claims [\d,]+ bytes, the file holds [\d,]+\)$",
        ),
        (
            _no_weights,
            r"has no \.safetensors weights \(pickled \.bin weights load only when "
            r"the spec allows them\)$",
        ),
        (_no_weights_pickle_allowed, r"has no weights \(\.safetensors or \.bin\)$"),
        (_emptied, r"model\.safetensors' is not a safetensors file \(shorter than 8 bytes\)$"),
        (
            _cut_stray_copy,
            r"model-copy\.safetensors' is not a readable safetensors file: "
            r"\S.*$",
        ),  # then safetensors' own reason
    ],
)
def test_a_damaged_checkpoint_is_one_line_naming_its_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], damage: Any, message: str
) -> None:
    """`lorp run` and `lorp plan` refuse a checkpoint whose weights are cut short, garbled
    or missing in one line naming the file (it was a 29-line safetensors traceback)."""
    from tests.helpers.tiny_models import save_tiny

    model = save_tiny("llama", tmp_path / "model")
    entry = {"ref": str(model)} | (damage(model) or {})  # a damage may set entry fields
    capsys.readouterr()  # transformers' progress bar while saving
    data = GOOD | {"models": [entry], "budgets": [1], "output_dir": str(tmp_path / "run")}
    spec = tmp_path / "job.yaml"
    spec.write_text(yaml.safe_dump(data))
    assert main(["run", str(spec)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("models[0].ref: "), err
    assert re.search(message, err.strip()), err
    assert main(["plan", str(spec)]) == 2
    problems = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("problem: ")]
    assert problems == [f"problem: {err.strip()}"]
    assert not (tmp_path / "run").exists()


def plan_problems(tmp_path: Path, data: dict, capsys: pytest.CaptureFixture[str]) -> list[str]:
    """`lorp plan` of the spec `data` (exit code 2): its problem lines. Asked before `lorp
    run`, so a check that regresses fails the test instead of starting the job."""
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(data))
    assert main(["plan", str(tmp_path / "job.yaml")]) == 2
    return [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("problem: ")]


def test_serving_longer_than_the_context_is_refused_while_planning(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`lorp run` and `lorp plan` refuse it from the model's config, before vLLM starts."""
    serving = {"prompt_len": 8000, "output_len": 256}
    data = GOOD | {"evaluation": {"serving": serving}, "output_dir": str(tmp_path / "run")}
    message = (
        "evaluation.serving: prompt_len 8000 + output_len 256 exceeds smollm2-135m's "
        "max_position_embeddings 8192"
    )
    assert plan_problems(tmp_path, data, capsys) == [f"problem: {message}"]
    code, err = run_cli(tmp_path, yaml.safe_dump(data), capsys)
    # (the first use of the packaged model converts it, and says so above the error)
    assert code == 2 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1] == message
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("field", ["catalog", "storage", "output_dir"])
def test_a_location_that_cannot_be_written_is_refused_before_any_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], field: str
) -> None:
    """A shared catalog (or storage, or run directory) below a file: one line naming the
    field, the location and the file in the way, from `lorp run` and `lorp plan`; nothing
    written anywhere."""
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory\n")
    where = str(blocker / "lorp" / field)
    data = GOOD | {"output_dir": str(tmp_path / "run"), field: where}
    message = f"{field}: {where!r} cannot be written: {str(blocker)!r} is a file, not a directory"
    assert plan_problems(tmp_path, data, capsys) == [f"problem: {message}"]
    code, err = run_cli(tmp_path, yaml.safe_dump(data), capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert err.strip() == message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file", "job.yaml"]
    assert blocker.read_text() == "not a directory\n"


@pytest.mark.parametrize("field", ["catalog", "storage"])
def test_a_location_without_write_permission_is_refused_before_any_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, field: str
) -> None:
    """A shared catalog (or storage) in a directory this user may not write: one line
    naming the field, the location and the directory, from `lorp run` and `lorp plan`."""
    import pipeline.storage.store

    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    if os.geteuid() == 0:  # root writes anywhere: deny it the directory as a user is denied
        real = os.access
        deny = lambda p, mode: Path(p) != locked and real(p, mode)  # noqa: E731
        monkeypatch.setattr(pipeline.storage.store.os, "access", deny)
    where = str(locked / field)
    data = GOOD | {"output_dir": str(tmp_path / "run"), field: where}
    message = f"{field}: {where!r} cannot be written: no permission to write in {str(locked)!r}"
    assert plan_problems(tmp_path, data, capsys) == [f"problem: {message}"]
    code, err = run_cli(tmp_path, yaml.safe_dump(data), capsys)
    assert code == 2 and err.strip() == message and err.count("\n") == 1, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["job.yaml", "locked"]
    assert not any(locked.iterdir())
