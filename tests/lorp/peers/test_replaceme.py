"""ReplaceMe, cosine variant: Eq. 3 (the L2 map) and Eq. 4 (the mean cosine distance)
against numpy on hand-taken states, the fold into block i's down_proj, and the test of
equivalence that says lorp's `linear` is the L2 variant."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from lorp import select_layers
from lorp.locality.similarity import LayerSimilarity
from lorp.models.surgery import drop_layers
from lorp.peers.replaceme import cosine_distance, fit_cosine, l2_map, repair_replaceme
from lorp.repair.capture import capture_repair_stats
from lorp.repair.maps import RepairRefused, fit_full
from tests.helpers.peer_states import hidden_rows, mean_cos_distance, mlp_rows
from tests.helpers.tiny_models import tiny_model
from tests.helpers.windows import token_windows

S, E = 2, 3  # the run removed: blocks 2-3, so i = 1 and h_{i+n} = block 3's output


def test_the_selection_is_the_run_of_least_cosine_distance() -> None:
    S_ = np.eye(7)
    S_[1, 3], S_[2, 4], S_[3, 5] = 0.5, 0.9, 0.7  # windows of 2 from s = 1, 2, 3
    sel = select_layers(LayerSimilarity(np.maximum(S_, S_.T), 6), 2, "replaceme")
    assert sel.layers == (2, 3)
    assert sel.details["cosine_distance"] == pytest.approx({1: 0.5, 2: 0.1, 3: 0.3})


def test_eq3_and_eq4_by_value_on_random_tokens() -> None:
    g = np.random.default_rng(0)
    M, Y = g.normal(size=(200, 6)), g.normal(size=(200, 6))
    H = Y + M @ g.normal(size=(6, 6)) + 0.3 * g.normal(size=(200, 6))
    T_hand = np.linalg.solve(M.T @ M, M.T @ (H - Y))  # the normal equations of Eq. 3
    t = [torch.from_numpy(x) for x in (M, Y, H)]
    np.testing.assert_allclose(l2_map(*t).numpy(), T_hand, rtol=1e-8, atol=1e-10)
    assert cosine_distance(*t, torch.from_numpy(T_hand)) == pytest.approx(
        mean_cos_distance(M @ T_hand + Y, H), rel=1e-10
    )
    T = fit_cosine(*[x.float() for x in t], epochs=30, lr=1e-2, batch_tokens=50).numpy()
    assert mean_cos_distance(M @ T + Y, H) < mean_cos_distance(M @ T_hand + Y, H) - 1e-4


def test_the_l2_map_folds_into_block_i_and_gives_y_plus_m_t() -> None:
    """epochs 0: T is Eq. 3's, by numpy on transformers' hidden states; the pruned model's
    state leaving block i is then Y_i + M_i T, token by token."""
    dense = tiny_model("llama")
    w = token_windows(6, 24)
    hs, M = hidden_rows(dense, w), mlp_rows(dense, w, S - 1)
    Y, H = hs[S] - M, hs[E + 1]
    T_hand = np.linalg.lstsq(M, H - Y, rcond=None)[0]
    model = copy.deepcopy(dense)
    record = repair_replaceme(model, [S, E], w, w[:2], options={"epochs": 0})
    drop_layers(model, [S, E])
    got = hidden_rows(model, w)[S]  # block i's output in the pruned model
    np.testing.assert_allclose(got, Y + M @ T_hand, rtol=1e-4, atol=1e-4)
    assert record["calibration"]["l2"] == pytest.approx(
        mean_cos_distance(Y + M @ T_hand, H), abs=1e-5
    )
    assert record["calibration"]["unrepaired"] == pytest.approx(
        mean_cos_distance(hs[S], H), abs=1e-5
    )


def test_lorp_linear_is_the_l2_variant_with_a_ridge() -> None:
    """The test of equivalence: lorp's `linear` map, from its sums with the ridge taken
    to 0, is ReplaceMe's L2 map on the same tokens; its default ridge moves it off."""
    dense = tiny_model("llama")
    w = token_windows(6, 24)
    hs, M = hidden_rows(dense, w), mlp_rows(dense, w, S - 1)
    T_l2 = l2_map(torch.from_numpy(M), torch.from_numpy(hs[S] - M), torch.from_numpy(hs[E + 1]))
    stats = capture_repair_stats(dense, list(w.split(3)), [(S, E)], progress=False)
    A, B, c = stats.gram[S], stats.cross[(S, E)], stats.energy[(S, E)]
    eye = torch.eye(A.shape[0], dtype=torch.float64)
    tiny = fit_full(A, B, c, eye, ridge=1e-12).matrix
    torch.testing.assert_close(tiny, T_l2, rtol=1e-4, atol=1e-4)
    default = fit_full(A, B, c, eye, ridge=1e-3).matrix
    assert float((default - T_l2).abs().max()) > 1e-3


def test_a_norm_after_the_mlp_is_refused_in_one_line() -> None:
    with pytest.raises(RepairRefused, match="cosine-map: family 'gemma3_text'") as exc:
        repair_replaceme(tiny_model("gemma3_text"), [S, E], token_windows(2, 24))
    assert "\n" not in str(exc.value)
