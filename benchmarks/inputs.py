"""What more than one benchmark script measures on, built one way: token windows cut from
the packaged corpora (calibration windows from PTB's train split, evaluation windows from
a corpus's test split), in batches, and models of a given shape with random weights."""

from __future__ import annotations

from typing import Any

import torch

from lorp.data.corpora import load_corpus, tokenize_documents
from lorp.data.windows import calibration_windows, eval_windows, prepend_bos


def batches_of(windows: Any, size: int = 8) -> list[torch.Tensor]:
    """`windows` (a tensor, or nested lists) in batches of `size`, in order, the last one
    short."""
    w = torch.as_tensor(windows)
    return [w[i : i + size] for i in range(0, len(w), size)]


def ptb_calibration(tokenizer: Any, samples: int, seq_len: int) -> torch.Tensor:
    """`samples` windows of `seq_len` tokens from PTB's train split, at seed 0's offsets."""
    docs = tokenize_documents(tokenizer, load_corpus("ptb", "train"))
    return calibration_windows(docs, samples, seq_len, seed=0, name="ptb train")


def evaluation_windows(
    tokenizer: Any, corpus: str, windows: int, seq_len: int, bos: int | None = None
) -> torch.Tensor:
    """At most `windows` consecutive windows of `seq_len` tokens from `corpus`'s test split
    (its documents joined), each with `bos` first where it is not None."""
    docs = tokenize_documents(tokenizer, load_corpus(corpus, "test"))
    ids = torch.cat([torch.as_tensor(d) for d in docs])
    return prepend_bos(eval_windows(ids, seq_len, windows), bos)


def random_model(model_type: str, device: str = "cpu", **config: Any) -> Any:
    """A float32 model of `model_type` with `config`'s fields and random weights (seed 0),
    made on `device` (not copied there), in eval mode."""
    from transformers import AutoConfig, AutoModelForCausalLM

    made = AutoConfig.for_model(model_type, **config)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(made, dtype=torch.float32)
    return model.eval()
