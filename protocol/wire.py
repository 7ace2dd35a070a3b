"""Typed messages: a kind, a schema version, and strict decoding.

Every message class is a dataclass registered with `@message(kind, version)`. On the wire a
message is the msgpack map ``{"kind": str, "v": int, "body": {field: value}}``. Decoding
looks the kind up, checks the version, and builds the dataclass field by field: an unknown
field, a missing required field or a value of the wrong type raises a `FieldError` whose
text names the field path (``body.cameras[1].height``)::

    @message("demo.ping", 1)
    @dataclass
    class Ping:
        text: str
        count: int = 1

    raw = encode(Ping("hi"))
    assert decode(raw, Ping) == Ping("hi")
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, ClassVar, TypeVar, Union

import numpy as np

from protocol.codec import packb, unpackb
from protocol.errors import (
    InvalidField,
    MissingField,
    ProtocolError,
    UnknownField,
    UnknownKind,
    UnsupportedVersion,
)

T = TypeVar("T")

_REGISTRY: dict[str, type] = {}
_HINTS: dict[type, dict[str, Any]] = {}


class Array:
    """Annotation for a field holding a numpy array or a torch tensor."""


def message(kind: str, version: int = 1):
    """Class decorator: register a dataclass as a wire message of ``kind``."""

    def wrap(cls: type[T]) -> type[T]:
        if not dataclasses.is_dataclass(cls):
            raise TypeError(f"{cls.__name__} must be a dataclass")
        if kind in _REGISTRY and _REGISTRY[kind] is not cls:
            raise TypeError(f"message kind {kind!r} registered twice")
        cls.KIND = kind  # type: ignore[attr-defined]
        cls.VERSION = version  # type: ignore[attr-defined]
        _REGISTRY[kind] = cls
        return cls

    return wrap


class Message:
    """Optional mixin that gives type checkers KIND / VERSION; not required."""

    KIND: ClassVar[str]
    VERSION: ClassVar[int]


def registered_kinds() -> dict[str, type]:
    return dict(_REGISTRY)


def to_body(msg: Any) -> dict[str, Any]:
    """Dataclass -> plain dict (nested messages become dicts, arrays stay arrays)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(msg):
        out[f.name] = _to_plain(getattr(msg, f.name))
    return out


def _to_plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return to_body(value)
    if isinstance(value, list | tuple):
        return [_to_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _to_plain(v) for k, v in value.items()}
    return value


def encode(msg: Any) -> bytes:
    kind = getattr(type(msg), "KIND", None)
    if kind is None:
        raise TypeError(f"{type(msg).__name__} is not a registered message")
    return packb({"kind": kind, "v": type(msg).VERSION, "body": to_body(msg)})


def decode_envelope(data: bytes) -> tuple[str, int, dict[str, Any]]:
    env = unpackb(data)
    if not isinstance(env, dict):
        raise ProtocolError("message must be a map with keys kind, v, body")
    for key in env:
        if key not in ("kind", "v", "body"):
            raise UnknownField(str(key), "unknown envelope key; expected kind, v, body")
    for key in ("kind", "v", "body"):
        if key not in env:
            raise MissingField(key, "required envelope key is missing")
    kind, version, body = env["kind"], env["v"], env["body"]
    if not isinstance(kind, str):
        raise InvalidField("kind", "must be a string")
    if not isinstance(version, int) or isinstance(version, bool):
        raise InvalidField("v", "must be an integer")
    if not isinstance(body, dict):
        raise InvalidField("body", "must be a map")
    return kind, version, body


def decode(data: bytes, expect: type[T] | tuple[type, ...] | None = None) -> T:
    """Decode bytes into the registered message class named by the envelope's kind.

    ``expect`` restricts which classes are acceptable (an UnknownKind error otherwise).
    """
    kind, version, body = decode_envelope(data)
    cls = _REGISTRY.get(kind)
    if cls is None:
        raise UnknownKind(f"unknown message kind {kind!r}", details={"kind": kind})
    if expect is not None:
        allowed = expect if isinstance(expect, tuple) else (expect,)
        if cls not in allowed:
            names = ", ".join(c.KIND for c in allowed)  # type: ignore[attr-defined]
            raise UnknownKind(
                f"message kind {kind!r} is not accepted here; expected {names}",
                details={"kind": kind},
            )
    if version != cls.VERSION:  # type: ignore[attr-defined]
        raise UnsupportedVersion(
            f"{kind} schema version {version} is not supported; this side speaks {cls.VERSION}",  # type: ignore[attr-defined]
            details={"kind": kind, "version": version},
        )
    return from_body(cls, body, "body")


def _hints(cls: type) -> dict[str, Any]:
    hints = _HINTS.get(cls)
    if hints is None:
        hints = typing.get_type_hints(cls)
        _HINTS[cls] = hints
    return hints


def from_body(cls: type[T], body: Any, path: str) -> T:
    if not isinstance(body, dict):
        raise InvalidField(path, f"must be a map for {cls.__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    for key in body:
        if key not in fields:
            raise UnknownField(f"{path}.{key}", f"unknown field; {cls.__name__} has {sorted(fields)}")
    hints = _hints(cls)
    kwargs: dict[str, Any] = {}
    for name, f in fields.items():
        fpath = f"{path}.{name}"
        if name not in body:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise MissingField(fpath, "required field is missing")
            continue
        kwargs[name] = _check(fpath, body[name], hints[name])
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:
        # __post_init__ validation speaks in field terms already; keep its text.
        if isinstance(exc, ProtocolError):
            raise
        raise InvalidField(path, str(exc)) from None


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _check(path: str, value: Any, tp: Any) -> Any:
    """Check ``value`` against annotation ``tp``; return it (converted where lossless)."""
    if tp is Any:
        return value
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None:
            if type(None) in args:
                return None
            raise InvalidField(path, "must not be null")
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _check(path, value, arg)
            except InvalidField as exc:
                errors.append(exc)
        raise errors[0] if len(errors) == 1 else InvalidField(
            path, f"expected {_type_name(tp)}, got {type(value).__name__}"
        )
    if origin is typing.Literal:
        allowed = typing.get_args(tp)
        if value not in allowed:
            raise InvalidField(path, f"{value!r} is not allowed; allowed: {list(allowed)}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise InvalidField(path, f"expected a list, got {type(value).__name__}")
        (item_tp,) = typing.get_args(tp) or (Any,)
        return [_check(f"{path}[{i}]", v, item_tp) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise InvalidField(path, f"expected a map, got {type(value).__name__}")
        key_tp, val_tp = typing.get_args(tp) or (Any, Any)
        return {
            _check(f"{path}<key>", k, key_tp): _check(f"{path}.{k}", v, val_tp)
            for k, v in value.items()
        }
    if tp is Array:
        if isinstance(value, np.ndarray) or type(value).__name__ == "Tensor":
            return value
        raise InvalidField(path, f"expected an array, got {type(value).__name__}")
    if dataclasses.is_dataclass(tp):
        return from_body(tp, value, path)
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise InvalidField(path, f"expected a number, got {type(value).__name__}")
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise InvalidField(path, f"expected an integer, got {type(value).__name__}")
        return value
    if tp in (str, bool, bytes):
        if not isinstance(value, tp):
            raise InvalidField(path, f"expected {tp.__name__}, got {type(value).__name__}")
        return value
    raise TypeError(f"{path}: unsupported annotation {tp!r} in a message class")
