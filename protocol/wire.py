"""Typed messages: a kind, a schema version, and strict decoding (msgspec Structs).

Every message class is a `Struct` (a msgspec Struct that refuses unknown fields) registered
with `@message(kind, version)`. On the wire a message is the msgpack map
``{"kind": str, "v": int, "body": {field: value}}``. Decoding reads the envelope, looks the
kind up, checks the version, and lets msgspec build the Struct from the body in one pass
(types, `Meta` ranges and ``__post_init__`` checks). An unknown field, a missing required
field or a wrong value raises a `FieldError` whose text names the field path
(``body.cameras[1].height``): msgspec's ``at `$.cameras[1].height``` becomes ours::

    @message("demo.ping", 1)
    class Ping(Struct):
        text: str
        count: Annotated[int, Meta(ge=1)] = 1

    raw = encode(Ping("hi"))
    assert decode(raw, Ping) == Ping("hi")

Arrays and tensors (fields annotated `Array`) travel as the msgpack ext of `protocol.codec`.
Nested types are Structs too (strict at every depth); a plain class that is not a Struct is
refused at registration, so a type cannot silently lose the strict checks.
"""

from __future__ import annotations

import abc
import datetime
import re
import sys
import typing
from typing import Any, ClassVar, TypeVar

import msgspec
import numpy as np

from protocol.codec import msgspec_enc_hook, msgspec_ext_hook
from protocol.codec import packb, unpackb  # noqa: F401 - callers build raw envelopes with them
from protocol.errors import (
    InvalidField,
    MissingField,
    ProtocolError,
    UnknownField,
    UnknownKind,
    UnsupportedVersion,
)

T = TypeVar("T")


class Struct(msgspec.Struct, forbid_unknown_fields=True):
    """Base of every wire type: a mutable msgspec Struct that refuses unknown fields."""


class Array(abc.ABC):
    """Annotation for a field holding a numpy array or a torch tensor.

    An ABC so that msgspec's isinstance check on decode accepts both without importing torch
    (a tensor can only have been decoded, or built, by a process that imported it)."""

    @classmethod
    def __subclasshook__(cls, sub: type) -> bool:
        if issubclass(sub, np.ndarray):
            return True
        torch = sys.modules.get("torch")
        return True if torch is not None and issubclass(sub, torch.Tensor) else NotImplemented


class Message:
    """Optional mixin that gives type checkers KIND / VERSION; not required."""

    KIND: ClassVar[str]
    VERSION: ClassVar[int]


_REGISTRY: dict[str, type] = {}
_DECODERS: dict[type, msgspec.msgpack.Decoder] = {}


def message(kind: str, version: int = 1):
    """Class decorator: register a `Struct` as a wire message of ``kind``."""

    def wrap(cls: type[T]) -> type[T]:
        if not (isinstance(cls, type) and issubclass(cls, Struct)):
            raise TypeError(f"{getattr(cls, '__name__', cls)} must subclass protocol.wire.Struct "
                            "(a msgspec Struct that refuses unknown fields), not be a dataclass")
        if kind in _REGISTRY and _REGISTRY[kind] is not cls:
            raise TypeError(f"message kind {kind!r} registered twice")
        cls.KIND = kind  # type: ignore[attr-defined]
        cls.VERSION = version  # type: ignore[attr-defined]
        _REGISTRY[kind] = cls
        return cls

    return wrap


def registered_kinds() -> dict[str, type]:
    return dict(_REGISTRY)


def to_body(msg: Any) -> dict[str, Any]:
    """Struct -> plain dict (nested Structs become dicts, arrays stay arrays)."""
    return {name: _to_plain(getattr(msg, name)) for name in msg.__struct_fields__}


def _to_plain(value: Any) -> Any:
    if isinstance(value, msgspec.Struct):
        return to_body(value)
    if isinstance(value, list | tuple):
        return [_to_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _to_plain(v) for k, v in value.items()}
    return value


# -- encode ---------------------------------------------------------------------------------
class _Envelope(msgspec.Struct, forbid_unknown_fields=True):
    kind: str
    v: int
    body: msgspec.Raw  # decoded in a second pass, once the kind names the type


class _OutEnvelope(msgspec.Struct):
    kind: str
    v: int
    body: Any


_ENCODER = msgspec.msgpack.Encoder(enc_hook=msgspec_enc_hook)
_ENVELOPE_DECODER = msgspec.msgpack.Decoder(_Envelope)


def encode(msg: Any) -> bytes:
    kind = getattr(type(msg), "KIND", None)
    if kind is None:
        raise TypeError(f"{type(msg).__name__} is not a registered message")
    try:
        return _ENCODER.encode(_OutEnvelope(kind, type(msg).VERSION, msg))
    except ProtocolError:
        raise
    except (TypeError, ValueError, OverflowError) as exc:
        raise ProtocolError(f"cannot encode message: {exc}") from None


