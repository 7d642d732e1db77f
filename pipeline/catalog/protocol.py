"""Which rows' figures may be compared: the evaluation protocol and the calibration id.

A perplexity is one number only under one protocol: the corpora and the split each is
read from, the window length and how many windows, the BOS policy, the zero-shot tasks
(their metric and item limit, zero-shot: no few-shot examples) and the dtype the model
ran in. `protocol_id` names that set with a short, stable id, `<corpus><seq_len>-<hash>`
(`ptb256-3f9a2c1e`), readable in an alias (`best-8-ptb256-3f9a2c1e`) and equal for every
row measured the same way, whichever job, backend or machine measured it. Batch sizes,
parallelism, the backend and the speed pass change no quality figure and are left out.

Every ranking (`lorp catalog best`, the registry's aliases, the dashboard's "best")
compares rows of one protocol only. Rows written before the column existed get their id
from their `evaluation` and `dtype` columns (`row_protocol`), so old catalogs join in.

`calibration_id` is the same kind of id for what a variant was fitted on (dataset,
split, windows, length, seed, BOS): two rows of one protocol may differ in it, and the
catalog shows it beside the protocol.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

NO_EVALUATION = "none"
"""The protocol of a row whose job evaluated nothing: never ranked."""


def _digest(data: Any) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:8]


def _eval_split(corpus: str) -> str:
    from pipeline.evaluation.corpora import HUB_CORPORA

    hub = HUB_CORPORA.get(corpus)
    return hub.eval_split if hub is not None else "test"


def protocol_fields(evaluation: Mapping[str, Any], dtype: str) -> dict[str, Any]:
    """What makes two rows' quality figures comparable (see the module docstring)."""
    from pipeline.spec.evaluation import ZERO_SHOT_TASKS

    corpora = list(evaluation.get("perplexity") or ())
    tasks = list(evaluation.get("zero_shot") or ())
    ranked = evaluation.get("rank_domain")  # ppl_ratio is another figure: not comparable
    return {
        **({"rank_domain": ranked} if ranked else {}),
        "perplexity": [[c, _eval_split(c)] for c in corpora],
        "seq_len": evaluation.get("seq_len"),
        "max_windows": evaluation.get("max_windows"),
        "bos": evaluation.get("bos", "auto"),
        "zero_shot": [[t, *ZERO_SHOT_TASKS.get(t, (t, "?"))] for t in tasks],
        "zero_shot_limit": evaluation.get("zero_shot_limit") if tasks else None,
        "num_fewshot": 0,
        "dtype": dtype,
    }


def protocol_id(evaluation: Mapping[str, Any], dtype: str) -> str:
    """`<first corpus><seq_len>-<8 hex>` (`zs` for zero-shot only); `none` when the
    job evaluated nothing."""
    if not evaluation.get("enabled", True):
        return NO_EVALUATION
    fields = protocol_fields(evaluation, dtype)
    corpora = fields["perplexity"]
    stem = _slug(corpora[0][0])[:12] if corpora else "zs"
    return f"{stem}{fields['seq_len'] if corpora else ''}-{_digest(fields)}"


def calibration_id(calibration: Mapping[str, Any]) -> str:
    """`<dataset>-<8 hex>` of the calibration's data settings (not its sharding)."""
    keep = ("dataset", "split", "samples", "seq_len", "seed", "bos", "text_field")
    fields = {k: calibration.get(k) for k in keep}
    data = fields["dataset"]
    stem = _slug(str(data))[:12] if isinstance(data, str) else "mix"
    return f"{stem}-{_digest(fields)}"


def _slug(text: str) -> str:
    stem = text.lower().rstrip("/").rsplit("/", 1)[-1].rsplit(".", 1)[0]
    return re.sub(r"[^a-z0-9]+", "", stem) or "data"


def row_protocol(row: Mapping[str, Any]) -> str:
    """A row's protocol: its column, else computed from its `evaluation` and `dtype`."""
    if row.get("protocol"):
        return str(row["protocol"])
    text = row.get("evaluation")
    if not isinstance(text, str):
        return NO_EVALUATION
    return protocol_id(json.loads(text), str(row.get("dtype") or "float32"))


FITS_CALIBRATION_ONLY = 1.5
"""A variant whose ratio to dense on held-out text is more than this multiple of its ratio
on its calibration corpus is marked `fits_calibration_only`: it is good only on the kind
of text it was fitted on."""


def held_out(corpora: Sequence[str], calibration: Sequence[str]) -> list[str]:
    """The evaluation corpora that are not calibration corpora (compared by the name
    their perplexity column takes: `ptb` is `ptb` whatever the split)."""
    from pipeline.evaluation.corpora import metric_name

    fitted = {metric_name(c) for c in calibration}
    return [c for c in corpora if metric_name(c) not in fitted]


def ratio_name(corpus: str) -> str:
    """The column of a corpus's perplexity over dense's: `ratio_<corpus>`."""
    from pipeline.evaluation.corpora import metric_name

    return "ratio_" + metric_name(corpus).removeprefix("ppl_")


def rank_column(row: Mapping[str, Any]) -> str | None:
    """The figure a row is ranked by within its protocol: `ppl_ratio`, the worst ratio to
    dense on held-out text, for a row the gate judged (`judged_on`); before that column
    existed, its first perplexity column (`ppl_<corpus>`); None for a protocol without
    perplexity (then `acc_avg`)."""
    from pipeline.evaluation.corpora import metric_name

    if row.get("judged_on"):
        return "ppl_ratio"
    text = row.get("evaluation")
    corpora = json.loads(text).get("perplexity") if isinstance(text, str) else None
    return metric_name(corpora[0]) if corpora else None
