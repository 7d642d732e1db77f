"""Job specs: every bad input is one line naming the field, exit code 2, nothing written."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from lorp.cli import main
from pipeline.spec.checks import SpecError
from pipeline.spec.parse import parse_spec
from tests.helpers.paths import REPO

LORP = shutil.which("lorp") or str(Path(sys.executable).parent / "lorp")
GOOD = {
    "name": "t",
    "models": [{"ref": "smollm2-135m"}],
    "budgets": [4, 0.25],
    "methods": [{"name": "lorp", "options": {"variant": "released"}}, {"name": "shortgpt"}],
}


def test_good_spec_defaults() -> None:
    spec = parse_spec(GOOD)
    assert spec.budgets == (4, 0.25) and spec.methods[0].options == {"variant": "released"}
    assert spec.calibration.samples == 128 and spec.calibration.seq_len == 2048
    assert spec.models[0].trust_remote_code is False and spec.models[0].allow_pickle is False
    assert spec.resources.capture.num_gpus == 0


@pytest.mark.parametrize(
    ("patch", "message"),
    [
        ({"nmae": "x"}, "nmae: unknown key (known: budgets, cache_dir, calibration"),
        ({"calibration": {"sampels": 3}}, "calibration.sampels: unknown key"),
        (
            {"calibration": {"samples": "many"}},
            "calibration.samples: expected an integer, got str 'many'",
        ),
        ({"calibration": {"samples": 0}}, "calibration.samples: must be an integer >= 1, got 0"),
        (
            {"calibration": {"samples": 2, "shards": 3}},
            "calibration.shards: 3 shards for 2 samples",
        ),
        ({"budgets": [4, 0]}, "budgets[1]: a block count must be >= 1, got 0"),
        ({"budgets": [1.5]}, "budgets[0]: a fraction must be in (0, 1), got 1.5"),
        ({"budgets": ["4"]}, "budgets[0]: expected an integer, got str '4'"),
        ({"budgets": 4}, "budgets: expected a list, got int 4"),
        ({"methods": [{"name": "lorpp"}]}, "methods[0].name: unknown method 'lorpp'"),
        (
            {"methods": [{"name": "shortgpt", "options": {"k": 2}}]},
            "methods[0].options: method 'shortgpt' has no option 'k'",
        ),
        ({"methods": [{"name": "lorp"}, {"name": "lorp"}]}, "methods: 'lorp' appears twice"),
        ({"models": [{"ref": "x", "dtype": "fp8"}]}, "models[0].dtype: must be one of float32"),
        (
            {"models": [{"ref": "x", "trust_remote_code": "yes"}]},
            "models[0].trust_remote_code: expected true or false",
        ),
        ({"models": []}, "models: at least one model is needed"),
        (
            {"resources": {"grid": {"num_gpus": -1}}},
            "resources.grid.num_gpus: must be >= 0, got -1",
        ),
        (
            {"resources": {"grid": {"memory_gib": -1}}},
            "resources.grid.memory_gib: must be a number > 0, got -1",
        ),
        (
            {"resources": {"capture": {"memory_gib": "lots"}}},
            "resources.capture.memory_gib: expected a number, got str 'lots'",
        ),
        ({"name": "a b"}, "name: letters, digits"),
        (
            {"evaluation": {"speed_budget_s": 0}},
            "evaluation.speed_budget_s: must be a number > 0, got 0",
        ),
        (
            {"evaluation": {"speed_half_width": 0.5}},
            "evaluation.speed_half_width: must be a number in (0, 0.5), got 0.5",
        ),
        (
            {"evaluation": {"backend": "transformers", "serving": {}}},
            "evaluation.serving: needs the vllm backend (or auto), got backend 'transformers'",
        ),
        (
            {"evaluation": {"serving": {"rounds": 2}}},
            "evaluation.serving.rounds: must be an integer >= 4, got 2",
        ),
        (
            {"evaluation": {"serving": {"concurrenc": 2}}},
            "evaluation.serving.concurrenc: unknown key",
        ),
    ],
)
def test_bad_spec_names_the_field(patch: dict, message: str) -> None:
    data = GOOD | patch
    with pytest.raises(SpecError) as exc:
        parse_spec(data)
    assert message in str(exc.value) and "\n" not in str(exc.value)


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


def test_credentials_are_redacted_from_printed_uris() -> None:
    from pipeline.records.tracking import redact

    assert (
        redact("https://alice:s3cret@mlflow.example:5000/x") == "https://***@mlflow.example:5000/x"
    )
    assert redact("sqlite:////tmp/run/mlflow.db") == "sqlite:////tmp/run/mlflow.db"


def test_safe_defaults_in_shipped_specs() -> None:
    from pipeline.spec.parse import load_spec

    root = REPO
    for path in (root / "jobs").glob("*.yaml"):
        spec = load_spec(path)
        assert not any(m.trust_remote_code or m.allow_pickle for m in spec.models), path


def test_how_long_the_speed_pass_times_leaves_grid_keys_alone() -> None:
    """A catalog's points stay done when only the speed pass's budget or interval
    changes (`--force-speed` re-times); asking for serving changes the figures, so the key.
    The key of a job without serving is what it was before serving existed."""
    from pipeline.plan import evaluation_key
    from pipeline.spec.evaluation import EvaluationSpec, ServingSpec

    base = evaluation_key(EvaluationSpec(), "vllm")
    assert "serving" not in base and "speed_budget_s" not in base
    timed = EvaluationSpec(speed_budget_s=30.0, speed_half_width=0.05)
    assert evaluation_key(timed, "vllm") == base
    served = evaluation_key(EvaluationSpec(serving=ServingSpec()), "vllm")
    assert served != base and served["serving"]["concurrency"] == 64
