"""msgpack codec with an ext type for numpy arrays and torch tensors. No pickle anywhere.

An array travels as ext data ``msgpack([dtype, shape, raw_bytes])`` (C order). Decoding
checks the ext code, the dtype against an allow-list, the shape, and that the byte count
equals ``prod(shape) * itemsize``; anything else raises `ProtocolError`, so a truncated or
forged payload never becomes a tensor of the wrong size::

    data = packb({"obs": np.zeros((2, 3), np.float32)})
    obj = unpackb(data)

Decoded numpy arrays and torch tensors own writable memory: one copy of the raw bytes per
array. A read-only view of the bytes (zero-copy) was the old behaviour; it reached torch
(``torch.from_numpy`` / ``torch.as_tensor`` alias it), where any in-place op is undefined
behaviour on memory Python believes immutable, and PyTorch warns about it. One memcpy per
decoded array (a few MB of frames at most per message, ~1 ms) buys consumers that can never
write into a ``bytes`` object, whatever they do with the array (issue 24).
"""

from __future__ import annotations

import sys
from math import prod
from typing import Any

import msgpack
import msgspec
import numpy as np

from protocol.errors import ProtocolError

EXT_NDARRAY = 1
EXT_TENSOR = 2

# Every dtype the models and simulators use. Object arrays are never allowed: they would
# need pickle. bfloat16 exists only for torch (numpy has no native bf16).
_NUMPY_DTYPES = (
    "bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
    "float16", "float32", "float64",
)
_TORCH_DTYPES = (
    "bool", "int8", "uint8", "int16", "int32", "int64",
    "float16", "bfloat16", "float32", "float64",
)
_TORCH_ITEMSIZE = {
    "bool": 1, "int8": 1, "uint8": 1, "int16": 2, "int32": 4, "int64": 8,
    "float16": 2, "bfloat16": 2, "float32": 4, "float64": 8,
}
# Upper bound on dimensions: a guard against forged headers, far above any real tensor.
_MAX_NDIM = 16


def _is_tensor(obj: Any) -> bool:
    torch = sys.modules.get("torch")  # only if the process already imported torch
    return torch is not None and isinstance(obj, torch.Tensor)


def _pack_header(name: str, shape: list[int], raw: Any) -> bytes:
    """``msgpack.packb([name, shape, raw])``, byte for byte, copying the array's bytes once (not
    once into ``tobytes()`` and again into the header): frames are most of a message's bytes."""
    n = len(raw)  # a flat uint8 view: its length is its byte count
    head = msgpack.packb([name, shape, b""], use_bin_type=True)[:-2]  # less the empty bin (c4 00)
    if n < 1 << 8:
        size = b"\xc4" + n.to_bytes(1, "big")
    elif n < 1 << 16:
        size = b"\xc5" + n.to_bytes(2, "big")
    else:
        size = b"\xc6" + n.to_bytes(4, "big")
    return b"".join((head, size, raw))


def _encode_ext(obj: Any) -> msgpack.ExtType:
    if isinstance(obj, np.ndarray):
        name = obj.dtype.name
        if name not in _NUMPY_DTYPES:
            raise ProtocolError(f"cannot encode numpy array of dtype {name!r}; allowed: {_NUMPY_DTYPES}")
        # Not np.ascontiguousarray: it turns a 0-d array into shape (1,).
        arr = obj if obj.flags.c_contiguous else obj.copy(order="C")
        if arr.dtype.byteorder == ">":
            arr = arr.astype(arr.dtype.newbyteorder("<"))
        return msgpack.ExtType(EXT_NDARRAY, _pack_header(name, list(arr.shape), arr.reshape(-1).view(np.uint8).data))
    if isinstance(obj, np.generic):
        return _encode_ext(np.asarray(obj))
    if _is_tensor(obj):
        import torch

        name = str(obj.dtype).removeprefix("torch.")
        if name not in _TORCH_DTYPES:
            raise ProtocolError(f"cannot encode torch tensor of dtype {name!r}; allowed: {_TORCH_DTYPES}")
        t = obj.detach().to("cpu").contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy().data if t.numel() else b""
        return msgpack.ExtType(EXT_TENSOR, _pack_header(name, list(t.shape), raw))
    raise TypeError(f"cannot encode object of type {type(obj).__name__}")


