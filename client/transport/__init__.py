"""Transport: everything that leaves the training thread goes through here.

``StreamClient`` owns a bounded outbox and one background worker that keeps a
gRPC stream to the comparison server open, reconnecting as needed.  Capture
code never imports this package's grpc parts; the monitor hands it plain
``StepBatch`` objects.
"""

from twinstep.transport.stream import ClientStats, StreamClient, StreamConfig

__all__ = ["ClientStats", "StreamClient", "StreamConfig"]
