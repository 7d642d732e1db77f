"""The repair's sums captured with hooks equal their definitions computed independently,
from dense inputs or from the model repaired so far."""

from __future__ import annotations

import copy

import pytest
import torch

from lorp.models.architectures import decoder_blocks
from lorp.models.surgery import drop_layers
from lorp.repair.capture import capture_repair_stats
from lorp.repair.fit import fit_runs
from lorp.repair.fold import fold
from tests.helpers.tiny_models import tiny_model
from tests.helpers.windows import token_windows


def test_sums_equal_brute_force_from_hidden_states() -> None:
    """A_s, B_se and c_se against the definitions, from transformers' own hidden states
    (block inputs) and a direct call of block s-1's MLP: an independent computation."""
    model = tiny_model("llama")
    x = token_windows(n=4)
    stats = capture_repair_stats(model, [x], [(2, 3)], progress=False)
    with torch.no_grad():
        out = model(input_ids=x, output_hidden_states=True, use_cache=False)
        H = [h.reshape(-1, h.shape[-1]).double() for h in out.hidden_states]
        block = decoder_blocks(model)[1]
        captured = {}
        handle = block.mlp.register_forward_hook(lambda m, a, o: captured.setdefault("M", o))
        model(input_ids=x, use_cache=False)
        handle.remove()
    M = captured["M"].reshape(-1, H[0].shape[-1]).double()
    D = H[4] - H[2] + M  # H_e (output of block 3 = input of 4) - Y, Y = H_2 - M
    torch.testing.assert_close(stats.gram[2], M.T @ M, rtol=1e-5, atol=1e-3)
    torch.testing.assert_close(stats.cross[(2, 3)], M.T @ D, rtol=1e-5, atol=1e-3)
    assert stats.energy[(2, 3)] == pytest.approx(float((D * D).sum()), rel=1e-6)
    assert stats.state_energy[(2, 3)] == pytest.approx(float((H[4] * H[4]).sum()), rel=1e-6)


def test_sequential_fit_reads_the_inputs_of_the_model_repaired_so_far() -> None:
    """The second run's sums, captured with the first run folded and dropped in memory and
    the dense model as reference, equal those of a model with the first run really pruned
    (its block indices shifted), with targets taken from the dense model by hand."""
    dense = tiny_model("qwen2")
    x = token_windows()
    first = fit_runs(dense, capture_repair_stats(dense, [x], [(1, 1)], progress=False))
    work = copy.deepcopy(dense)
    fold(work, first)
    seq = capture_repair_stats(work, [x], [(3, 4)], reference=dense, dropped=[1], progress=False)

    pruned = copy.deepcopy(work)
    drop_layers(pruned, [1])  # original block 2 is now block 1, the run's s-1
    with torch.no_grad():
        H = dense(input_ids=x, output_hidden_states=True, use_cache=False).hidden_states
        target = H[5].reshape(-1, 64).double()  # output of block 4 = input of block 5
        got = {}
        block = decoder_blocks(pruned)[1]
        h1 = block.mlp.register_forward_hook(lambda m, a, o: got.setdefault("M", o))
        h2 = block.register_forward_hook(lambda m, a, o: got.setdefault("out", o))
        pruned(input_ids=x, use_cache=False)
        h1.remove(), h2.remove()
    M = got["M"].reshape(-1, 64).double()
    out = (got["out"][0] if isinstance(got["out"], tuple) else got["out"]).reshape(-1, 64)
    D = target - out.double() + M
    torch.testing.assert_close(seq.gram[3], M.T @ M, rtol=1e-5, atol=1e-3)
    torch.testing.assert_close(seq.cross[(3, 4)], M.T @ D, rtol=1e-5, atol=1e-3)
    # ... and differ from the one-pass (dense-input) sums, which the first run's error moves.
    dense_pass = capture_repair_stats(dense, [x], [(3, 4)], progress=False)
    assert (dense_pass.cross[(3, 4)] - seq.cross[(3, 4)]).abs().max() > 1e-2
