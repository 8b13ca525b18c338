"""The stencil ops' argument helpers: the single-device output shape and its cache."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from physics_dp.ops import _args
from physics_dp.ops._args import single_device_shape


def _conv_args(x: torch.Tensor, weight: torch.Tensor, padding) -> dict:
    return {"input": x, "weight": weight, "bias": None, "stride": 1, "padding": padding, "dilation": 1, "groups": 1}


def test_shapes_equal_torchs_for_each_argument_set():
    weight = torch.randn(4, 3, 3, 3)
    for shape, padding in (((2, 3, 10, 7), 1), ((2, 3, 10, 7), [0, 1]), ((1, 3, 5, 9), "same"), ((2, 3, 10, 7), 1)):
        x = torch.randn(shape)
        expected = F.conv2d(x, weight, padding=padding).shape
        assert single_device_shape(F.conv2d, _conv_args(x, weight, padding)) == expected
    # a low-precision input shares the fp32 entry: only the shape is wanted
    assert single_device_shape(F.conv2d, _conv_args(torch.randn(2, 3, 10, 7, dtype=torch.bfloat16), weight, 1)) == (2, 4, 10, 7)


def test_invalid_arguments_raise_torchs_error_every_time():
    bound = _conv_args(torch.randn(2, 5, 10, 7), torch.randn(4, 3, 3, 3), 1)  # 5 channels for a 3-channel kernel
    for _ in range(2):
        with pytest.raises(RuntimeError, match="channel"):
            single_device_shape(F.conv2d, bound)


def test_unhashable_arguments_are_computed_uncached():
    x, weight = torch.randn(1, 3, 6, 6), torch.randn(2, 3, 3, 3)
    bound = _conv_args(x, weight, 1)
    bound["groups"] = _UnhashableOne()
    assert single_device_shape(F.conv2d, bound) == (1, 2, 6, 6)


class _UnhashableOne(int):
    """The int 1, unhashable (as an argument object of a user's type may be)."""

    __hash__ = None  # type: ignore[assignment]

    def __new__(cls) -> _UnhashableOne:
        return super().__new__(cls, 1)


def test_the_cache_holds_no_tensors():
    x, weight = torch.randn(2, 3, 8, 8), torch.randn(4, 3, 3, 3)
    single_device_shape(F.conv2d, _conv_args(x, weight, 1))
    assert _args._cached_shape.cache_info().currsize > 0

    def tensors_in(value) -> bool:
        if isinstance(value, torch.Tensor):
            return True
        return isinstance(value, tuple) and any(tensors_in(v) for v in value)

    # the cache's keys are the arguments of its calls: probe them through a fresh call's key
    keys = tuple(_args._key(v) for v in _conv_args(x, weight, 1).values())
    assert not tensors_in(keys)
