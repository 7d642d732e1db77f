"""What every Ray worker of a stage does first: pin torch's threads to the CPUs the spec gave
it (torch in a Ray worker would use every core of the node), and pick its device.
"""

from __future__ import annotations

from pipeline.spec.resources import Resources


def pin_threads(num_cpus: float) -> None:
    import torch

    torch.set_num_threads(max(1, int(num_cpus)))


def device_for(resources: Resources) -> str:
    return "cuda" if resources.num_gpus > 0 else "cpu"
