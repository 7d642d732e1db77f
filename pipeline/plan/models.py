"""Every model of a job resolved and checked before any Ray task, MLflow run or file
exists: its reference, family, context length, budgets and method option values against
N, so every input error surfaces here, naming the field, before the run directory is
created. Pure: no Ray, no MLflow.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lorp.methods import resolve_budget, validate_options
from lorp.models.loading import ModelRef, materialize, parse_model_ref, read_config
from pipeline.plan.grid import ModelPlan
from pipeline.plan.reads import ModelRead, read_model
from pipeline.spec.calibration import CalibrationSpec
from pipeline.spec.checks import SpecError
from pipeline.spec.evaluation import EvaluationSpec
from pipeline.spec.job import JobSpec
from pipeline.spec.models import ModelSpec
from pipeline.storage.store import unwritable


def unwritable_locations(spec: JobSpec) -> list[str]:
    """One line for each local location of the job (its output directory, storage and
    shared catalog) that this process cannot write: found before any work, not when the
    first point is recorded."""
    out = []
    for name, location in (
        ("output_dir", spec.output_dir),
        ("storage", spec.storage),
        ("catalog", spec.catalog),
    ):
        reason = unwritable(location) if location else None
        if reason:
            out.append(f"{name}: {location!r} cannot be written: {reason}")
    return out


def plan_models(spec: JobSpec) -> list[ModelPlan]:
    """Resolve and check every model; all input errors surface here, naming the field."""
    for i, m in enumerate(spec.models):
        try:
            parse_model_ref(m.ref)
        except ValueError as exc:
            raise SpecError(f"models[{i}].ref: {exc}") from None
    return [plan_model(spec, i, m) for i, m in enumerate(spec.models)]


def plan_model(spec: JobSpec, i: int, m: ModelSpec, *, fingerprint: bool = True) -> ModelPlan:
    """Resolve and check model `i` of the job; a SpecError names `models[i]`.
    `fingerprint=False` (`lorp plan`) leaves the plan's fingerprint empty and only checks
    that the files it would hash open: it hashes every weight (seconds a GiB where its
    memo is cold) and only the run's caches need it."""
    try:
        mref, path, config, read, digest = _resolve(m, fingerprint)
    except ValueError as exc:
        raise SpecError(f"models[{i}].ref: {exc}") from None
    n = int(config["num_hidden_layers"])
    _check_context(
        spec.calibration_for(m), spec.evaluation, m, config.get("max_position_embeddings")
    )
    budgets = []
    for j, b in enumerate(spec.budgets if "block" in spec.granularity else ()):
        try:
            budgets.append(resolve_budget(b, n))
        except ValueError as exc:
            raise SpecError(f"budgets[{j}]: {exc} ({m.label})") from None
    for j, method in enumerate(spec.methods):
        try:
            validate_options(method.name, method.options, n_blocks=n)
        except ValueError as exc:
            raise SpecError(f"methods[{j}].options: {exc} ({m.label})") from None
    resolved = tuple(sorted(set(budgets)))
    tied = read.tied if "linear" in spec.repair else False
    units = _unit_budgets(spec.budgets, spec.granularity, m, n)
    return ModelPlan(
        m,
        path,
        digest,
        n,
        read.family,
        resolved,
        mref.ref,
        mref.kind,
        tied,
        unit_budgets=units,
        not_servable=_not_servable(config) if spec.sublayers else None,
        calibration=spec.calibration_for(m),
        block_prefix=read.block_prefix,
        limits=read.limits,
        n_experts=read.n_experts,
        expert_groups=read.expert_groups,
        expert_budgets=_expert_budgets(spec.experts.budgets, m, read),
    )


def _resolve(
    m: ModelSpec, fingerprint: bool
) -> tuple[ModelRef, Path, dict[str, Any], ModelRead, str]:
    """Model `m`'s reference, directory, config, read and fingerprint ("" unless asked)."""
    from lorp.models.fingerprint import check_readable, fingerprint_checkpoint

    mref = parse_model_ref(m.ref)
    path = materialize(mref, allow_pickle=m.allow_pickle)
    config = read_config(path)
    read = read_model(path, m.trust_remote_code)
    check_readable(path)
    return mref, path, config, read, fingerprint_checkpoint(path) if fingerprint else ""


def _expert_budgets(
    budgets: Sequence[int | float], m: ModelSpec, read: ModelRead
) -> tuple[int, ...]:
    """The job's expert budgets as experts removed per MoE layer of model `m`; one line
    naming the budget where the model's layers would keep fewer than top-k."""
    from lorp.experts.selection import resolve_expert_budget

    if not read.n_experts:
        return ()
    counts = set()
    for j, b in enumerate(budgets):
        try:
            counts.add(resolve_expert_budget(b, read.n_experts, read.top_k, read.expert_groups))
        except ValueError as exc:
            raise SpecError(f"experts.budgets[{j}]: {exc} ({m.label})") from None
    return tuple(sorted(counts))


def _not_servable(config: dict[str, Any]) -> str | None:
    from lorp.models.nemotron_nas import NotServable, check_servable

    try:
        check_servable(config)
    except NotServable as exc:
        return str(exc)
    return None


def _unit_budgets(
    budgets: Sequence[int | float], granularity: Sequence[str], m: ModelSpec, n: int
) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """Each sub-layer granularity's budgets as unit counts; one line naming the budget
    where a model has fewer units to remove."""
    from lorp.methods.sublayer_selection import resolve_unit_budget

    out = []
    for g in (g for g in granularity if g != "block"):
        counts = set()
        for j, b in enumerate(budgets):
            try:
                counts.add(resolve_unit_budget(b, g, n))
            except ValueError as exc:
                why = str(exc).removeprefix("budget: ")
                raise SpecError(f"budgets[{j}]: {why} ({m.label}, granularity {g})") from None
        out.append((g, tuple(sorted(counts))))
    return tuple(out)


def _check_context(
    cal: CalibrationSpec, ev: EvaluationSpec, m: ModelSpec, max_pos: int | None
) -> None:
    """Windows (plus a BOS token where the policy may add one) must fit the context."""
    if max_pos is None:
        return
    for field, seq_len, bos in (
        ("calibration.seq_len", cal.seq_len, cal.bos),
        ("evaluation.seq_len", ev.seq_len, ev.bos),
    ):
        if field.startswith("evaluation") and not ev.enabled:
            continue
        need = seq_len + (bos != "never")
        if need > max_pos:
            raise SpecError(
                f"{field}: {seq_len} (+1 BOS unless bos: never) exceeds {m.label}'s "
                f"max_position_embeddings {max_pos}"
            )
    serving = ev.serving if ev.enabled else None
    if serving is not None and serving.prompt_len + serving.output_len > max_pos:
        raise SpecError(
            f"evaluation.serving: prompt_len {serving.prompt_len} + output_len "
            f"{serving.output_len} exceeds {m.label}'s max_position_embeddings {max_pos}"
        )


def resolve_backend(spec: JobSpec, vllm_installed: bool) -> str:
    """Decided once per job and recorded: none, transformers or vllm."""
    ev = spec.evaluation
    if not ev.enabled:
        return "none"
    if ev.backend != "auto":
        return ev.backend
    gpu = spec.resources.grid.num_gpus > 0
    return "vllm" if gpu and vllm_installed and spec.saves_checkpoints else "transformers"
