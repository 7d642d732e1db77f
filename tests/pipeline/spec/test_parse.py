"""Parsing a job YAML (`pipeline.spec.parse`): defaults, every bad field named in one line,
and the shipped job specs."""

from __future__ import annotations

import pytest

from pipeline.spec.checks import SpecError
from pipeline.spec.parse import parse_spec
from tests.helpers.paths import REPO
from tests.helpers.spec_dicts import GOOD


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
        (
            {"methods": [{"name": "shortgpt", "repair_options": {"epochs": 2}}]},
            "methods[0].repair_options: only a peer recipe takes them, and 'shortgpt' is none",
        ),
        (
            {"methods": [{"name": "replaceme", "repair_options": {"rounds": 2}}]},
            "methods[0].repair_options: option 'rounds': cosine-map takes epochs, lr",
        ),
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
        ({"name": ".exp"}, "name: must not start with '.' (stores hide it), got '.exp'"),
        (
            {"models": [{"ref": "a", "name": "org/m"}, {"ref": "b", "name": "org_m"}]},
            "models: 'org/m' and 'org_m' are both stored as a directory 'org_m'; give one a "
            "distinct name",
        ),
        (
            {"models": [{"ref": "a", "name": "org.m"}, {"ref": "b", "name": "org-m"}]},
            "models: 'org.m' and 'org-m' are both stored as a registered model name 'org-m'",
        ),
        (  # no letter registry_stem keeps: registered as `lorp-model`, as `model` is
            {"models": [{"ref": "a", "name": "Модель"}, {"ref": "b", "name": "model"}]},
            "models: 'Модель' and 'model' are both stored as a registered model name 'model'; "
            "give one a distinct name",
        ),
        (
            {
                "methods": [
                    {"name": "lorp", "label": "my method"},
                    {"name": "shortgpt", "label": "my_method"},
                ]
            },
            "methods: 'my method' and 'my_method' are both stored as a directory 'my_method'",
        ),
        (  # a repaired twin's directory, `lorp+linear` -> `lorp_linear`
            {
                "methods": [{"name": "lorp"}, {"name": "shortgpt", "label": "lorp_linear"}],
                "repair": ["none", "linear"],
            },
            "methods: 'lorp+linear' and 'lorp_linear' are both stored as a directory 'lorp_linear'",
        ),
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
        (
            {"experts": {"budgets": [1.5]}},
            "experts.budgets[0]: a fraction must be in (0, 1), got 1.5",
        ),
        (
            {"experts": {"budgets": [0]}},
            "experts.budgets[0]: an expert count must be >= 1, got 0",
        ),
        (
            {"experts": {"budgets": [2], "methods": ["magnitude"]}},
            "experts.methods[0]: must be one of reap, frequency, random, got 'magnitude'",
        ),
        ({"experts": {"budgets": [2, 2]}}, "experts.budgets: 2 appears twice"),
        ({"experts": {"budget": [2]}}, "experts.budget: unknown key"),
    ],
)
def test_bad_spec_names_the_field(patch: dict, message: str) -> None:
    data = GOOD | patch
    with pytest.raises(SpecError) as exc:
        parse_spec(data)
    assert message in str(exc.value) and "\n" not in str(exc.value)


def test_safe_defaults_in_shipped_specs() -> None:
    from pipeline.spec.parse import load_spec

    root = REPO
    for path in (root / "jobs").glob("*.yaml"):
        spec = load_spec(path)
        assert not any(m.trust_remote_code or m.allow_pickle for m in spec.models), path


ROOT = REPO


@pytest.mark.integration
def test_shipped_job_specs_parse() -> None:
    from pipeline.spec.parse import load_spec

    for path in sorted((ROOT / "jobs").glob("*.yaml")):
        first = path.read_text().splitlines()[0]
        assert first.startswith("# ") and "lorp run jobs/" in first, path
        spec = load_spec(path)
        assert spec.models and spec.methods and spec.budgets
