"""Credit policy: how far each stream of a rank may run ahead of the others.

A run in lockstep (``max_lead`` N) may lead the slowest other streaming run by
N steps; any other run by the server's window.  A run counts as having reached
a step once it delivered it or said it will not deliver it, so a run whose
capture failed for some steps never stalls its peer.

Independently, a stream may have at most ``max_inflight`` of its own steps
sent but not yet taken by the server.  Without that bound a client faster
than the server fills gRPC's receive buffers (its window grows with the link):
seconds of acknowledgement latency and memory no server limit counts.  With
it, an overloaded server slows its clients, whose bounded outboxes then drop
and count steps, which the report shows.
"""

from __future__ import annotations

from typing import Iterable

from twinstep.server.connection import Connection
from twinstep.server.runs.membership import RunState


def credit_updates(runs: Iterable[RunState], rank: int, window_steps: int,
                   max_inflight: int | None = None) -> list[tuple[Connection, int, int]]:
    """(stream, highest step it may send, highest step the server holds) for every open stream of ``rank``."""
    runs = list(runs)
    updates = []
    for run in runs:
        state = run.ranks.get(rank)
        if state is None or state.connection is None:
            continue
        lead = run.max_lead or window_steps
        others = [other.ranks[rank] for other in runs if other is not run and rank in other.ranks]
        streaming = [other.accounted_step for other in others if other.state == "streaming"]
        if streaming:
            pace = min(streaming)
        elif others or not run.max_lead:
            pace = state.accounted_step  # nobody left to wait for
        else:
            pace = -1  # lockstep: wait for the other runs to join
        max_step = pace + lead
        if max_inflight is not None and state.last_step >= 0:
            # In the run's own step numbers: a run captured every N steps advances N at a time.
            max_step = min(max_step, state.last_step + max_inflight * max(1, state.stride))
        updates.append((state.connection, max_step, state.last_step))
    return updates