def _default(obj: Any) -> Any:
    try:
        return _encode_ext(obj)
    except TypeError as exc:
        raise ProtocolError(str(exc)) from None


def _read_header(code: int, data: bytes, allowed: tuple[str, ...]) -> tuple[str, list[int], bytes]:
    try:
        header = msgpack.unpackb(data, raw=False, use_list=True)
    except Exception as exc:  # msgpack raises several types for bad input
        raise ProtocolError(f"array ext {code}: malformed header ({exc})") from None
    if not (isinstance(header, list) and len(header) == 3):
        raise ProtocolError(f"array ext {code}: header must be [dtype, shape, bytes]")
    dtype, shape, raw = header
    if dtype not in allowed:
        raise ProtocolError(f"array ext {code}: dtype {dtype!r} not allowed; allowed: {allowed}")
    if (
        not isinstance(shape, list)
        or len(shape) > _MAX_NDIM
        or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
    ):
        raise ProtocolError(f"array ext {code}: shape {shape!r} is not a list of non-negative ints")
    if not isinstance(raw, bytes):
        raise ProtocolError(f"array ext {code}: data must be bytes")
    return dtype, shape, raw


def _ext_hook(code: int, data: bytes) -> Any:
    if code == EXT_NDARRAY:
        dtype, shape, raw = _read_header(code, data, _NUMPY_DTYPES)
        want = prod(shape) * np.dtype(dtype).itemsize
        if len(raw) != want:
            raise ProtocolError(
                f"numpy array {dtype}{tuple(shape)}: expected {want} bytes, got {len(raw)} (truncated?)"
            )
        # bytearray: the array owns a writable copy (see the module doc), never a view of `raw`.
        return np.frombuffer(bytearray(raw), dtype=np.dtype(dtype).newbyteorder("<")).reshape(shape)
    if code == EXT_TENSOR:
        import torch

        dtype, shape, raw = _read_header(code, data, _TORCH_DTYPES)
        want = prod(shape) * _TORCH_ITEMSIZE[dtype]
        if len(raw) != want:
            raise ProtocolError(
                f"torch tensor {dtype}{tuple(shape)}: expected {want} bytes, got {len(raw)} (truncated?)"
            )
        if want == 0:
            return torch.empty(shape, dtype=getattr(torch, dtype))
        flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        return flat.view(getattr(torch, dtype)).reshape(shape)
    raise ProtocolError(f"unknown msgpack ext type code {code}; known: {EXT_NDARRAY} (ndarray), {EXT_TENSOR} (tensor)")


# The same ext types for msgspec (`protocol.wire` encodes and decodes messages with it): the
# bytes on the wire are those `packb` writes, so either side can read the other.
def msgspec_enc_hook(obj: Any) -> Any:
    # msgspec takes exact scalar types only; msgpack took subclasses (np.float64 is a float, a
    # str subclass is a str), and senders rely on it (metrics of np.float64): keep that.
    for base in (float, int, str, bytes):
        if isinstance(obj, base):
            return base(obj)
    ext = _default(obj)
    return msgspec.msgpack.Ext(ext.code, ext.data)


def msgspec_ext_hook(code: int, data: memoryview) -> Any:
    return _ext_hook(code, data)


def packb(obj: Any) -> bytes:
    """Encode plain data (dicts, lists, scalars, str, bytes) plus arrays and tensors."""
    try:
        return msgpack.packb(obj, default=_default, use_bin_type=True, strict_types=False)
    except ProtocolError:
        raise
    except (TypeError, ValueError, OverflowError) as exc:
        raise ProtocolError(f"cannot encode message: {exc}") from None


def unpackb(data: bytes) -> Any:
    """Decode bytes from `packb`; raise `ProtocolError` on anything malformed."""
    try:
        return msgpack.unpackb(
            data, raw=False, use_list=True, strict_map_key=True, ext_hook=_ext_hook
        )
    except ProtocolError:
        raise
    except Exception as exc:  # ExtraData, FormatError, StackError, ValueError, ...
        raise ProtocolError(f"malformed msgpack body: {type(exc).__name__}: {exc}") from None