# -- decode ---------------------------------------------------------------------------------
def _read_envelope(data: bytes) -> _Envelope:
    try:
        return _ENVELOPE_DECODER.decode(data)
    except msgspec.ValidationError as exc:
        text, at = _split(str(exc))
        if at is None and text.startswith("Expected `object`"):
            raise ProtocolError("message must be a map with keys kind, v, body") from None
        if m := _UNKNOWN.match(text):
            raise UnknownField(m[1], "unknown envelope key; expected kind, v, body") from None
        if m := _MISSING.match(text):
            raise MissingField(m[1], "required envelope key is missing") from None
        if at == "$.kind":
            raise InvalidField("kind", "must be a string") from None
        if at == "$.v":
            raise InvalidField("v", "must be an integer") from None
        raise ProtocolError(f"bad envelope: {exc}") from None
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"malformed msgpack body: {exc}") from None


def decode_envelope(data: bytes) -> tuple[str, int, dict[str, Any]]:
    """The envelope's kind, version and body (as plain data), whatever the kind."""
    env = _read_envelope(data)
    try:
        body = msgspec.msgpack.decode(env.body, ext_hook=msgspec_ext_hook)
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"malformed msgpack body: {exc}") from None
    if not isinstance(body, dict):
        raise InvalidField("body", "must be a map")
    return env.kind, env.v, body


def _decoder(cls: type) -> msgspec.msgpack.Decoder:
    dec = _DECODERS.get(cls)
    if dec is None:
        dec = _DECODERS[cls] = msgspec.msgpack.Decoder(cls, ext_hook=msgspec_ext_hook, dec_hook=_dec_hook)
    return dec


def _dec_hook(tp: type, obj: Any) -> Any:
    # msgspec hands every value of a type it does not know (here `Array`: decoded by the ext
    # hook, or something else) to this hook, and checks what it returns with isinstance.
    if tp is Array:
        if isinstance(obj, Array):
            return obj
        raise ValueError(f"expected an array, got {type(obj).__name__}")
    raise NotImplementedError(f"unsupported annotation {tp!r} in a message class")


def decode(data: bytes, expect: type[T] | tuple[type, ...] | None = None) -> T:
    """Decode bytes into the registered message class named by the envelope's kind.

    ``expect`` restricts which classes are acceptable (an UnknownKind error otherwise).
    """
    env = _read_envelope(data)
    kind, version = env.kind, env.v
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
    try:
        msg = _decoder(cls).decode(env.body)
    except msgspec.ValidationError as exc:
        raise _field_error(exc, cls, env.body) from None
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"malformed msgpack body: {exc}") from None
    _check_free_values(msg, cls)
    return msg


# -- free-form fields (annotated Any) ---------------------------------------------------------
# msgspec decodes anything msgpack carries into an ``Any`` field, including what the codec
# never sends (a map with non-string keys, a msgpack timestamp as a datetime). The hand-written
# decoder refused both (msgpack's strict_map_key, no timestamp extension); these checks keep
# that contract for what a sender puts into a spec, options or a config: plain data only.
_FREE_FIELDS: dict[type, tuple[str, ...]] = {}


def _mentions_any(tp: Any) -> bool:
    return tp is Any or any(_mentions_any(a) for a in typing.get_args(tp))


def _free_fields(cls: type) -> tuple[str, ...]:
    names = _FREE_FIELDS.get(cls)
    if names is None:
        names = _FREE_FIELDS[cls] = tuple(f.name for f in msgspec.structs.fields(cls) if _mentions_any(f.type))
    return names


def _check_free_values(msg: Any, cls: type) -> None:
    for name in _free_fields(cls):
        stack: list[tuple[str, Any]] = [(f"body.{name}", getattr(msg, name))]
        while stack:
            path, value = stack.pop()
            if isinstance(value, dict):
                for key, item in value.items():
                    if not isinstance(key, str):
                        raise InvalidField(path, f"map keys must be strings, got {type(key).__name__} {key!r}")
                    stack.append((f"{path}.{key}", item))
            elif isinstance(value, list):
                stack.extend((f"{path}[{i}]", item) for i, item in enumerate(value))
            elif isinstance(value, datetime.datetime):
                raise InvalidField(path, "a timestamp is not plain data (send a number or a string)")


# -- msgspec's errors in our terms ------------------------------------------------------------
# msgspec says "<what> - at `$.a[1].b`" (or "at `key` in `$.a`" for a map key); we say
# "body.a[1].b: <what>", with the error class the wire contract names.
_AT = re.compile(r"^(.*?) - at `(?:(key)` in `)?(\$[^`]*)`$", re.S)
_UNKNOWN = re.compile(r"^Object contains unknown field `(.*)`$", re.S)
_MISSING = re.compile(r"^Object missing required field `(.*)`$", re.S)
_EXPECTED = re.compile(r"^Expected `([^`]*)`, got `([^`]*)`$", re.S)
_BOUND = re.compile(r"^Expected `([^`]*)`(?: of length)? (>=|<=|>|<) (\S+)$", re.S)
_ENUM = re.compile(r"^Invalid enum value (.*)$", re.S)
_WANT = {"int": "an integer", "float": "a number", "array": "a list", "object": "a map"}
_GOT = {"array": "list", "object": "dict", "null": "NoneType"}
_STEP = re.compile(r"\.([^.\[]+)|\[(\d+|\.\.\.)\]")


