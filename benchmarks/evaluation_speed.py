"""Section 6 of `benchmarks/run.py`: how fast a pruned model evaluates. Pruned against
dense prefill latency at 10, 20 and 30% of the blocks removed, and the perplexity
throughput of one pruned checkpoint under transformers and (in a child process) vLLM."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.inputs import evaluation_windows
from benchmarks.timing import deep_blocks

ROOT = Path(__file__).resolve().parents[1]

VLLM_CHILD = """
import json, sys, time
sys.path.insert(0, {root!r})
if __name__ == "__main__":
    from pipeline.evaluation.vllm_engine import make_engine, perplexity_vllm
    windows = json.load(open({windows!r}))
    engine = make_engine({ckpt!r}, max_model_len={seq_len} + 8)
    perplexity_vllm(engine, windows[:2])
    t = time.perf_counter(); ppl = perplexity_vllm(engine, windows); dt = time.perf_counter() - t
    print(json.dumps({{"ppl": ppl, "seconds": dt}}))
"""


def prefill_speedups(dense: Any, model: str, seq: int, tiny: bool) -> dict[str, float]:
    """`dense` (`model` loaded) against its pruned copies' prefill at 10, 20 and 30% of
    the blocks removed, each pair interleaved in this one process."""
    from lorp.models.loading import load_model
    from lorp.models.surgery import drop_layers
    from pipeline.evaluation.speed import interleaved_speedup

    out: dict[str, float] = {}
    n = int(dense.config.num_hidden_layers)
    for frac in (0.1, 0.2, 0.3):
        k = round(frac * n)
        m = load_model(model).model
        drop_layers(m, deep_blocks(n, k))
        # a tiny model's 2 ms forwards take more pairs for as steady a median
        timing = interleaved_speedup(dense, m, seq, pairs=25 if tiny else 7)
        out[f"prefill_speedup.removed_{k}_of_{n}"] = timing["speedup"]
        out[f"prefill_speedup_std.removed_{k}_of_{n}"] = timing["speedup_std"]
        del m
    return out


def evaluation_benchmarks(quick: bool, model: str, tiny: bool = False) -> dict[str, float]:
    """Prefill speed-ups at 10, 20 and 30% of the blocks removed; perplexity throughput of
    one pruned checkpoint (3 blocks removed), transformers and (unless `tiny`) vLLM."""
    from lorp.models.loading import load_model
    from lorp.models.perplexity import perplexity
    from lorp.models.surgery import drop_layers, save_pruned

    seq = 32 if tiny else 256 if quick else 512
    lm = load_model(model)
    n = lm.n_blocks
    out = prefill_speedups(lm.model, model, seq, tiny)
    drop_layers(lm.model, deep_blocks(n, 3) if tiny else [20, 21, 22])
    with tempfile.TemporaryDirectory(prefix="lorp-bench-") as tmp:
        ckpt = save_pruned(lm.model, lm.tokenizer, Path(tmp) / "pruned", {})
        windows = evaluation_windows(lm.tokenizer, "ptb", 2 if tiny else 8 if quick else 32, seq)
        tokens = windows.numel()
        perplexity(lm.model, windows[:1])
        t = time.perf_counter()
        ppl_hf = perplexity(lm.model, windows, batch_size=4)
        out["hf_tokens_per_s"] = tokens / (time.perf_counter() - t)
        out["hf_ppl"] = ppl_hf
        if not tiny:
            out |= vllm_throughput(Path(tmp), ckpt, windows, seq)
    return out


def vllm_throughput(tmp: Path, ckpt: Path, windows: torch.Tensor, seq: int) -> dict[str, Any]:
    """Perplexity tokens/s of the pruned checkpoint under vLLM, in a child process."""
    out: dict[str, Any] = {}
    tokens = windows.numel()
    try:
        import vllm  # noqa: F401

        (tmp / "w.json").write_text(json.dumps(windows.tolist()))
        code = VLLM_CHILD.format(
            root=str(ROOT), windows=str(tmp / "w.json"), ckpt=str(ckpt), seq_len=seq
        )
        script = tmp / "vllm_child.py"
        script.write_text(code)
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_LOGGING_LEVEL="ERROR")
        res = subprocess.run(
            [sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=900
        )
        r = json.loads(res.stdout.strip().splitlines()[-1])
        out["vllm_tokens_per_s"] = tokens / r["seconds"]
        out["vllm_ppl"] = r["ppl"]
    except (ImportError, subprocess.SubprocessError, ValueError, IndexError, KeyError) as exc:
        out["vllm_error"] = str(exc)[:200]
    return out
