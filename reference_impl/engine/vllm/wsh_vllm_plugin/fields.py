"""JSON field rules of the protocol's bodies: the error every rule raises, and type checks from type hints.

The protocol's bodies (`protocol.InitInfo`, `UpdateInfo`, `ShmHandle`, `CudaIpcHandle`) are stdlib
dataclasses read from request JSON. `from_json` builds one from a decoded JSON object: unknown fields and
missing required fields are refused by name, and every value must have its field's JSON type exactly
(no coercion: `"7"` is not an int, `1` is not a bool, `true` is not an int). `check_types` runs the same
type rules on an instance built any other way (vLLM builds them with `cls(**update_info)`).

Stdlib only (no pydantic, no torch): it ships with the protocol into both environments.
"""

from __future__ import annotations

import dataclasses
import math
import types
from collections.abc import Iterable
from typing import Any, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

T = TypeVar("T")

MAX_INT64 = 2**63 - 1  # the largest byte count, dimension, rank or index a body may carry


class ProtocolError(ValueError):
    """A protocol body that breaks one of its rules (a type, a range, a required field, a name).

    `str(e)` is the reason, prefixed with the field's name when the field is missing.

    Attributes:
        field: the offending field of the body, dotted for nested values (e.g. "master_address",
            "shapes.2.0"); "" for the body itself.
        reason: one sentence saying what is wrong.
        required: True when the field is missing (None) where the rule needs it.
    """

    def __init__(self, field: str, reason: str, required: bool = False) -> None:
        super().__init__(f"{field}: {reason}" if required else reason)
        self.field = field
        self.reason = reason
        self.required = required


def _join(path: str, key: str | int) -> str:
    return f"{path}.{key}" if path else str(key)


def _type_name(hint: Any) -> str:
    if get_origin(hint) is Literal:
        return " | ".join(repr(a) for a in get_args(hint))
    if get_origin(hint) in (Union, types.UnionType):
        return " | ".join(_type_name(a) for a in get_args(hint))
    if hint is type(None):
        return "null"
    if hint is float:
        return "a finite number"
    return getattr(hint, "__name__", str(hint)) if get_origin(hint) is None else str(hint).replace("typing.", "")


def _mismatch(path: str, hint: Any, value: Any) -> ProtocolError:
    shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
    return ProtocolError(path, f"{path} must be {_type_name(hint)}, got {type(value).__name__} {shown}")


def _finite(value: float) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an int too large for a float
        return False


def check_value(value: Any, hint: Any, path: str) -> None:
    """Check that `value` (decoded JSON) has the type `hint` exactly: str, bool, int (not bool), float (int
    accepted; finite), None, Literal[...], list[X], dict[str, X], unions of those, Any.

    Raises:
        ProtocolError: field `path` (dotted; list items by index), naming the type wanted and the value got.
    """
    origin = get_origin(hint)
    if hint is Any:
        return
    if origin in (Union, types.UnionType):
        for option in get_args(hint):
            try:
                check_value(value, option, path)
                return
            except ProtocolError:
                continue
        raise _mismatch(path, hint, value)
    if origin is Literal:
        if not any(type(value) is type(a) and value == a for a in get_args(hint)):
            raise ProtocolError(path, f"{path} must be one of {_type_name(hint)}, got {value!r}")
        return
    if origin is list:
        if not isinstance(value, list):
            raise _mismatch(path, hint, value)
        (item,) = get_args(hint)
        for i, v in enumerate(value):
            check_value(v, item, _join(path, i))
        return
    if origin is dict:
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise _mismatch(path, hint, value)
        _, item = get_args(hint)
        for k, v in value.items():
            check_value(v, item, _join(path, k))
        return
    ok = {
        type(None): value is None,
        bool: type(value) is bool,
        int: isinstance(value, int) and not isinstance(value, bool),
        float: isinstance(value, int | float) and not isinstance(value, bool) and _finite(value),
        str: isinstance(value, str),
    }.get(hint)
    if ok is None:
        raise TypeError(f"check_value does not know the type {hint!r} (field {path})")
    if not ok:
        raise _mismatch(path, hint, value)


def check_types(obj: Any) -> None:
    """Check every field of the dataclass instance `obj` against its type hint (`check_value`).

    Raises:
        ProtocolError: the first field whose value does not have its type.
    """
    hints = get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        check_value(getattr(obj, f.name), hints[f.name], f.name)


def from_json(cls: type[T], body: Any, what: str, required: Iterable[str] = ()) -> T:  # noqa: UP047 (runs on 3.11)
    """Build the dataclass `cls` from a decoded JSON object, refusing what it does not declare.

    Args:
        cls: a protocol dataclass (keyword-only fields).
        body: the decoded JSON value (must be an object).
        what: the body's name in messages ("update_info").
        required: fields that must be present although the dataclass has a default for them (fields
            without a default are always required).

    Raises:
        ProtocolError: not an object (field ""), an unknown field (named, with the known ones), a
            missing required field (`required` True), or a value of the wrong type (`check_types`).
    """
    if not isinstance(body, dict):
        raise ProtocolError("", f"{what} must be a JSON object, got {type(body).__name__}")
    declared = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = [k for k in body if k not in declared]
    if unknown:
        raise ProtocolError(
            str(unknown[0]), f"unknown field {unknown[0]!r} in {what}; its fields are {', '.join(declared)}"
        )
    must = set(required) | {
        n for n, f in declared.items() if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    }
    missing = [n for n in declared if n in must and n not in body]
    if missing:
        raise ProtocolError(missing[0], f"Field required in {what}", required=True)
    hints = get_type_hints(cls)
    for key, value in body.items():
        check_value(value, hints[key], key)
    return cls(**body)
