"""A job YAML into a `JobSpec`: every key checked against the dataclasses' fields and types,
each error one line naming the field path (`calibration.samples`) and the value.
"""

from __future__ import annotations

import dataclasses
import os
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from pipeline.spec.checks import SpecError, is_number
from pipeline.spec.job import JobSpec


def load_spec(path: str | os.PathLike[str]) -> JobSpec:
    """Parse and validate a job YAML."""
    path = Path(path)
    if not path.is_file():
        raise SpecError(f"job spec not found: {str(path)!r}")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise SpecError(f"{path.name}: malformed YAML{where}: {problem}") from None
    if not isinstance(data, dict):
        raise SpecError(f"{path.name}: the top level must be a mapping, got {type(data).__name__}")
    return parse_spec(data)


def parse_spec(data: dict[str, Any]) -> JobSpec:
    return _build(JobSpec, data, "")


def _build(cls: type, data: Any, path: str) -> Any:
    if not isinstance(data, dict):
        raise SpecError(f"{path or 'spec'}: expected a mapping, got {_show(data)}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise SpecError(
            f"{_join(path, unknown[0])}: unknown key (known: {', '.join(sorted(fields))})"
        )
    kwargs = {}
    for name, value in data.items():
        kwargs[name] = _convert(hints[name], value, _join(path, name))
    missing = [
        n
        for n, f in fields.items()
        if n not in kwargs
        and f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise SpecError(f"{_join(path, missing[0])}: required")
    try:
        return cls(**kwargs)
    except SpecError as exc:  # checks inside a dataclass name its own fields: add the path
        raise SpecError(_join(path, str(exc)) if path else str(exc)) from None


def _convert(tp: Any, value: Any, path: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        if int in options and float in options and is_number(value):
            return value  # budgets: int or float, each meaning something
        errors = []
        for option in options:
            try:
                return _convert(option, value, path)
            except SpecError as exc:
                errors.append(exc)
        # a list's own error (a mix's bad weight), not "expected a string"
        raise errors[-1] if isinstance(value, list) else errors[0]
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, path)
    if origin is tuple:
        if isinstance(value, str | bytes) or not isinstance(value, list | tuple):
            raise SpecError(f"{path}: expected a list, got {_show(value)}")
        item = args[0]
        return tuple(_convert(item, v, f"{path}[{i}]") for i, v in enumerate(value))
    if origin is dict:
        if not isinstance(value, dict):
            raise SpecError(f"{path}: expected a mapping, got {_show(value)}")
        return dict(value)
    if tp is bool:
        if not isinstance(value, bool):
            raise SpecError(f"{path}: expected true or false, got {_show(value)}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise SpecError(f"{path}: expected an integer, got {_show(value)}")
        return value
    if tp is float:
        if not is_number(value):
            raise SpecError(f"{path}: expected a number, got {_show(value)}")
        return value
    if tp is str:
        if not isinstance(value, str):
            raise SpecError(f"{path}: expected a string, got {_show(value)}")
        return value
    return value


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _show(value: Any) -> str:
    return f"{type(value).__name__} {value!r}"
