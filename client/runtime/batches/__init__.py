"""Batch sync: the baseline publishes each step's inputs, a candidate trains on them (docs/records-and-batches.md).

:class:`BatchSync` is what a :class:`~twinstep.runtime.api.Monitor` holds: the
publisher (baseline), the fetcher (candidate) and the first-call hook of
``attach(publish_batches=True)`` / ``attach(sync_batches=True)``, created on
first use.  The parts: :mod:`.wire` (capture, encode, decode),
:mod:`.publisher`, :mod:`.fetcher`, :mod:`.autosync`.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from twinstep.runtime.batches import autosync, wire
from twinstep.runtime.batches.fetcher import BatchFetcher, Interrupted
from twinstep.runtime.batches.publisher import BatchPublisher, PublishStats
from twinstep.runtime.capture.health import describe_error
from twinstep.runtime.transport.security import ClientSecurity

__all__ = ["BatchSync", "Interrupted", "PublishStats"]

logger = logging.getLogger("twinstep")


class BatchSync:
    """One rank's batch sync; every method runs on the training thread."""

    def __init__(self, *, target: str, security: ClientSecurity, session: str, run: str, rank: int,
                 baseline: bool, framework: str, timeout: float) -> None:
        self._target, self._security = target, security
        self._session, self._run, self._rank = session, run, rank
        self.baseline = baseline
        self.framework = framework
        self.timeout = timeout
        self._publisher: BatchPublisher | None = None
        self._fetcher: BatchFetcher | None = None
        self._hook: autosync.FirstCallHook | None = None
        self._warned = False

    # -- baseline ----------------------------------------------------------------------------

    def publish(self, step: int, batch: Any) -> None:
        """Copy ``batch`` now and publish it in the background; UnsupportedValue for one that cannot travel."""
        captured = wire.capture(batch)
        if self._publisher is None:
            self._publisher = BatchPublisher(self._target, self._security, self._session, self._run, self._rank)
        self._publisher.publish(step, captured)

    @property
    def publish_stats(self) -> PublishStats | None:
        return self._publisher.stats if self._publisher is not None else None

    # -- candidate ---------------------------------------------------------------------------

    def fetch(self, step: int, timeout: float | None, interrupted: Callable[[], bool],
              to_device: Callable[[Any], Any] | None = None) -> Any:
        """The baseline's batch of ``step`` in this framework; BatchSyncError, or Interrupted by a halt."""
        if self._fetcher is None:
            self._fetcher = BatchFetcher(self._target, self._security, self._session, self._run, self._rank)
        published = self._fetcher.fetch(step, self.timeout if timeout is None else timeout, interrupted)
        return wire.from_proto(published.value, self.framework, to_device)

    @property
    def fetched(self) -> int:
        return self._fetcher.fetched if self._fetcher is not None else 0

    @property
    def waited_seconds(self) -> float:
        return self._fetcher.waited_seconds if self._fetcher is not None else 0.0

    # -- the model's first call of each step ---------------------------------------------------

    def hook_model(self, model: Any, current_step: Callable[[], int],
                   fetch: Callable[[Callable[[Any], Any] | None], Any]) -> None:
        """Publish (baseline) or replace (candidate) the arguments of the model's first call of every step.

        ``fetch(to_device)``: the baseline's batch of the current step (the monitor's, which turns a halt
        during the wait into Halted).
        """
        if self.baseline:
            def on_first(args: tuple, kwargs: dict) -> None:
                try:
                    self.publish(current_step(), autosync.as_batch(args, kwargs))
                except Exception as error:  # never break the baseline's forward
                    if not self._warned:
                        self._warned = True
                        logger.warning("twinstep: cannot publish the model's inputs at step %d (%s); training "
                                       "continues, candidates syncing batches will not get them",
                                       current_step(), describe_error(error))
                return None
        else:
            def on_first(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
                return autosync.as_call(fetch(autosync.first_tensor_device(self.framework, args, kwargs)))
        self._hook = autosync.FirstCallHook(model, on_first)

    def new_step(self) -> None:
        if self._hook is not None:
            self._hook.new_step()

    def close(self, timeout: float) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if self._publisher is not None:
            self._publisher.close(timeout)
        if self._fetcher is not None:
            self._fetcher.close()
