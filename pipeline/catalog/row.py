"""A catalog row: `CatalogRow`'s fields are the catalog's typed core columns, in their order,
and each field's docstring is the column's meaning. The Delta schema (`CORE_SCHEMA`) and
the docs' schema page (`docs/gen_reference.py`) are derived from it. A row's figures
(perplexities, accuracies, speed, costs) are float columns beside the core ones, added as
a job measures them; `FIGURES` says what each means.

A row is written once, when its point ends (`pipeline.driver.rows.catalog_row` builds
it); what the job learns later (speed, the quality gate, its registry version) updates
columns of the row already written.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import pyarrow as pa


def now() -> str:
    """The time a row (`created_at`) or an event is stamped with: UTC, ISO 8601, ms."""
    return datetime.now(UTC).isoformat(timespec="milliseconds")


@dataclass(frozen=True, kw_only=True)
class CatalogRow:
    """One grid point's row: a pruned variant of a model, or its dense model."""

    grid_key: str
    """Content key of everything that changes a figure: model weights, dtype, calibration
    (incl. BOS), method and options, budget, evaluation settings, backend."""
    job: str | None = None
    """The job that measured the row."""
    run_id: str | None = None
    """The job's identity: minted at its first start, kept in its storage
    (`lorp_run.json`); with `grid_key` the row's key in the shared catalog (a Delta table
    partitioned by it). `legacy:<job>` for rows migrated from the format before Delta."""
    model: str | None = None
    """The model's name in the job (its `name`, else its reference)."""
    model_ref: str | None = None
    """The model's reference: packaged alias, hub id, directory or .gguf."""
    family: str | None = None
    """The model's family (`Llama`, `Qwen2`, ...)."""
    fingerprint: str | None = None
    """The model's content hash."""
    dtype: str | None = None
    """The dtype the model was captured and evaluated in."""
    n_blocks: int | None = None
    """The dense model's blocks, N."""
    method: str | None = None
    """The selection method (`dense` on the dense row)."""
    method_label: str | None = None
    """Its label in the catalog: the method's label or name, `-<granularity>` for a
    sub-layer variant, `+linear` when repaired."""
    variant: str | None = None
    """LoRP's variant (`paper`, `released`); null for other methods."""
    options: str | None = None
    """The method's options (JSON, defaults filled in)."""
    budget: int | None = None
    """Blocks removed (units removed at a sub-layer granularity, routed experts per MoE
    layer at granularity `experts`); 0 on the dense row."""
    pruned_layers: list[int] | None = None
    """0-based indices of the blocks removed (a sub-layer variant removes no block: empty)."""
    kept_layers: list[int] | None = None
    """0-based indices of the blocks kept (a sub-layer variant keeps every block)."""
    removed_kinds: list[str] | None = None
    """The kind of each block removed, in depth order (`attention`, `attention+moe`,
    `mamba`, `linear_attention`, `conv`, ...: what a hybrid's variant gave up); null for
    the dense row and sub-layer variants."""
    experts: int | None = None
    """Routed experts per mixture-of-experts layer of the variant; null for a dense model."""
    expert_method: str | None = None
    """The selector of the routed experts the row removed (`reap`, `frequency`,
    `random`; docs: Experts); null where it removed none."""
    expert_budget: int | None = None
    """Routed experts removed from each MoE layer: 0 on a mixture's rows that removed none,
    null for a dense model."""
    experts_removed: str | None = None
    """Per MoE block, the routed experts removed, in the dense model's numbering (JSON)."""
    granularity: str | None = None
    """What the row's `budget` counts: `block`, `attention`, `mlp` or `mixed` (sub-layers,
    `docs: Sub-layers`), `experts` (an expert cut alone, `docs: Experts`); null on the
    dense row and on rows from before granularity (read as `block`)."""
    sublayers: list[str] | None = None
    """The sub-layers a sub-layer variant removed (`attn.5`, `mlp.9`); null at block
    granularity."""
    stages: str | None = None
    """LoRP: JSON block -> stage1 / stage2 / fallback."""
    memory_plan: str | None = None
    """Per stage (`capture`, `evaluate`): `memory` (held whole) or `streamed` (a module at a
    time), what each needs and what a worker has, GiB (JSON; also an MLflow tag)."""
    speed_skipped: str | None = None
    """Why a row has no speed figures although the job asked for them (a streamed model:
    its forwards time the disk)."""
    repair: str | None = None
    """`none` or `linear` (null on dense rows)."""
    repair_fits: str | None = None
    """Per run: form (`full`/`normed`), lambda, the fit's residual and the unrepaired one,
    rounds (JSON); the followers' records too, each with `follower`: its block, and per
    domain its held-out residuals (`held_by_domain`)."""
    repair_kept: str | None = None
    """How many runs, and followers, kept their fitted map on the held-out calibration
    windows (`2/2 runs, 1/2 followers`; `0/2 runs` and no follower kept: the variant
    equals its unrepaired twin; `(not kept: worse on held-out code)` names the domain that
    refused a map; `; gate kept runs only (held-out loss per domain)` when the repair gate
    fell back)."""
    repair_gate: str | None = None
    """What the repair gate kept (`distilled`, `least squares`, `runs only`, or
    `unrepaired`: none; [Domains](../concepts/domains.md))."""
    repair_held_loss_ratio: float | None = None
    """The kept variant's held-out loss over its unrepaired twin's on its worst
    calibration domain (at most 1)."""
    rls: float | None = None
    """The model's Representation Locality Score."""
    k: int | None = None
    """K: LoRP's own where the method fixes it, else the one the model's RLS chose."""
    labels: list[int] | None = None
    """The blocks' cluster labels at the RLS-chosen K."""
    calibration: str | None = None
    """The calibration settings the model was fitted on (JSON)."""
    calibration_id: str | None = None
    """The calibration data's id (`ptb-1b2c3d4e`): dataset, split, windows, length, seed,
    BOS."""
    evaluation: str | None = None
    """The evaluation settings (JSON)."""
    protocol: str | None = None
    """The evaluation protocol's id (`ptb256-3f9a2c1e`): rows are ranked and compared only
    within one."""
    reference_claim: bool | None = None
    """The job set `tracking.reference: true` (its protocol is its models' reference)."""
    zero_shot: str | None = None
    """Per task: the split, the items scored and, from rows written since, `correct`: a
    digit per item in item order, 1 right and 0 wrong (JSON; what McNemar's test pairs
    between two variants)."""
    window_nll: str | None = None
    """Per perplexity corpus (`ppl_<corpus>`'s name): each evaluation window's mean NLL
    per predicted token, in window order (JSON; what a paired bootstrap between two
    variants resamples). Null on rows from before it."""
    serving: str | None = None
    """vLLM serving: the settings and every timed round's figures (`output_tps`,
    `ttft_ms`, `tpot_ms`, `output_tokens`; JSON)."""
    stats_file: str | None = None
    """The cached S (`SimilarityStats` .npz) the selection used."""
    params: int | None = None
    """Parameters after pruning."""
    params_dense: int | None = None
    """Parameters before pruning."""
    checkpoint: str | None = None
    """Where the pruned checkpoint lives: an absolute path, or its URI in remote
    `storage`."""
    storage: str | None = None
    """The job's storage when the row was written: where its files are (rows of another
    storage are redone, not skipped)."""
    eval_backend: str | None = None
    """`vllm` or `transformers` (a sub-layer variant of a family vLLM cannot serve in the
    Nemotron-NAS form is judged in transformers whatever the job's backend, and says so
    here)."""
    degraded: bool | None = None
    """`ppl_ratio` above `evaluation.degraded_ratio`."""
    judged_on: str | None = None
    """The corpora `ppl_ratio` comes from: per domain those the model was not calibrated
    on (`lee`), or that domain's calibration corpus's test split (`lee; code
    (calibration text)`)."""
    worst_domain: str | None = None
    """The domain whose ratio to dense is highest (each judged domain's ratio is
    `ratio_domain_<domain>`: the worst over its `judged_on` corpora)."""
    worst_domain_ratio: float | None = None
    """That domain's ratio to dense."""
    fits_calibration_only: bool | None = None
    """The held-out ratio is over 1.5x the calibration corpus's ratio: the variant is good
    only on the kind of text it was fitted on (null when the job did not evaluate both)."""
    tracking_uri: str | None = None
    """The MLflow tracking store of the point's run (URI without credentials)."""
    experiment_id: str | None = None
    """The MLflow experiment of the point's run."""
    mlflow_run_id: str | None = None
    """The point's MLflow run."""
    model_uri: str | None = None
    """The row's registered version, `models:/lorp-<model>/<version>` (empty when not
    registered)."""
    created_at: str | None = None
    """When the row was written (UTC, ISO 8601)."""
    lorp_version: str | None = None
    """The lorp that wrote it."""
    figures: dict[str, float | None] = field(default_factory=dict)
    """The row's figures: float columns beside the core ones (`FIGURES`)."""

    def record(self) -> dict[str, Any]:
        """The row as the table stores it: every core column, then each figure as a
        column of its own."""
        core = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        figures = core.pop("figures")
        clash = sorted(set(figures) & set(core))
        if clash:
            raise ValueError(f"catalog row {self.grid_key!r}: figures {clash} are core columns")
        return core | figures


