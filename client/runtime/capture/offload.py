"""Tensor statistics computed off the training thread, while the training computes.

Why: on the CPU a statistics pass reads every captured byte once; on the
training thread that read adds to the step time (about 50 of 70 ms added to
a 400 ms Llama step, measured with benchmarks/overhead.py).  Here the hooks only queue a task (a
zero-copy host view of the tensor and the function that reduces it); a
small pool of worker threads runs the tasks while the training goes on.  The
compiled kernels (twinstep.runtime.kernels) and numpy's reductions release the GIL,
so a worker runs on a free core in parallel with the training's own kernels.
In tensor modes the workers also make the full host copy of each tensor
(torch's ``copy_`` and numpy's ``copyto`` release the GIL too).

At the step boundary the training thread helps drain what is left (the
parameter and gradient statistics are queued there) and then waits for the
rest, at most ``timeout`` seconds: a stuck worker costs one bounded wait,
then statistics go back inline (a warning says so) and training goes on.

Correctness when a tensor is modified in place after its capture is the
recorder's job (version counters checked at the step boundary, see
twinstep.runtime.capture.recorder): this module only runs functions.

Fork safety: worker threads do not survive ``fork``; a child starts its own
on first use, with an empty queue (the parent's tasks are the parent's).
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
import weakref
from typing import Any, Callable

logger = logging.getLogger("twinstep")

#: Default seconds the step boundary waits for outstanding statistics before giving up on them.
DEFAULT_TIMEOUT = 10.0


class StatsTask:
    """One queued statistics computation; ``result`` is set once it ran (or ``error`` once it failed)."""

    __slots__ = ("fn", "result", "error", "cancelled", "finished")

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.fn: Callable[[], Any] | None = fn
        self.result: Any = None
        self.error: BaseException | None = None
        self.cancelled = False
        self.finished = False
        """Ran to its end, with a result or an error."""

    @property
    def done(self) -> bool:
        """Ran to its end with a result."""
        return self.finished and self.error is None

    def run(self) -> None:
        fn, self.fn = self.fn, None  # the tensor view goes with it: memory is freed as soon as possible
        if fn is None or self.cancelled:
            return
        try:
            self.result = fn()
        except BaseException as error:  # reported on the training thread, as an inline failure would be
            self.error = error
        self.finished = True


class StatsOffload:
    """A FIFO of :class:`StatsTask` served by ``workers`` daemon threads and, at the step boundary, the caller.

    The hot path takes no lock: ``deque.append`` and ``popleft`` are atomic,
    and a submit wakes a worker only when one is asleep.  A hook that took a
    lock and woke a thread per tensor cost more than the pass it handed off
    when the cores were busy (a profile under load: 3 ms per wake-up).
    """

    def __init__(self, workers: int = 1, timeout: float = DEFAULT_TIMEOUT) -> None:
        if workers < 1:
            raise ValueError(f"workers must be at least 1, got {workers}")
        self.workers = workers
        self.timeout = timeout
        self._queue: collections.deque[StatsTask] = collections.deque()
        self._cond = threading.Condition()
        self._sleeping = 0  # workers waiting on the condition, or about to
        self._draining = False  # the step boundary waits: workers notify when a task ends
        self._threads: list[threading.Thread] = []
        self._closed = False
        self.broken = False
        """A wait timed out: the recorder computes inline from then on."""
        if hasattr(os, "register_at_fork"):
            method = weakref.WeakMethod(self._after_fork)
            os.register_at_fork(after_in_child=lambda: (m := method()) is not None and m())

    def submit(self, fn: Callable[[], Any]) -> StatsTask:
        """Queue ``fn`` (training thread; never blocks)."""
        task = StatsTask(fn)
        if not self._threads:
            with self._cond:
                self._start_threads()
        self._queue.append(task)
        if self._sleeping:  # read after the append: a worker that missed the task is not asleep yet
            with self._cond:
                self._cond.notify()
        return task

    def drain(self, tasks: list[StatsTask]) -> float:
        """Run queued tasks on the calling thread, then wait for ``tasks``; returns the seconds spent.

        Tasks still unfinished after ``timeout`` are cancelled (their
        ``done`` stays False) and the pool is marked broken.
        """
        started = time.perf_counter()
        queue = self._queue
        while True:  # help: the caller is a free core at the step boundary
            try:
                task = queue.popleft()
            except IndexError:
                break
            task.run()
        deadline = started + self.timeout
        waiting = 0  # tasks before this index have finished
        with self._cond:
            self._draining = True
            try:
                while True:
                    while waiting < len(tasks) and tasks[waiting].finished:
                        waiting += 1
                    remaining = deadline - time.perf_counter()
                    if waiting == len(tasks) or remaining <= 0:
                        break
                    self._cond.wait(min(remaining, 0.5))
            finally:
                self._draining = False
        late = [t for t in tasks if not t.finished]
        if late:
            for task in late:
                task.cancelled = True
            self.broken = True
            logger.warning("twinstep: %d statistics not ready %.0f s after the step ended; computing them on the "
                           "training thread from now on", len(late), self.timeout)
        return time.perf_counter() - started

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._queue.clear()
            self._cond.notify_all()

    # -- workers ------------------------------------------------------------

    def _after_fork(self) -> None:
        # The parent's workers do not exist here, and one may have held the lock at the fork.
        self._cond = threading.Condition()
        self._threads = []
        self._queue.clear()
        self._sleeping = 0
        self._draining = False

    def _start_threads(self) -> None:
        """Start the workers on first use; called under the condition's lock."""
        if self._threads or self._closed:
            return
        for index in range(self.workers):
            thread = threading.Thread(target=self._work, name=f"twinstep-stats-{index}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def _work(self) -> None:
        cond = self._cond
        queue = self._queue
        while True:
            try:
                task = queue.popleft()
            except IndexError:
                with cond:
                    if self._closed:
                        return
                    self._sleeping += 1  # counted before looking again: see submit()
                    if not queue:
                        cond.wait()
                    self._sleeping -= 1
                continue
            task.run()
            if self._draining:
                with cond:
                    cond.notify_all()
