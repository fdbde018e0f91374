"""Compiled one-pass kernels for the host's hot loops: CPU tensor statistics.

numpy and the frameworks read a tensor once per reduction (extrema, sum, sum
of squares) and pay microseconds of dispatch per call: 1.2x to 1.8x the time
of a memory copy of the tensor, measured on torch tensors of 1 to 16 MB, and
most of a statistics-mode step's overhead on CPU.  One compiled pass reads
each element once: 0.4x to 0.9x of a copy (``benchmarks/stats_kernels.py``).

numba compiles them (llvmlite ships LLVM in its wheel, so the user's machine
needs no compiler) on a background thread, the first time a process asks,
once per machine: later processes load them from numba's cache.  Until then,
or where numba is unavailable, the functions here return None and callers
use their numpy path, which gives the same numbers.  ``TWINSTEP_JIT=0`` turns
the kernels off.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
import weakref
from types import ModuleType

import numpy as np

logger = logging.getLogger("twinstep")

ENV_SWITCH = "TWINSTEP_JIT"
#: How long the interpreter's exit waits for a load still in flight (see :meth:`_Loader._wait_at_exit`).
EXIT_WAIT_SECONDS = 20.0
_FLOATS = (np.dtype(np.float32), np.dtype(np.float64))


class _Loader:
    """Compiles the kernels once per process, off the calling thread; never raises."""

    def __init__(self) -> None:
        off = os.environ.get(ENV_SWITCH, "1").strip().lower() in ("0", "false", "no", "off")
        self._kernels: ModuleType | None = None
        self._state = "off" if off else "idle"  # idle | loading | ready | failed | off
        self._done = threading.Event()
        if off:
            self._done.set()
        self._lock = threading.Lock()
        self._exit_hook = False
        self.load_seconds = 0.0
        if hasattr(os, "register_at_fork"):
            method = weakref.WeakMethod(self._after_fork)
            os.register_at_fork(after_in_child=lambda: (m := method()) is not None and m())

    @property
    def state(self) -> str:
        return self._state

    def kernels(self) -> ModuleType | None:
        """The compiled kernels, or None (then starts loading them on a background thread, once)."""
        compiled = self._kernels
        if compiled is None and self._state == "idle":
            self.start()
        return compiled

    def start(self) -> None:
        with self._lock:
            if self._state != "idle":
                return
            self._state = "loading"
            if not self._exit_hook:
                atexit.register(self._wait_at_exit)
                self._exit_hook = True
        threading.Thread(target=self._load, name="twinstep-jit", daemon=True).start()

    def _wait_at_exit(self) -> None:
        """Let a load in flight finish before the interpreter finalizes (bounded).

        The loader is a daemon thread importing numba and compiling.  Were it still running
        Python code at finalization, a garbage collection there can free torch tensors, whose
        deallocator releases the GIL; taking it back during finalization ends the thread with
        a forced unwind through C++ code that forbids it: ``terminate called without an
        active exception``, SIGABRT, a training killed at its very end (seen on a 3-step job
        with torch 2.4 and Python 3.10).  Short jobs that end while the kernels load wait here
        for the rest of the load (1 to 2 s when numba's cache holds them).
        """
        if self._state == "loading" and not self._done.wait(EXIT_WAIT_SECONDS):
            logger.warning("twinstep: the compiled kernels were still loading %.0f s after the program ended; "
                           "exiting anyway", EXIT_WAIT_SECONDS)

    def wait(self, timeout: float | None = None) -> bool:
        """Start loading if needed and wait for it; True when the kernels are ready."""
        self.start()
        self._done.wait(timeout)
        return self._kernels is not None

    def _load(self) -> None:
        started = time.perf_counter()
        try:
            from twinstep.runtime import _kernels_numba

            try:
                _kernels_numba.compile_all(cache=True)
            except Exception:  # e.g. no writable cache directory: compile in memory, every process
                logger.debug("twinstep: numba's cache unavailable", exc_info=True)
                _kernels_numba.compile_all(cache=False)
            _check(_kernels_numba)
        except Exception as exc:  # no numba for this platform, a compile error: numpy serves
            self._state = "failed"
            logger.info("twinstep: compiled kernels unavailable (%s); numpy serves", exc)
            logger.debug("twinstep: why the compiled kernels are unavailable", exc_info=True)
        else:
            self._kernels = _kernels_numba
            self._state = "ready"
            self.load_seconds = time.perf_counter() - started
        finally:
            self._done.set()

    def _after_fork(self) -> None:
        # A load in flight belonged to a thread the child does not have, which may have held
        # numba's compiler lock or an import lock at the fork: loading again could block the
        # child's loader thread for good.  Such a child (a data-loader worker, typically) keeps
        # numpy's passes.  Loaded kernels need no lock to run; an idle child loads when asked.
        if self._state == "loading":
            self._state = "failed"
        self._done = threading.Event()
        if self._state != "idle":
            self._done.set()
        self._lock = threading.Lock()


def _check(compiled: ModuleType) -> None:
    """Compare against numpy on a ragged, signed sample before trusting the compiled code."""
    for dtype in _FLOATS:
        sample = np.linspace(-3.0, 5.0, 3 * 1024 + 17).astype(dtype)
        got = compiled.moments(sample)
        wide = sample.astype(np.float64)
        expected = (wide.sum(), np.dot(wide, wide), -3.0, 5.0)
        if any(abs(a - b) > 1e-5 * max(1.0, abs(b)) for a, b in zip(got, expected)):
            raise RuntimeError(f"compiled statistics {got} differ from {expected} for {dtype}")


_LOADER = _Loader()


def one_pass_moments(values: np.ndarray) -> tuple[float, float, float, float] | None:
    """(sum, sum_sq, min, max) of a non-empty, contiguous 1-D float32/float64 array, or None when the kernel cannot serve.

    None while the kernels load (the first call starts that), where they are
    unavailable, and for other arrays (dtypes, layouts).  Sums accumulate
    rows of 1024 elements in the array's dtype, then float64.  A NaN or Inf
    element makes the sum or the sum of squares non-finite and leaves the
    extrema undefined: check the sums first.
    """
    if values.dtype not in _FLOATS or values.size == 0 or values.ndim != 1 or not values.flags.c_contiguous:
        return None
    compiled = _LOADER.kernels()
    if compiled is None:
        return None
    return compiled.moments(values)


def wait(timeout: float | None = None) -> bool:
    """Start loading and wait up to ``timeout`` seconds; True when the kernels are ready (tests, benchmarks)."""
    return _LOADER.wait(timeout)


def state() -> str:
    """``idle``, ``loading``, ``ready``, ``failed`` or ``off`` (TWINSTEP_JIT=0)."""
    return _LOADER.state


def load_seconds() -> float:
    """Wall time the background load took (compile, or load from numba's cache)."""
    return _LOADER.load_seconds
