"""The pipeline's subcommands (`pipeline.cli`): `lorp run` refuses bad input in one line,
exit code 2, nothing written; `lorp catalog ls` refuses what is not a catalog."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

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
