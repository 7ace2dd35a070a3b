"""The msgpack codec: arrays of every dtype the models use round-trip; bad bytes are refused."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
import torch

from protocol.codec import EXT_NDARRAY, EXT_TENSOR, packb, unpackb
from protocol.errors import ProtocolError

NUMPY_DTYPES = ["bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
                "float16", "float32", "float64"]
TORCH_DTYPES = [torch.bool, torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64,
                torch.float16, torch.bfloat16, torch.float32, torch.float64]
SHAPES = [(), (0,), (7,), (2, 3), (2, 3, 4, 5), (1, 224, 224, 3)]


def _rand_np(dtype: str, shape) -> np.ndarray:
    rng = np.random.default_rng(0)
    if dtype == "bool":
        return np.asarray(rng.random(shape) > 0.5)
    if dtype.startswith(("int", "uint")):
        info = np.iinfo(dtype)
        return np.asarray(rng.integers(max(info.min, -1000), min(info.max, 1000), size=shape, dtype=dtype))
    return np.asarray(rng.standard_normal(shape)).astype(dtype)


@pytest.mark.parametrize("dtype", NUMPY_DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_numpy_roundtrip(dtype, shape):
    arr = _rand_np(dtype, shape)
    out = unpackb(packb({"x": arr}))["x"]
    assert out.dtype == arr.dtype and out.shape == arr.shape
    np.testing.assert_array_equal(out, arr)


@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES)
def test_torch_roundtrip(dtype, shape):
    t = (torch.randn(shape) * 100).to(dtype)
    out = unpackb(packb([t]))[0]
    assert isinstance(out, torch.Tensor)
    assert out.dtype == dtype and tuple(out.shape) == tuple(shape)
    assert torch.equal(out, t)  # bit-exact, bf16 included
    out.add_(0) if dtype != torch.bool else None  # decoded tensors own writable memory


def test_non_contiguous_and_nested():
    t = torch.arange(24, dtype=torch.float32).reshape(4, 6).t()
    a = np.arange(24, dtype=np.int64).reshape(4, 6)[:, ::2]
    out = unpackb(packb({"nested": {"t": t, "list": [a, 1, "s", b"raw", None, 2.5]}}))
    assert torch.equal(out["nested"]["t"], t)
    np.testing.assert_array_equal(out["nested"]["list"][0], a)
    assert out["nested"]["list"][1:] == [1, "s", b"raw", None, 2.5]


def test_big_endian_numpy_is_normalised():
    arr = np.arange(5, dtype=">i4")
    np.testing.assert_array_equal(unpackb(packb(arr)), np.arange(5, dtype="<i4"))


def test_rejects_object_arrays_and_unknown_types():
    with pytest.raises(ProtocolError, match="dtype 'object'"):
        packb(np.array([object()], dtype=object))
    with pytest.raises(ProtocolError, match="cannot encode"):
        packb({"x": object()})
    with pytest.raises(ProtocolError, match="complex"):
        packb(torch.zeros(2, dtype=torch.complex64))


def test_unknown_ext_code_rejected():
    data = msgpack.packb(msgpack.ExtType(42, b"whatever"))
    with pytest.raises(ProtocolError, match="unknown msgpack ext type code 42"):
        unpackb(data)


@pytest.mark.parametrize("value", [np.arange(100, dtype=np.float32), torch.arange(100, dtype=torch.float32)],
                         ids=["numpy", "torch"])
def test_truncated_data_rejected(value):
    data = packb({"x": value})
    for cut in (1, 10, len(data) // 2, len(data) - 1):
        with pytest.raises(ProtocolError):
            unpackb(data[:cut])


@pytest.mark.parametrize("code", [EXT_NDARRAY, EXT_TENSOR])
def test_forged_headers_rejected(code):
    def ext(header):
        return msgpack.packb(msgpack.ExtType(code, msgpack.packb(header, use_bin_type=True)), use_bin_type=True)

    with pytest.raises(ProtocolError, match="expected 40 bytes, got 8"):
        unpackb(ext(["float32", [10], b"\0" * 8]))  # shape says more than the bytes hold
    with pytest.raises(ProtocolError, match="not allowed"):
        unpackb(ext(["object", [1], b"\0" * 8]))
    with pytest.raises(ProtocolError, match="non-negative"):
        unpackb(ext(["float32", [-1], b""]))
    with pytest.raises(ProtocolError, match="header must be"):
        unpackb(ext(["float32", [1]]))
    with pytest.raises(ProtocolError, match="malformed header"):
        unpackb(msgpack.packb(msgpack.ExtType(code, b"\xc1")))


def test_garbage_rejected():
    for junk in (b"", b"\xc1", b"\x92\x01", packb({"a": 1}) + b"extra"):
        with pytest.raises(ProtocolError):
            unpackb(junk)
