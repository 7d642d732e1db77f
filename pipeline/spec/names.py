"""The names a job's labels take where they are stored: checkpoint directories
(`safe_name`) and Model Registry names (`registry_stem`), and the check that two labels of
one job never take the same one."""

from __future__ import annotations

import re
from collections.abc import Iterable

from pipeline.spec.checks import SpecError


def safe_name(name: str) -> str:
    """`name` as a directory name: letters, digits, '-', '_' and '.' kept, anything else
    '_'; a leading '.' becomes '_' too, since stores and listings hide dot-names."""
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)
    return "_" + safe[1:] if safe.startswith(".") else safe


def registry_stem(label: str) -> str:
    """`label` in a Model Registry name: letters, digits, '_' and '-' kept, anything else
    (/, :, @, spaces, dots) '-', so the name is valid in MLflow and in a `models:/` URI."""
    return re.sub(r"[^A-Za-z0-9_-]+", "-", label).strip("-")


def distinct_when_stored(
    field: str, labels: Iterable[str], hint: str, *, registered: bool = False
) -> None:
    """Refuse, in one line naming both, two labels that are stored under one name (as a
    directory, or with `registered` as a registered model's name too): the second would
    overwrite the first's files or versions."""
    seen: dict[tuple[str, str], str] = {}
    for label in labels:
        forms = [("a directory", safe_name(label))]
        # a label with nothing left is registered as `lorp-model`
        # (`pipeline.tracking.registry.registered_name`): so is one named `model`
        stem = registry_stem(label) or "model"
        forms += [("a registered model name", stem)] if registered else []
        for form in forms:
            other = seen.setdefault(form, label)
            if other != label:
                raise SpecError(
                    f"{field}: {other!r} and {label!r} are both stored as {form[0]} "
                    f"{form[1]!r}; {hint}"
                )
