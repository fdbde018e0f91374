"""Host buffers in shared memory, so the sender process reads tensor copies where the training wrote them.

Each buffer is its own anonymous memory file (``memfd``): no file under
``/dev/shm`` to be left behind when a process dies, and the kernel frees it
once both processes have unmapped it.  The file descriptor travels once to the sender process over the
control socket (``SCM_RIGHTS``), which maps it; afterwards a tensor is named by
its buffer's number alone.
"""

from __future__ import annotations

import itertools
import mmap
import os
import threading
from typing import Callable

import numpy as np

#: Whether this platform can create anonymous memory files (Linux).
AVAILABLE = hasattr(os, "memfd_create")


class SharedBuffers:
    """Creates shared buffers and remembers their numbers; ``announce(number, nbytes, fd)`` hands each to the sender."""

    def __init__(self, announce: Callable[[int, int, int], None]) -> None:
        self._announce = announce
        self._numbers = itertools.count(1)
        self._by_address: dict[int, int] = {}
        self._lock = threading.Lock()
        self.total_bytes = 0

    def allocate(self, nbytes: int) -> np.ndarray:
        """A new ``uint8`` array of ``nbytes`` bytes in shared memory."""
        number = next(self._numbers)
        fd = os.memfd_create(f"twinstep-{number}", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, nbytes)
            region = mmap.mmap(fd, nbytes)
        except BaseException:
            os.close(fd)
            raise
        array = np.frombuffer(region, dtype=np.uint8)
        with self._lock:
            self._by_address[array.ctypes.data] = number
            self.total_bytes += nbytes
        self._announce(number, nbytes, fd)  # takes ownership of fd
        return array

    def number_of(self, address: int) -> int | None:
        """The number of the buffer starting at ``address`` (None: not a shared buffer)."""
        return self._by_address.get(address)

    def forget(self, address: int, nbytes: int) -> int | None:
        """The buffer at ``address`` is no longer used here; returns its number for the sender to unmap."""
        with self._lock:
            number = self._by_address.pop(address, None)
            if number is not None:
                self.total_bytes -= nbytes
        return number


def map_shared(fd: int, nbytes: int) -> mmap.mmap:
    """The sender's side: map a buffer the training process created, then close the descriptor."""
    try:
        return mmap.mmap(fd, nbytes, access=mmap.ACCESS_READ)
    finally:
        os.close(fd)
