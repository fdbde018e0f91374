"""twinstep.runtime.values: what a training names or publishes, as host arrays and back, dtypes kept exactly."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from twinstep.runtime.values import HostValue, UnsupportedValue, statistics_row, to_framework, to_host

paddle = pytest.importorskip("paddle")

BIG = (1 << 62) + 1  # not a float64: an int64 that must travel exactly


def test_python_numbers_keep_their_kind():
    assert (to_host(3).dtype, to_host(3.5).dtype, to_host(True).dtype) == ("int64", "float64", "bool")
    assert to_host(BIG).storage.item() == BIG
    with pytest.raises(UnsupportedValue, match="does not fit int64"):
        to_host(1 << 70)


def test_lists_become_arrays_of_their_numbers_and_ragged_ones_are_refused():
    ints = to_host([[1, 2], [3, BIG]])
    assert ints.dtype == "int64" and ints.shape == (2, 2) and ints.storage[1, 1] == BIG
    assert to_host([1, 2.5]).dtype == "float64"
    assert to_host((True, False)).dtype == "bool"
    with pytest.raises(UnsupportedValue, match="rectangular"):
        to_host([[1, 2], [3]])
    with pytest.raises(UnsupportedValue, match="numbers only"):
        to_host([1, "a"])
    with pytest.raises(UnsupportedValue, match="cannot record a builtins.object"):
        to_host(object())


def test_numpy_arrays_are_copied_and_unsupported_dtypes_named():
    array = np.arange(6, dtype=np.int32).reshape(2, 3)
    host = to_host(array)
    array[0, 0] = 99  # the training reuses its buffer: the copy does not see it
    assert host.dtype == "int32" and host.storage[0, 0] == 0
    big_endian = np.arange(3, dtype=">i8")
    assert to_host(big_endian).storage.tolist() == [0, 1, 2]
    with pytest.raises(UnsupportedValue, match="uint32"):
        to_host(np.zeros(2, dtype=np.uint32))


@pytest.mark.parametrize("dtype", ["int64", "int32", "uint8", "bool", "float32", "float16", "bfloat16", "float64"])
def test_tensors_of_both_frameworks_cross_over_exactly(dtype):
    values = np.array([[0, 1, 2], [3, 250, 7]], dtype=np.float32) if dtype != "bool" else np.array([True, False])
    source = torch.from_numpy(values).to(getattr(torch, dtype))
    if dtype == "int64":
        source = source + BIG  # beyond float64's integers
    host = to_host(source)
    assert host.dtype == dtype and host.shape == tuple(source.shape)
    into_paddle = to_framework(host, "paddle")
    assert str(into_paddle.dtype).rsplit(".", 1)[-1] == dtype
    back = to_host(into_paddle)  # paddle -> host -> torch
    assert back.dtype == dtype and np.array_equal(back.storage, host.storage)
    into_torch = to_framework(back, "torch")
    assert into_torch.dtype == source.dtype and torch.equal(into_torch, source)


def test_bfloat16_travels_as_its_bit_pattern_and_widens_exactly():
    source = torch.tensor([1.0, -2.5, 3.140625, 1e30], dtype=torch.bfloat16)
    host = to_host(source)
    assert host.storage.dtype == np.int16
    assert host.widened().tolist() == source.double().tolist()
    assert to_framework(host, "numpy").dtype == np.float32


def test_tensors_are_detached_copies():
    weight = torch.ones(3, requires_grad=True)
    host = to_host(weight * 2)
    with torch.no_grad():
        weight.add_(1)
    assert host.storage.tolist() == [2.0, 2.0, 2.0]


def test_equal_integer_values_give_equal_statistics_whatever_their_order_of_arrival():
    ids = np.random.default_rng(0).integers(0, 50_000, size=(8, 2048))
    row = statistics_row(to_host(ids))
    assert row == statistics_row(to_host(torch.from_numpy(ids.copy())))
    assert row == statistics_row(to_host(paddle.to_tensor(ids)))
    assert row[0] == float(ids.sum()) and row[1] == float((ids.astype(object) ** 2).sum())  # exact sums
    assert statistics_row(HostValue("float64", np.array([1.0, np.nan, np.inf])))[5:7] == (1.0, 1.0)


def test_large_values_are_reduced_in_chunks_to_the_same_statistics(monkeypatch):
    from twinstep.runtime import values

    x = np.random.default_rng(1).normal(size=1000)
    x[5], x[700] = np.nan, -np.inf
    whole = statistics_row(to_host(x))
    monkeypatch.setattr(values, "_CHUNK", 64)  # 16 chunks, bounded float64 temporaries
    chunked = statistics_row(to_host(x))
    assert chunked[5:7] == whole[5:7] == (1.0, 1.0)
    np.testing.assert_allclose(chunked, whole, rtol=1e-12)
    assert whole[2] == np.nanmin(x[np.isfinite(x)]) and whole[1] == pytest.approx(float(np.sum(x[np.isfinite(x)] ** 2)))
