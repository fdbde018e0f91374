"""Keep the memory that received tensor pieces free in this process, so the next pieces reuse it.

Every tensor piece arrives as a fresh multi-MiB ``bytes`` object, held until its
step is compared. glibc hands blocks that large back to the kernel when they are
freed: either they were mmapped (above the mmap threshold) or the arena is trimmed.
The next pieces then fault the same pages in again, and the kernel zero-fills each
one. In tensor mode, at 161 MB per step, that was 42k page faults and about 180 ms
of kernel time per step: two thirds of the server's CPU, on a core the training
shares when the server runs on the same host (``benchmarks/overhead.py --tensors``).

The fix raises the mmap threshold to glibc's maximum and stops trimming. A process
that owns the server calls it: ``twinstep serve`` and ``twinstep demo``. An embedded
server leaves the allocator of its host process alone. The cost is that the
process's resident memory stays at its peak. That peak is already bounded by the
session windows (``ServerConfig.window.bytes``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import platform

logger = logging.getLogger("twinstep.server")

# mallopt parameters, from glibc's <malloc.h>.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# glibc refuses mmap thresholds above HEAP_MAX_SIZE / 2: 32 MiB on 64-bit.
_MAX_MMAP_THRESHOLD = 32 << 20
# Trimming starts above this much free memory at the top of a heap: never, in practice.
_NO_TRIM = (1 << 31) - 1


def retain_freed_memory() -> bool:
    """Keep freed blocks of up to 32 MiB in this process (glibc only; False where it does nothing)."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        applied = libc.mallopt(_M_MMAP_THRESHOLD, _MAX_MMAP_THRESHOLD) == 1
        applied = libc.mallopt(_M_TRIM_THRESHOLD, _NO_TRIM) == 1 and applied
    except (OSError, AttributeError) as error:
        logger.debug("mallopt is unavailable: %s", error)
        return False
    if not applied:
        logger.debug("mallopt refused the server's memory settings")
    return applied