FIGURES = {
    "ppl_<corpus>": "perplexity per corpus",
    "ratio_<corpus>": "the variant's perplexity over the dense model's, on each corpus",
    "ratio_domain_<domain>": "every judged domain's ratio to dense (the worst over its "
    "`judged_on` corpora)",
    "ppl_ratio": "the gate's figure: the worst domain's ratio, or `evaluation.rank_domain`'s "
    "where the job names one (what `best-<b>` and the registry rank by)",
    "acc_<task>": "zero-shot accuracy (%)",
    "acc_avg": "the mean zero-shot accuracy over tasks",
    "n_<task>": "zero-shot items scored",
    "repair_residual": "the worst run's share of its gap the map leaves on calibration "
    "tokens (0: closed, 1: as pruned)",
    "repair_held_residual": "the same on the held-out calibration windows (the map kept; "
    "with several calibration domains, on its worst domain)",
    "latency_ms": "prefill latency of the variant: the minimum of alternating runs",
    "latency_dense_ms": "prefill latency of its dense model, the same way",
    "speedup": "the median of paired dense / variant ratios, published only when resolved "
    "(else NaN)",
    "speedup_std": "the half-width of its 95% interval",
    "speedup_low": "the interval's low end (distribution-free, from the ratios' order statistics)",
    "speedup_high": "the interval's high end",
    "speedup_measured": "the median as measured (always)",
    "speed_runs": "rounds timed",
    "speed_resolved": "1 when resolved; 0 marks a figure that is not a speed-up (interval "
    "wider than `speed_half_width`, or outside 0.97 to 1.05 x N/(N-k))",
    "serve_output_tps": "vLLM serving (`evaluation.serving`): the median over the timed "
    "rounds of output tokens/s",
    "serve_ttft_ms": "the median over the rounds of each round's median time to first token",
    "serve_tpot_ms": "the median over the rounds of each round's median time per output token",
    "serve_speedup": "output tokens/s over dense's (Hodges-Lehmann over the two engines' "
    "rounds), published by the prefill speed-up's rule",
    "serve_speedup_measured": "that figure as measured (always)",
    "serve_speedup_low": "its Moses 95% interval's low end",
    "serve_speedup_high": "its interval's high end",
    "serve_resolved": "1 when the serving speed-up is published",
    "peak_mem_gib": "the variant's peak memory, measured in a fresh process",
    "weight_bytes": "counted, not timed (`lorp/serving_cost.py`): every parameter at the "
    "model's dtype",
    "kv_bytes_per_token": "the K and V one token adds to the cache (2 x KV heads x "
    "head_dim per kept block that attends: a hybrid's Mamba, linear-attention and "
    "convolution blocks keep a state instead)",
    "active_params": "the parameters a token runs through: all of them, less the routed "
    "experts it is not sent to (a mixture of experts: `params` less E - top-k experts of "
    "each MoE layer)",
    "prefill_flops_per_token": "matmul FLOPs (2 per multiply-add) of one token of a causal "
    "prefill at the evaluation's `seq_len` (the calibration's when evaluation is off), as a "
    "plain forward runs it: q, k, v, o and the gated MLP of each kept block, attention "
    "scores and weighted values over the token's context (a sliding-window layer sees at "
    "most its window), the LM head once per sequence (a prefill computes the last "
    "position's logits only)",
    "decode_bytes_per_token": "what one generated token reads at a context of that "
    "`seq_len`: every active weight once (an untied embedding table: one row; a mixture "
    "of experts: the experts the token runs through), every kept block's KV cache of the "
    "keys it attends to (the whole context; a sliding-window layer, at most its window), "
    "and every kept recurrent block's state, read and written",
    "<figure>_4k, <figure>_32k": "`prefill_flops_per_token`, `decode_bytes_per_token` and "
    "`predicted_decode_speedup` at a 4k and a 32k context, whatever the evaluation's: "
    "where the KV cache a removed attention takes with it weighs (the model page plots "
    "quality against `decode_bytes_per_token_4k`)",
    "predicted_prefill_speedup": "dense over variant of `prefill_flops_per_token`: the "
    "speed-up a compute-bound prefill would see. A prediction, on every row, measured or "
    "not; `lorp status` and the model page label it so",
    "predicted_decode_speedup": "dense over variant of `decode_bytes_per_token`: the "
    "speed-up a memory-bound decode would see. A prediction, like the one above",
    "n_evals": "candidate models the selection asked for (its cost on its own)",
    "select_s": "the wall time this run spent selecting (shorter where remembered losses "
    "served it)",
}
"""Figure -> what it means (`<corpus>`, `<task>`, `<domain>` stand for each one's name)."""


def arrow_type(hint: Any) -> pa.DataType:
    """The Arrow type of a core field's annotation (`X | None`: X's, nullable)."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        (hint,) = args
        args = list(typing.get_args(hint))
    if typing.get_origin(hint) is list:
        return pa.list_(arrow_type(args[0]))
    return {str: pa.string(), int: pa.int64(), float: pa.float64(), bool: pa.bool_()}[hint]


def core_schema() -> pa.Schema:
    """The core columns, typed, in `CatalogRow`'s order (its figures are not core)."""
    hints = typing.get_type_hints(CatalogRow)
    names = [f.name for f in dataclasses.fields(CatalogRow) if f.name != "figures"]
    return pa.schema([(name, arrow_type(hints[name])) for name in names])


CORE_SCHEMA = core_schema()
CORE = set(CORE_SCHEMA.names)
