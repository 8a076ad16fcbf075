"""Settings read into frozen dataclasses from JSON or command-line text, each value checked
against its field's declared type: the one way settings enter the runtime."""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Mapping
from functools import cache
from typing import Any, TypeVar

T = TypeVar("T")

_KIND_WORDS = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


@cache
def field_types(cls: type) -> dict[str, Any]:
    """Field name -> declared type (annotations resolved) of dataclass ``cls``."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _split_optional(tp: Any) -> tuple[Any, bool]:
    """``X | None`` -> ``(X, True)``; anything else -> ``(tp, False)``."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


def _describe(tp: Any) -> str:
    base, optional = _split_optional(tp)
    word = _KIND_WORDS.get(base, getattr(base, "__name__", str(base)))
    return f"{word} or none" if optional else word


def parse_text(tp: Any, raw: str) -> Any:
    """The value of type ``tp`` that command-line text ``raw`` spells; ValueError if none."""
    base, optional = _split_optional(tp)
    text = raw.strip()
    if optional and text.lower() in ("", "none"):
        return None
    if base is bool:
        if text.lower() in ("true", "1", "yes", "on"):
            return True
        if text.lower() in ("false", "0", "no", "off"):
            return False
        raise ValueError
    if base is int:
        return int(text)
    if base is float:
        value = float(text)
        if not math.isfinite(value):
            raise ValueError
        return value
    if base is str:
        return raw
    raise ValueError


def check_value(tp: Any, value: Any) -> Any:
    """``value`` (decoded JSON) as type ``tp``: ints pass as floats, nothing else converts."""
    base, optional = _split_optional(tp)
    if (value is None and optional) or base is Any:
        return value
    if typing.get_origin(base) in (Mapping, dict) and isinstance(value, Mapping):
        return dict(value)
    if base is float and isinstance(value, int | float) and not isinstance(value, bool):
        if math.isfinite(value):
            return float(value)
    elif (base is int and isinstance(value, int) and not isinstance(value, bool)) or (
        base in (bool, str) and type(value) is base
    ):
        return value
    elif typing.get_origin(base) is tuple and isinstance(value, list | tuple):
        (item, _ellipsis) = typing.get_args(base)
        return tuple(check_value(item, v) for v in value)
    raise ValueError


def value_from_text(cls: type, key: str, raw: str) -> Any:
    """``raw`` read as field ``key`` of ``cls``; ValueError naming the key and what it takes."""
    tp = field_types(cls)[key]
    try:
        return parse_text(tp, raw)
    except ValueError:
        raise ValueError(f"{key}: expected {_describe(tp)}, got {raw!r}") from None


def values_from_mapping(
    cls: type, data: Mapping[str, Any], *, where: str, nested: Mapping[str, type] | None = None
) -> dict[str, Any]:
    """Checked keyword arguments for ``cls`` from decoded JSON; ``nested`` names fields that
    hold another dataclass (read recursively). Unknown keys are errors naming the accepted."""
    types_of = field_types(cls)
    nested = nested or {}
    required = {
        f.name
        for f in dataclasses.fields(cls)
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    }
    missing = sorted(required - set(data))
    if missing:
        raise ValueError(f"{where}: missing key {missing[0]!r}")
    unknown = sorted(set(data) - set(types_of))
    if unknown:
        raise ValueError(
            f"{where}: unknown key {unknown[0]!r}; accepted: {', '.join(sorted(types_of))}"
        )
    out: dict[str, Any] = {}
    for key, value in data.items():
        if key in nested:
            if not isinstance(value, Mapping):
                raise ValueError(f"{where}.{key}: expected an object")
            out[key] = build(nested[key], value, where=f"{where}.{key}")
            continue
        try:
            out[key] = check_value(types_of[key], value)
        except ValueError:
            raise ValueError(
                f"{where}.{key}: expected {_describe(types_of[key])}, got {value!r}"
            ) from None
    return out


def build(
    cls: type[T],
    data: Mapping[str, Any],
    *,
    where: str,
    nested: Mapping[str, type] | None = None,
) -> T:
    """An instance of dataclass ``cls`` from decoded JSON (see ``values_from_mapping``)."""
    return cls(**values_from_mapping(cls, data, where=where, nested=nested))
