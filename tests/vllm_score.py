"""Run as a script: score token windows with vLLM in this fresh process.

vLLM engines must start under `if __name__ == "__main__"` (they spawn workers that
re-import the main module), so tests call this file in a subprocess.
usage: python vllm_score.py MODEL_DIR WINDOWS.json OUT.json
"""

import json
import sys
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from pipeline.vllm_engine import make_engine, prompt_logprobs

    model_dir, windows_file, out_file = sys.argv[1:4]
    windows = json.loads(Path(windows_file).read_text())
    engine = make_engine(model_dir, max_model_len=max(len(w) for w in windows) + 8)
    scores = prompt_logprobs(engine, windows)
    Path(out_file).write_text(json.dumps([s.tolist() for s in scores]))
