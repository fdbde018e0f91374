"""Transport: everything that leaves the training thread goes through here.

A :class:`Sender` (``base.py``, the contract) carries steps to the server:
``StreamClient`` owns a bounded outbox and one background worker that keeps a
gRPC stream to the comparison server open, reconnecting as needed;
``SidecarClient`` hands steps to a sender process that runs one.  Both keep
their drops in a ``DropLedger``.  Capture code never imports this package's
grpc parts; the monitor hands it plain ``StepBatch`` objects.
"""

from twinstep.runtime.transport.base import ClientStats, Sender
from twinstep.runtime.transport.ledger import DropLedger
from twinstep.runtime.transport.stream import StreamClient, StreamConfig

__all__ = ["ClientStats", "DropLedger", "Sender", "StreamClient", "StreamConfig"]
