"""A selection made on the model itself (a method registered with ``needs_model``:
Prune&Comp), as one Ray task on the grid's resources: it loads the dense model, runs the
recipe's loop over the model's calibration windows (`lorp.peers.prune_and_comp`), and
returns the selection, whose details carry each step's block and alpha for the point
that folds them.
"""

from __future__ import annotations

from typing import Any

import ray

from lorp import Selection
from pipeline.cluster.model_source import ModelSource, load_checked
from pipeline.messages import FollowerWindows
from pipeline.stages.worker_setup import device_for, pin_threads


def select_on_model(
    stage: Any,
    plan: Any,
    stats: Any,
    profile: Any,
    method: Any,
    budget: int,
    windows: FollowerWindows,
) -> Selection:
    """`method`'s selection of `budget` blocks of `plan`'s model, made on the model by one
    task on the grid's resources (`stage.resources.grid`)."""
    res = stage.resources.grid
    call = _select.options(num_cpus=res.num_cpus, num_gpus=res.num_gpus, max_retries=2)
    ref = call.remote(
        plan.source(), res, stats, profile, method.name, budget, method.options, windows
    )
    return ray.get(ref)


@ray.remote
def _select(
    model: ModelSource,
    resources: Any,
    stats: Any,
    profile: Any,
    method: str,
    budget: int,
    options: dict[str, Any],
    windows: FollowerWindows,
) -> Selection:
    import torch

    from lorp import select_layers
    from lorp.peers.prune_and_comp import iterate

    pin_threads(resources.num_cpus)
    lm = load_checked(model, device_for(resources))
    ids = torch.from_numpy(windows.windows).long()
    kw = {"batch_size": windows.batch_size, "skip_prefix": windows.skip_prefix}
    steps = lambda b, o: iterate(lm.model, ids, b, **kw, **o)  # noqa: E731  (a fresh load: no copy)
    return select_layers(stats, budget, method, profile=profile, model_steps=steps, **options)
