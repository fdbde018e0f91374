"""numba source of :mod:`twinstep.runtime.kernels`.

Imported only by :mod:`twinstep.runtime.kernels`, on its background thread: importing
numba takes about half a second.  :func:`compile_all` sets the module's
``moments``.
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

#: Elements summed in the array's dtype before the row's sums join the float64 totals
#: (the eager path's row length: float32 rows of 1024 keep sums good to ~1e-9).
ROW = 1024


def _min_max_intrinsic(name: str):  # noqa: ANN202 (a numba intrinsic)
    """llvm.minnum/maxnum marked no-NaN, no-signed-zero: the form LLVM vectorises as a reduction.

    numba's own min() branches on NaN, which keeps the loop scalar (10x slower).
    Under these flags a NaN element leaves the extrema undefined; the sums still
    propagate it, which is how the caller detects it.
    """

    @intrinsic
    def op(typingctx, a, b):  # noqa: ANN001, ANN202
        if not (isinstance(a, types.Float) and a == b):
            return None

        def codegen(context, builder, signature, args):  # noqa: ANN001, ANN202
            lty = context.get_value_type(signature.return_type)
            fn = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(lty, [lty, lty]), f"llvm.{name}.f{a.bitwidth}"
            )
            return builder.call(fn, args, fastmath=("nnan", "nsz"))

        return a(a, b), codegen

    return op


_fmin = _min_max_intrinsic("minnum")
_fmax = _min_max_intrinsic("maxnum")

_SIGNATURES = [
    types.UniTuple(types.float64, 4)(types.Array(types.float32, 1, "C", readonly=readonly))
    for readonly in (False, True)
] + [
    types.UniTuple(types.float64, 4)(types.Array(types.float64, 1, "C", readonly=readonly))
    for readonly in (False, True)
]


def _moments(x):  # noqa: ANN001, ANN202
    """(sum, sum of squares, min, max) of a non-empty 1-D array in one pass.

    Each row runs a loop of a fixed trip count (``range(m)``, indexed from the
    row's base): LLVM vectorises it (16 float32 lanes with AVX-512).  A row
    loop bounded by ``range(start, min(start + ROW, n))`` stays scalar, 7.5x
    slower (346 against 46 us per 4 MB here: benchmarks/stats_kernels.py).
    """
    n = x.size
    total = 0.0
    sum_sq = 0.0
    lo = x[0]
    hi = x[0]
    zero = x[0] - x[0]  # 0 in the array's dtype (NaN if x[0] is: then the sums are NaN anyway)
    full = n // ROW
    for r in range(full + 1):
        base = r * ROW
        m = ROW if r < full else n - base
        s = zero
        q = zero
        row_lo = lo
        row_hi = hi
        for j in range(m):
            v = x[base + j]
            s += v
            q += v * v
            row_lo = _fmin(row_lo, v)
            row_hi = _fmax(row_hi, v)
        total += s
        sum_sq += q
        lo = row_lo
        hi = row_hi
    return total, sum_sq, np.float64(lo), np.float64(hi)


moments = None


def compile_all(cache: bool = True) -> None:
    """Compile the kernels for their signatures (or load them from numba's cache) into this module.

    Compiling for given signatures happens here, once; afterwards the
    dispatchers refuse other types instead of compiling on a caller's thread.
    """
    global moments
    if numba.config.DISABLE_JIT:  # numba's debugging switch: its Python fallback would take seconds per tensor
        raise RuntimeError("NUMBA_DISABLE_JIT is set")
    # reassoc lets the sums use vector lanes; no flag assumes finite values, so a NaN or
    # Inf element still makes the sums non-finite.
    compiled_moments = numba.njit(_SIGNATURES, fastmath={"reassoc", "contract"}, nogil=True, cache=cache)(_moments)
    compiled_moments.disable_compile()
    moments = compiled_moments
