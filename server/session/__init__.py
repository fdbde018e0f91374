"""A session: one comparison of a baseline with its candidates.

- ``core.py``: :class:`SessionCore`, the session's state and rules; inputs in, actions out (no lock, no I/O);
- ``actions.py``: what an input asks for (credits, messages, alerts, halts, journal entries, timers);
- ``pipeline.py``: alignment, comparison and detection's bookkeeping;
- ``policy.py``: what a declared divergence leads to (halt, halt alone, zoom, operations, bundles);
- ``verdict.py``: the verdict and the words it is told in;
- ``views.py``: copies others read (report snapshot, progress, metrics);
- ``coordinator.py``: :class:`Session`, which owns the lock, feeds the core and carries out its actions.
"""

from twinstep.server.session.coordinator import Session
from twinstep.server.session.core import SessionCore

__all__ = ["Session", "SessionCore"]
