"""Typed config loading: YAML with dotted overrides into dataclasses, checking types, ranges and choices.

Each field is declared with `knob(default, doc, ...)`: the one-line doc and the allowed range live where the
field is declared (app/config/schema.py). Every failure is one `ConfigError` naming the field and the fix.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import types
import typing
from dataclasses import field
from typing import Any, Literal

import yaml


class ConfigError(ValueError):
    """A config problem, told as the field, what is wrong, and how to fix it."""

    def __init__(self, field_path: str, problem: str, fix: str):
        self.field_path, self.problem, self.fix = field_path, problem, fix
        text = f"config error at '{field_path}': {problem}. Fix: {fix}"
        # one line whatever the user wrote: escape newlines and other non-printing characters
        super().__init__("".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in text))

    def __reduce__(self):  # rebuilt from its parts where it lands (a trainer's error crosses to the driver by pickle)
        return ConfigError, (self.field_path, self.problem, self.fix)


class _YamlLoader(yaml.SafeLoader):
    """SafeLoader that also reads 1e-5 (an exponent without a dot, YAML 1.2 style) as a float."""


_YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"), list("-+0123456789")
)


def parse_yaml(text: str) -> Any:
    """yaml.safe_load with 1e-5 as a float; PyYAML's own ValueError/KeyError/... become YAMLError."""
    try:
        return yaml.load(text, Loader=_YamlLoader)
    except yaml.YAMLError:
        raise
    except Exception as e:  # e.g. `!!float abc`, `!!bool maybe`, an int of more than 4300 digits
        raise yaml.YAMLError(f"{type(e).__name__}: {e}") from None


def knob(
    default: Any,
    doc: str,
    *,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
) -> Any:
    """A config field with its one-line doc and numeric bounds (checked by `load_config`)."""
    meta = {"doc": doc, "ge": ge, "gt": gt, "le": le, "lt": lt}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    if dataclasses.is_dataclass(default):
        return field(default_factory=type(default), metadata=meta)
    return field(default=default, metadata=meta)


def from_dict(cls: type, raw: Any, where: str) -> Any:
    """Builds dataclass `cls` from a mapping, checking keys, types and bounds; errors name the dotted field."""
    if not isinstance(raw, dict):
        raise ConfigError(
            where or "<root>", f"expected a section (mapping), got {raw!r}", "write key: value pairs under it"
        )
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    for key in raw:
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1, cutoff=0.6)
            if not close and len(str(key)) >= 2:  # lr_rate -> lr, n_samples -> n_samples_per_prompt
                close = sorted((f for f in fields if str(key).startswith(f) or f.startswith(str(key))), key=len)[-1:]
            hint = f"did you mean '{close[0]}'?" if close else f"valid keys: {', '.join(fields)}"
            raise ConfigError(join_path(where, key), "unknown key", f"remove it or rename it; {hint}")
    values = {}
    for name, f in fields.items():
        if name not in raw:
            continue
        path = join_path(where, name)
        value = _coerce(hints[name], raw[name], path)
        _check_bounds(f, value, path)
        values[name] = value
    return cls(**values)


def join_path(where: str, key: Any) -> str:
    return f"{where}.{key}" if where else str(key)


def _coerce(tp: Any, value: Any, path: str) -> Any:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, {} if value is None else value, path)  # `train:` with nothing under it: defaults
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(inner[0], value, path)
    if origin is Literal:
        if value not in args or type(value) is not type(next(a for a in args if a == value)):
            raise ConfigError(path, f"{value!r} is not one of {list(args)}", f"use one of {', '.join(map(repr, args))}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(path, f"expected a list, got {value!r}", "write a YAML list, e.g. [a, b]")
        return [_coerce(args[0], v, f"{path}[{i}]") for i, v in enumerate(value)]
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(path, f"expected true or false, got {value!r}", "write true or false")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(path, f"expected an integer, got {value!r}", "write a whole number")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(path, f"expected a number, got {value!r}", "write a number such as 0.5 or 1e-5")
        try:
            number = float(value)
        except OverflowError:
            raise ConfigError(path, "the number is too large", "write a number such as 0.5 or 1e-5") from None
        if not math.isfinite(number):
            raise ConfigError(path, f"{value!r} is not a finite number", "write a finite number such as 0.5")
        return number
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(path, f"expected a string, got {value!r}", "quote the value")
        return value
    raise TypeError(f"config type {tp} of {path} is not supported")  # a bug in this module, not in the user's file


def _check_bounds(f: dataclasses.Field, value: Any, path: str) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return
    m = f.metadata
    for key, ok, word in (
        ("ge", value >= (m.get("ge") or 0), ">="),
        ("gt", value > (m.get("gt") or 0), ">"),
        ("le", value <= (m.get("le") or 0), "<="),
        ("lt", value < (m.get("lt") or 0), "<"),
    ):
        if m.get(key) is not None and not ok:
            raise ConfigError(
                path, f"{value} is out of range (must be {word} {m[key]})", f"set a value {word} {m[key]}"
            )
