"""twinstep.runtime.kernels: the compiled one-pass kernels, their background load and their fallbacks.

How the capture backends use them (and the numbers they then produce) is
tested in test_device_stats.py, with and without the kernels.
"""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest

from tests.conftest import _KERNELS, use_kernels
from twinstep.runtime import _kernels_numba, kernels


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_moments_edge_cases(dtype, monkeypatch):
    use_kernels(monkeypatch)
    x = np.random.default_rng(0).normal(0.5, 2.0, size=3 * 1024 + 17).astype(dtype)
    wide = x.astype(np.float64)
    total, sum_sq, lo, hi = kernels.one_pass_moments(x)
    assert (lo, hi) == (wide.min(), wide.max())
    assert total == pytest.approx(wide.sum(), rel=1e-6) and sum_sq == pytest.approx(wide @ wide, rel=1e-6)
    # Wherever a NaN or Inf sits (first element, a full row, the ragged tail), a sum shows it.
    for position in (0, 1500, x.size - 1):
        for bad in (np.nan, np.inf, -np.inf):
            y = x.copy()
            y[position] = bad
            total, sum_sq, _, _ = kernels.one_pass_moments(y)
            assert not (np.isfinite(total) and np.isfinite(sum_sq)), (position, bad)
    assert kernels.one_pass_moments(np.array([-2.5], dtype=dtype)) == (-2.5, 6.25, -2.5, -2.5)
    readonly = x.copy()
    readonly.setflags(write=False)
    assert kernels.one_pass_moments(readonly)[2:] == (wide.min(), wide.max())
    assert kernels.one_pass_moments(x.reshape(-1, 1)[::2]) is None  # strided: not dense, numpy serves
    assert kernels.one_pass_moments(x.astype(np.float16)) is None
    assert kernels.one_pass_moments(x[:0]) is None


def test_kernels_load_in_the_background(monkeypatch):
    monkeypatch.setenv(kernels.ENV_SWITCH, "1")
    loader = kernels._Loader()
    monkeypatch.setattr(kernels, "_LOADER", loader)
    x = np.ones(10, dtype=np.float32)
    assert kernels.one_pass_moments(x) is None  # the first call starts the load and does not wait for it
    assert kernels.state() in ("loading", "ready")
    assert kernels.wait(120), kernels.state()
    assert kernels.one_pass_moments(x) == (10.0, 10.0, 1.0, 1.0)


def test_kernels_can_be_switched_off(monkeypatch):
    monkeypatch.setenv(kernels.ENV_SWITCH, "0")
    monkeypatch.setattr(kernels, "_LOADER", kernels._Loader())
    assert kernels.one_pass_moments(np.ones(10, dtype=np.float32)) is None
    assert not kernels.wait(0) and kernels.state() == "off"


def test_a_child_forked_while_the_kernels_load_keeps_numpy_and_does_not_hang(monkeypatch):
    # The parent's loading thread may hold numba's compiler lock at the fork; the child must not wait on it.
    from twinstep.runtime import _kernels_numba

    monkeypatch.setenv(kernels.ENV_SWITCH, "1")
    loader = kernels._Loader()
    monkeypatch.setattr(kernels, "_LOADER", loader)
    # Hold the load until after the fork: with numba's cache warm it can otherwise finish first.
    gate, compile_all = threading.Event(), _kernels_numba.compile_all
    monkeypatch.setattr(_kernels_numba, "compile_all", lambda **kw: (gate.wait(60), compile_all(**kw))[1])
    loader.start()
    assert loader.state == "loading"
    pid = os.fork()
    if pid == 0:
        ok = not loader.wait(0) and kernels.state() == "failed" and kernels.one_pass_moments(np.ones(4, np.float32)) is None
        os._exit(0 if ok else 1)
    gate.set()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert loader.wait(120)  # the parent's load carries on


def test_a_child_forked_after_the_kernels_loaded_uses_them(monkeypatch):
    use_kernels(monkeypatch)
    pid = os.fork()
    if pid == 0:
        os._exit(0 if kernels.one_pass_moments(np.ones(4, np.float32)) == (4.0, 4.0, 1.0, 1.0) else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_compiled_without_a_cache_directory_gives_the_same_numbers(monkeypatch):
    # The loader's fallback where numba cannot write its cache: compiled in memory.
    assert _KERNELS.wait(120), _KERNELS.state
    x = np.random.default_rng(1).normal(-0.2, 3.0, size=5 * 1024 + 3).astype(np.float32)
    cached = _kernels_numba.moments(x)
    monkeypatch.setattr(_kernels_numba, "moments", _kernels_numba.moments)  # restored afterwards
    _kernels_numba.compile_all(cache=False)
    assert _kernels_numba.moments(x) == cached
    with pytest.raises(TypeError):
        _kernels_numba.moments(x.astype(np.float16))  # no compile for other types: refused instead


def test_numba_debug_mode_is_not_used_for_statistics(monkeypatch):
    # NUMBA_DISABLE_JIT runs the kernel as plain Python, seconds per tensor: the numpy passes serve instead.
    import numba

    monkeypatch.setattr(numba.config, "DISABLE_JIT", True)
    with pytest.raises(RuntimeError, match="NUMBA_DISABLE_JIT"):
        _kernels_numba.compile_all(cache=False)


def test_a_program_that_ends_while_the_kernels_load_waits_for_them_before_the_interpreter_finalizes(tmp_path):
    """A daemon loader still running Python code at finalization once killed a 3-step torch job with SIGABRT.

    An exit hook registered before twinstep's runs after it (atexit is last in, first out): it must find
    the load finished, from a cold numba cache (so the load is still in flight when the program ends).
    """
    import subprocess
    import sys

    program = (
        "import atexit\n"
        "atexit.register(lambda: print('state at exit:', __import__('twinstep.runtime.kernels').runtime.kernels.state(), flush=True))\n"
        "from twinstep.runtime import kernels\n"
        "kernels.one_pass_moments(__import__('numpy').ones(4, dtype='float32'))  # starts the load\n"
        "print('state at the end:', kernels.state(), flush=True)\n"
    )
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "numba-cache"), "TWINSTEP_JIT": "1"}
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "state at the end: loading" in done.stdout, done.stdout
    assert "state at exit: ready" in done.stdout, done.stdout + done.stderr
