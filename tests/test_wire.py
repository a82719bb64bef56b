import mlx.core as mx
import numpy as np
import pytest

from specd import wire
from specd.v1 import common_pb2


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16, mx.int32])
def test_round_trip_keeps_values_dtype_and_shape(dtype):
    array = (mx.random.normal((3, 5)) * 100).astype(dtype)
    tensor = wire.encode(array)
    assert list(tensor.shape) == [3, 5]
    assert len(tensor.data) == 15 * array.itemsize
    back = wire.decode(tensor, ndim=2)
    assert back.dtype == dtype and mx.array_equal(back, array).item()


def test_encode_casts_and_numpy_views():
    tensor = wire.encode(np.arange(6, dtype=np.float64).reshape(2, 3), dtype="float16")
    assert tensor.dtype == "float16"
    assert wire.decode_numpy(tensor).tolist() == [[0, 1, 2], [3, 4, 5]]
    bf16 = wire.encode(mx.array([1.5, -2.0]), dtype="bfloat16")
    assert wire.decode_numpy(bf16).dtype == np.float32
    assert wire.decode_numpy(bf16).tolist() == [1.5, -2.0]


def test_empty_rows_and_unset_field():
    empty = wire.encode(mx.zeros((4, 0)))
    assert wire.decode(empty).shape == (4, 0)
    assert wire.is_empty(common_pb2.Tensor()) and not wire.is_empty(empty)


@pytest.mark.parametrize(
    "tensor, message",
    [
        (common_pb2.Tensor(dtype="float32", shape=[2, 2], data=b"\0" * 15), "needs 16 bytes"),
        (common_pb2.Tensor(dtype="float64", shape=[1], data=b"\0" * 8), "is not one of"),
        (common_pb2.Tensor(dtype="int32", shape=[-1, 4], data=b""), "negative"),
        (common_pb2.Tensor(dtype="int32", shape=[4], data=b"\0" * 16), "expected 2"),
        (common_pb2.Tensor(dtype="float16", shape=[2**40, 2**40], data=b"\0"), "needs"),
    ],
)
def test_malformed_tensors_are_refused_with_a_reason(tensor, message):
    with pytest.raises(wire.WireError, match=message):
        wire.decode(tensor, ndim=2)


def test_unknown_target_dtype():
    with pytest.raises(wire.WireError, match="unknown dtype"):
        wire.encode(mx.zeros((1,)), dtype="int8")
