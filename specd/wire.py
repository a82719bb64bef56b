"""Tensor <-> protobuf codec: one packed little-endian buffer per array."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np

from specd.v1 import common_pb2

# Wire dtype name -> (numpy storage dtype, mlx dtype). bfloat16 has no numpy
# dtype, so it travels as its raw 16-bit pattern.
_DTYPES = {
    "float32": (np.dtype("<f4"), mx.float32),
    "float16": (np.dtype("<f2"), mx.float16),
    "bfloat16": (np.dtype("<u2"), mx.bfloat16),
    "int32": (np.dtype("<i4"), mx.int32),
}
WIRE_DTYPES = tuple(_DTYPES)
_MLX_NAMES = {mlx_dtype: name for name, (_, mlx_dtype) in _DTYPES.items()}


class WireError(ValueError):
    """A Tensor message that cannot be decoded; the message says what is wrong."""


def encode(array: mx.array | np.ndarray, dtype: str | None = None) -> common_pb2.Tensor:
    """Pack an array, optionally casting it to the wire dtype `dtype` first."""
    if isinstance(array, np.ndarray):
        array = mx.array(array)
    if dtype is not None:
        if dtype not in _DTYPES:
            raise WireError(f"unknown dtype {dtype!r}; expected one of {', '.join(WIRE_DTYPES)}")
        array = array.astype(_DTYPES[dtype][1])
    name = _MLX_NAMES.get(array.dtype)
    if name is None:
        raise WireError(f"cannot send arrays of {array.dtype}")
    storage = _DTYPES[name][0]
    if name == "bfloat16":
        host = np.array(array.view(mx.uint16), copy=False)
    else:
        host = np.array(array, copy=False)
    return common_pb2.Tensor(
        dtype=name, shape=list(array.shape), data=host.astype(storage, copy=False).tobytes()
    )


def _checked_storage(tensor: common_pb2.Tensor, ndim: int | None) -> tuple[np.ndarray, str]:
    if tensor.dtype not in _DTYPES:
        raise WireError(f"tensor dtype {tensor.dtype!r} is not one of {', '.join(WIRE_DTYPES)}")
    shape = tuple(tensor.shape)
    if ndim is not None and len(shape) != ndim:
        raise WireError(f"tensor has {len(shape)} dimensions {list(shape)}, expected {ndim}")
    if any(d < 0 for d in shape):
        raise WireError(f"tensor shape {list(shape)} has a negative dimension")
    storage = _DTYPES[tensor.dtype][0]
    expected = math.prod(shape) * storage.itemsize
    if len(tensor.data) != expected:
        raise WireError(
            f"tensor of shape {list(shape)} and dtype {tensor.dtype} needs {expected} bytes, "
            f"got {len(tensor.data)}"
        )
    return np.frombuffer(tensor.data, dtype=storage).reshape(shape), tensor.dtype


def decode(tensor: common_pb2.Tensor, ndim: int | None = None) -> mx.array:
    """Unpack into an mx.array of the wire dtype; raises WireError on any mismatch."""
    host, name = _checked_storage(tensor, ndim)
    array = mx.array(host)
    return array.view(mx.bfloat16) if name == "bfloat16" else array


def decode_numpy(tensor: common_pb2.Tensor, ndim: int | None = None) -> np.ndarray:
    """Unpack into numpy (bfloat16 is widened to float32, numpy has no bfloat16)."""
    host, name = _checked_storage(tensor, ndim)
    if name == "bfloat16":
        return (host.astype(np.uint32) << 16).view(np.float32)
    return host


def is_empty(tensor: common_pb2.Tensor) -> bool:
    """True for an unset Tensor field (no dtype, no shape)."""
    return not tensor.dtype and not tensor.shape
