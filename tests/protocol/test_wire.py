"""Typed messages: kind + version, strict decoding with errors that name the field."""

from __future__ import annotations

import numpy as np
import pytest
from msgspec import field

from protocol.codec import packb
from protocol.errors import (
    ErrorCode,
    InvalidField,
    MissingField,
    NotFound,
    ProtocolError,
    UnknownField,
    UnknownKind,
    UnsupportedVersion,
    error_from_code,
)
from protocol.messages import ErrorReply, Heartbeat, RoleInfo, ok_or_raise
from protocol.wire import Array, Struct, decode, encode, message


class Camera(Struct):
    name: str
    height: int
    width: int


@message("test.obs", 3)
class Obs(Struct):
    tenant: str
    cameras: list[Camera]
    state: Array
    scale: float = 1.0
    tags: dict[str, str] = field(default_factory=dict)
    note: str | None = None


def _obs() -> Obs:
    return Obs("acme", [Camera("front", 224, 224)], np.zeros(8, np.float32), 2.0, {"a": "b"})


def test_roundtrip_keeps_type_and_nested_values():
    back = decode(encode(_obs()), Obs)
    assert isinstance(back, Obs) and isinstance(back.cameras[0], Camera)
    assert back.cameras[0].height == 224 and back.tags == {"a": "b"} and back.scale == 2.0
    np.testing.assert_array_equal(back.state, np.zeros(8, np.float32))


def _raw(body, kind="test.obs", v=3):
    return packb({"kind": kind, "v": v, "body": body})


def test_unknown_field_named():
    body = {"tenant": "a", "cameras": [], "state": np.zeros(1), "colour": "red"}
    with pytest.raises(UnknownField, match=r"body\.colour: unknown field") as e:
        decode(_raw(body))
    assert e.value.code == ErrorCode.UNKNOWN_FIELD and e.value.field == "body.colour"


def test_missing_field_named_including_nested():
    with pytest.raises(MissingField, match=r"body\.state: required"):
        decode(_raw({"tenant": "a", "cameras": []}))
    with pytest.raises(MissingField, match=r"body\.cameras\[0\]\.width"):
        decode(_raw({"tenant": "a", "cameras": [{"name": "c", "height": 1}], "state": np.zeros(1)}))


def test_wrong_types_named():
    cases = [
        ({"tenant": 5, "cameras": [], "state": np.zeros(1)}, r"body\.tenant: expected str"),
        ({"tenant": "a", "cameras": {}, "state": np.zeros(1)}, r"body\.cameras: expected a list"),
        ({"tenant": "a", "cameras": [{"name": "c", "height": True, "width": 1}], "state": np.zeros(1)},
         r"body\.cameras\[0\]\.height: expected an integer"),
        ({"tenant": "a", "cameras": [], "state": [1, 2]}, r"body\.state: expected an array"),
        ({"tenant": "a", "cameras": [], "state": np.zeros(1), "scale": "x"}, r"body\.scale: expected a number"),
    ]
    for body, pattern in cases:
        with pytest.raises(InvalidField, match=pattern):
            decode(_raw(body))


def test_literal_checked():
    hb = Heartbeat("r", "i", 1, "h", 0.0, 0.0, 1, "ready", 0, 1.0)
    raw = encode(hb).replace(b"ready", b"sleep")
    with pytest.raises(InvalidField, match=r"body\.state: 'sleep' is not allowed"):
        decode(raw)


def test_envelope_errors():
    with pytest.raises(UnknownKind, match="unknown message kind 'nope'"):
        decode(_raw({}, kind="nope"))
    with pytest.raises(UnsupportedVersion, match="version 2"):
        decode(_raw({}, v=2))
    with pytest.raises(MissingField, match="body"):
        decode(packb({"kind": "test.obs", "v": 3}))
    with pytest.raises(UnknownField, match="extra"):
        decode(packb({"kind": "test.obs", "v": 3, "body": {}, "extra": 1}))
    with pytest.raises(ProtocolError, match="must be a map"):
        decode(packb([1, 2]))
    with pytest.raises(UnknownKind, match="not accepted here"):
        decode(encode(_obs()), RoleInfo)


def test_error_envelope_roundtrip_to_exception():
    reply = ErrorReply.from_exception(NotFound("tenant 'x' not found", details={"tenant": "x"}))
    back = decode(encode(reply))
    with pytest.raises(NotFound, match="tenant 'x' not found") as e:
        ok_or_raise(back)
    assert e.value.details == {"tenant": "x"}
    field_err = error_from_code("missing_field", "body.a: required field is missing", {"field": "body.a"})
    assert isinstance(field_err, MissingField) and field_err.field == "body.a"
    assert isinstance(field_err, ValueError)  # exception root subclasses stdlib types
    unknown = error_from_code("brand_new_code", "x")
    assert unknown.code == ErrorCode.INTERNAL and "brand_new_code" in unknown.message


def test_numpy_scalars_that_are_python_numbers_travel_as_numbers():
    # np.float64 subclasses float: msgpack wrote it as a float, and metrics carry them.
    hb = Heartbeat("r", "i", 1, "h", 0.0, 0.0, 1, "ready", 0, np.float64(1.5), gauges={"busy_s": np.float64(2.0)})
    back = decode(encode(hb), Heartbeat)
    assert back.interval_s == 1.5 and type(back.interval_s) is float and back.gauges == {"busy_s": 2.0}


def test_free_form_fields_carry_plain_data_only():
    """A spec, options or config field (annotated Any) takes what a JSON document can hold:
    a map with a non-string key or a msgpack timestamp anywhere inside it is refused, naming
    where (the hand-written decoder refused both; msgspec alone would decode them)."""
    import datetime

    import msgspec

    from protocol.messages import SubmitRequest

    spec = {"env": {"options": {"cams": [1, "x", {"k": 2.5}]}}}
    assert decode(encode(SubmitRequest(spec=spec)), SubmitRequest).spec == spec
    bad_key = packb({"kind": SubmitRequest.KIND, "v": 1, "body": {"spec": {"env": [{"a": {3: 4}}]}}})
    with pytest.raises(InvalidField) as err:
        decode(bad_key, SubmitRequest)
    assert err.value.details["field"] == "body.spec.env[0].a" and "map keys must be strings" in str(err.value)
    stamp = msgspec.msgpack.encode({"kind": SubmitRequest.KIND, "v": 1,
                                    "body": {"spec": {"at": [datetime.datetime.now(datetime.timezone.utc)]}}})
    with pytest.raises(InvalidField) as err:
        decode(stamp, SubmitRequest)
    assert err.value.details["field"] == "body.spec.at[0]" and "timestamp" in str(err.value)
