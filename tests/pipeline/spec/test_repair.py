"""A job's repair settings as one value (`pipeline.spec.repair.RepairSettings`): read from
the job's top-level fields, a method's own distillation epochs over the job's, and the
ridge as the fit takes it."""

from __future__ import annotations

from pathlib import Path

from pipeline.spec.models import MethodSpec
from pipeline.spec.parse import parse_spec
from pipeline.spec.repair import RepairSettings
from tests.helpers.job_specs import tiny_job


def job(**fields):  # type: ignore[no-untyped-def]
    return parse_spec(tiny_job(Path("/runs"), Path("/model"), **fields))


def test_the_settings_are_the_jobs_top_level_repair_fields() -> None:
    settings = job(
        repair=["linear"],
        repair_rounds=7,
        repair_ridge=0.5,
        repair_followers=2,
        repair_distill=3,
        repair_distill_lr=0.01,
        repair_gate=False,
    ).repair_settings
    assert settings == RepairSettings(("linear",), 7, 0.5, 2, 3, 0.01, False)


def test_a_job_without_repair_fields_has_the_defaults() -> None:
    settings = job(repair=["none", "linear"]).repair_settings
    assert settings == RepairSettings()
    assert (settings.rounds, settings.ridge, settings.followers) == (100, "auto", 1)
    assert (settings.distill, settings.distill_lr, settings.gate) == (0, 1e-4, True)


def test_a_methods_own_distillation_epochs_win_over_the_jobs() -> None:
    settings = RepairSettings(distill=3)
    assert settings.distill_epochs(MethodSpec("shortgpt", repair_distill=5)) == 5
    assert settings.distill_epochs(MethodSpec("shortgpt", repair_distill=0)) == 0  # its own 0
    assert settings.distill_epochs(MethodSpec("shortgpt")) == 3
    assert settings.distill_epochs(None) == 3  # the dense point has no method
    spec = job(repair_distill=2, methods=[{"name": "shortgpt", "repair_distill": 4}])
    assert spec.repair_settings.distill_epochs(spec.methods[0]) == 4
    assert spec.repair_settings.distill_epochs(MethodSpec("lorp")) == 2


def test_the_ridge_value_is_none_for_auto_else_a_float() -> None:
    assert RepairSettings(ridge="auto").ridge_value is None
    assert RepairSettings(ridge=0.25).ridge_value == 0.25
    one = job(repair_ridge=1).repair_settings.ridge_value  # an integer in the YAML
    assert one == 1.0 and isinstance(one, float)
