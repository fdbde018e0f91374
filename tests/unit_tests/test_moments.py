"""twinstep.moments: the one-pass statistics kernel, its background load and its fallbacks.

How the capture backends use it (and the numbers they then produce) is tested
in test_device_stats.py, with and without the kernel.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from twinstep import _moments_numba, moments

_KERNEL_LOADER = moments._LOADER


def _use_kernel(monkeypatch) -> None:
    assert _KERNEL_LOADER.wait(120), f"one-pass kernel did not load: {_KERNEL_LOADER.state}"
    monkeypatch.setattr(moments, "_LOADER", _KERNEL_LOADER)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_one_pass_kernel_edge_cases(dtype, monkeypatch):
    _use_kernel(monkeypatch)
    x = np.random.default_rng(0).normal(0.5, 2.0, size=3 * 1024 + 17).astype(dtype)
    wide = x.astype(np.float64)
    total, sum_sq, lo, hi = moments.one_pass(x)
    assert (lo, hi) == (wide.min(), wide.max())
    assert total == pytest.approx(wide.sum(), rel=1e-6) and sum_sq == pytest.approx(wide @ wide, rel=1e-6)
    # Wherever a NaN or Inf sits (first element, a full row, the ragged tail), a sum shows it.
    for position in (0, 1500, x.size - 1):
        for bad in (np.nan, np.inf, -np.inf):
            y = x.copy()
            y[position] = bad
            total, sum_sq, _, _ = moments.one_pass(y)
            assert not (np.isfinite(total) and np.isfinite(sum_sq)), (position, bad)
    assert moments.one_pass(np.array([-2.5], dtype=dtype)) == (-2.5, 6.25, -2.5, -2.5)
    readonly = x.copy()
    readonly.setflags(write=False)
    assert moments.one_pass(readonly)[2:] == (wide.min(), wide.max())
    assert moments.one_pass(x.reshape(-1, 1)[::2]) is None  # strided: not dense, numpy serves
    assert moments.one_pass(x.astype(np.float16)) is None
    assert moments.one_pass(x[:0]) is None


def test_one_pass_kernel_loads_in_the_background(monkeypatch):
    monkeypatch.setenv(moments.ENV_SWITCH, "1")
    loader = moments._Loader()
    monkeypatch.setattr(moments, "_LOADER", loader)
    x = np.ones(10, dtype=np.float32)
    assert moments.one_pass(x) is None  # the first call starts the load and does not wait for it
    assert moments.state() in ("loading", "ready")
    assert moments.wait(120), moments.state()
    assert moments.one_pass(x) == (10.0, 10.0, 1.0, 1.0)


def test_one_pass_kernel_can_be_switched_off(monkeypatch):
    monkeypatch.setenv(moments.ENV_SWITCH, "0")
    monkeypatch.setattr(moments, "_LOADER", moments._Loader())
    assert moments.one_pass(np.ones(10, dtype=np.float32)) is None
    assert not moments.wait(0) and moments.state() == "off"


def test_one_pass_kernel_loads_again_in_a_child_forked_while_loading(monkeypatch):
    monkeypatch.setenv(moments.ENV_SWITCH, "1")
    loader = moments._Loader()
    monkeypatch.setattr(moments, "_LOADER", loader)
    loader.start()
    pid = os.fork()
    if pid == 0:  # child: the parent's loading thread is not here
        code = 0 if loader.wait(120) and moments.one_pass(np.ones(4, dtype=np.float32)) == (4.0, 4.0, 1.0, 1.0) else 1
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert loader.wait(120)


def test_compiled_without_a_cache_directory_gives_the_same_numbers():
    # The loader's fallback where numba cannot write its cache: compiled in memory.
    assert _KERNEL_LOADER.wait(120), _KERNEL_LOADER.state
    kernel = _moments_numba.compile_moments(cache=False)
    x = np.random.default_rng(1).normal(-0.2, 3.0, size=5 * 1024 + 3).astype(np.float32)
    assert kernel(x) == _KERNEL_LOADER.kernel()(x)
    with pytest.raises(TypeError):
        kernel(x.astype(np.float16))  # no compile for other types: refused instead
