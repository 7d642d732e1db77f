"""benchmarks/sublayers/data.py: how the sub-layer scripts measure a variant, on a tiny
model and windows built here (`prepared` loads a packaged model with `jobs/quality.yaml`'s
calibration; the scripts' runs exercise it): perplexity per domain, and the repair, whose
maps are counted by how each was kept."""

from __future__ import annotations

import copy

from benchmarks.sublayers.data import Prepared, maps
from lorp.models.perplexity import perplexity
from lorp.models.shape import ModelShape
from tests.helpers.tiny_models import tiny_model
from tests.helpers.windows import token_windows


def test_a_variant_is_repaired_in_place_and_measured_per_domain() -> None:
    model = tiny_model("llama")
    setup = Prepared(
        model=model,
        tok=None,
        shape=ModelShape.from_config(model.config.to_dict()),
        skip=0,
        fit=[token_windows(4)],
        held_windows=token_windows(4, seed=1),
        held={"prose": [token_windows(4, seed=1)]},
        evals={"prose": token_windows(2, seed=2), "code": token_windows(2, seed=3)},
    )
    dense = setup.ppl(model)
    assert list(dense) == ["prose", "code"]
    assert dense["code"] == perplexity(model, token_windows(2, seed=3), batch_size=4)
    variant = copy.deepcopy(model)
    fits = setup.repair(variant, [4, 5])  # block 2's attention and MLP
    kept = maps(fits)
    assert set(kept) == {"fit", "unrepaired", "distilled"} and sum(kept.values()) == len(fits)
    assert kept["distilled"] == 0 and fits  # a map per run, none distilled unless asked
    assert setup.ppl(variant) != dense