def _split(text: str) -> tuple[str, str | None]:
    m = _AT.match(text)
    if m is None:
        return text, None
    return m[1], m[3] + ("<key>" if m[2] else "")


def _path(at: str | None) -> str:
    return "body" + (at or "$")[1:]


def _steps(at: str) -> list[str | int]:
    out: list[str | int] = []
    for name, index in _STEP.findall(at.removesuffix("<key>")[1:]):
        out.append(name if name else (int(index) if index.isdigit() else "..."))
    return out


def _type_at(cls: type, steps: list[str | int]) -> Any:
    """The annotation at a path inside ``cls`` (None where it cannot be told)."""
    tp: Any = cls
    for step in steps:
        tp = _unwrap(tp)
        if isinstance(tp, type) and issubclass(tp, msgspec.Struct) and isinstance(step, str):
            tp = next((f.type for f in msgspec.structs.fields(tp) if f.name == step), None)
        elif typing.get_origin(tp) in (list, tuple) and not isinstance(step, str):
            tp = (typing.get_args(tp) or (Any,))[0]
        elif typing.get_origin(tp) is dict:
            tp = (typing.get_args(tp) or (Any, Any))[1]
        else:
            return None
    return _unwrap(tp)


def _unwrap(tp: Any) -> Any:
    """Strip Annotated and Optional: what the value itself must be."""
    while True:
        if typing.get_origin(tp) is typing.Annotated:
            tp = typing.get_args(tp)[0]
            continue
        args = typing.get_args(tp)
        if args and type(None) in args and typing.get_origin(tp) is not typing.Literal:
            rest = [a for a in args if a is not type(None)]
            if len(rest) == 1:
                tp = rest[0]
                continue
        return tp


def _value_at(raw: bytes, steps: list[str | int]) -> Any:
    """The offending value, read again from the body (only on the error path)."""
    try:
        value = msgspec.msgpack.decode(raw, ext_hook=msgspec_ext_hook)
        for step in steps:
            value = value[step]
        return value
    except Exception:  # a value that cannot be read back: the message says less, no more
        return None


def _name_map_keys(cls: type, raw: bytes, at: str) -> str:
    """msgspec writes a map value's place as ``[...]``; find the entry that fails and name its
    key (``images.wrist``), as a reader of the error needs."""
    while "[...]" in at:
        head, tail = at.split("[...]", 1)
        steps = _steps(head)
        entries, val_tp = _value_at(raw, steps), _type_at(cls, steps + ["..."])
        key = "..."
        if isinstance(entries, dict) and val_tp is not None:
            for k, v in entries.items():
                try:
                    msgspec.convert(v, val_tp, dec_hook=_dec_hook)
                except (msgspec.ValidationError, ProtocolError, TypeError, ValueError):
                    key = str(k)
                    break
        at = f"{head}.{key}{tail}"
    return at


def _field_error(exc: msgspec.ValidationError, cls: type, raw: bytes) -> ProtocolError:
    cause = exc.__cause__
    if isinstance(cause, ProtocolError):
        return cause  # a __post_init__ check: it names its field already
    text, at = _split(str(exc))
    if at is not None and "[...]" in at:
        at = _name_map_keys(cls, raw, at)
    path = _path(at)
    if cause is not None and not isinstance(cause, msgspec.ValidationError):
        return InvalidField(path, str(cause))  # a TypeError / ValueError from __post_init__ or a hook
    if m := _UNKNOWN.match(text):
        tp = _type_at(cls, _steps(at or "$"))
        is_struct = isinstance(tp, type) and issubclass(tp, msgspec.Struct)
        known = sorted(f.name for f in msgspec.structs.fields(tp)) if is_struct else []
        return UnknownField(f"{path}.{m[1]}", f"unknown field; {getattr(tp, '__name__', '?')} has {known}")
    if m := _MISSING.match(text):
        return MissingField(f"{path}.{m[1]}", "required field is missing")
    if m := _EXPECTED.match(text):
        want = [w for w in m[1].split(" | ") if w != "null"]
        want_text = _WANT.get(want[0], want[0]) if len(want) == 1 else m[1].replace("null", "None")
        return InvalidField(path, f"expected {want_text}, got {_GOT.get(m[2], m[2])}")
    if m := _ENUM.match(text):
        lit = _type_at(cls, _steps(at or "$"))
        allowed = list(typing.get_args(lit)) if typing.get_origin(lit) is typing.Literal else "see the schema"
        return InvalidField(path, f"{m[1]} is not allowed; allowed: {allowed}")
    if m := _BOUND.match(text):
        value = _value_at(raw, _steps(at or "$"))
        if "of length" in text:
            n = len(value) if isinstance(value, list | dict | str | bytes) else "?"
            return InvalidField(path, f"must have {m[2]} {m[3]} items, got {n}")
        return InvalidField(path, f"must be {m[2]} {m[3]}, got {value!r}")
    return InvalidField(path, text[:1].lower() + text[1:])
