"""The benchmark scripts as modules, for their tests."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType

import torch

from tests.helpers.paths import REPO


def load_benchmark(name: str) -> ModuleType:
    """`benchmarks/<name>.py` loaded fresh under the module name `<name>_bench`."""
    module_name = f"{name}_bench"
    spec = importlib.util.spec_from_file_location(module_name, REPO / "benchmarks" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """`n` torch threads, and the process's own count back afterwards: a tiny model's ops
    are too small to share among threads (the suite's three processes share two cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
