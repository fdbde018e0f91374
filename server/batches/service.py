"""The batch-sync RPCs: PublishBatch (a baseline rank) and GetBatch (the same rank of a candidate).

Mixed into the servicer, which registers them; authorized as a Stream is (a
session token may publish and fetch its own session's batches).  A batch is
checked here (its tensors' dtypes, shapes and sizes) before the session's
buffer takes it, so a bad one is refused with INVALID_ARGUMENT and counted,
and neither the session nor any other stream is affected.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import grpc

from twinstep.wire import codec
from twinstep.server.batches.buffer import BatchBuffer
from twinstep.server.errors import InputError
from twinstep.v1 import twinstep_pb2 as pb

if TYPE_CHECKING:
    from twinstep.server.registry import SessionRegistry
    from twinstep.server.security import Authorizer

#: Longest one GetBatch waits before answering "not yet": a waiting handler thread is freed this soon.
MAX_WAIT_SECONDS = 5.0
#: Deepest nesting of containers a batch may have (protobuf's own limit is 100).
MAX_DEPTH = 32


class BatchError(ValueError):
    """A published batch that cannot be held as it is."""


class BatchSyncService:
    """PublishBatch and GetBatch; the servicer provides ``registry`` and ``auth``."""

    registry: "SessionRegistry"
    auth: "Authorizer"

    def PublishBatch(self, request: pb.PublishedBatch, context: grpc.ServicerContext) -> pb.PublishBatchReply:
        self.auth.authorize(context, "stream", request.session)
        if request.step < 0 or not request.run:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a published batch needs a run name and a step >= 0")
        session = self._session(request.session, context)
        buffer: BatchBuffer = session.batches
        if session.run_roles().get(request.run, "baseline") != "baseline":
            buffer.refused()
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"run {request.run!r} is a candidate of session {request.session!r}: only the baseline "
                          "publishes batches (a candidate fetches them with Monitor.baseline_batch)")
        limit = session.config.sync.batch_max_bytes
        try:
            check_batch(request.value, limit)
        except BatchError as error:
            buffer.refused()
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"batch of run {request.run!r} rank {request.rank} step {request.step}: {error}")
        buffer.publish(request, request.ByteSize())  # what it holds in memory (compressed tensors stay so)
        counts = buffer.snapshot()
        return pb.PublishBatchReply(held=len(buffer), dropped=counts.dropped)

    def _session(self, name: str, context: grpc.ServicerContext):
        """The named session, created as a Stream's hello would; a name it refuses aborts with its status."""
        try:
            return self.registry.get_or_create(name)
        except InputError as error:
            context.abort(error.code, error.message)

    def GetBatch(self, request: pb.BatchRequest, context: grpc.ServicerContext) -> pb.BatchReply:
        self.auth.authorize(context, "stream", request.session)
        if request.step < 0:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"step {request.step}: steps count from 0")
        session = self._session(request.session, context)
        wait = request.wait_seconds if math.isfinite(request.wait_seconds) else 0.0
        found = session.batches.take(request.rank, request.step, min(max(wait, 0.0), MAX_WAIT_SECONDS))
        if found.batch is not None:
            return pb.BatchReply(ready=True, batch=found.batch)
        where = f"step {request.step} of rank {request.rank}"
        if found.dropped:
            context.abort(grpc.StatusCode.NOT_FOUND,
                          f"the batch of {where} was published but dropped from the server's buffer to stay within "
                          f"batch_buffer_bytes ({session.config.sync.batch_buffer_bytes} bytes): the baseline ran too far "
                          "ahead; raise batch_buffer_bytes or pace the baseline (attach(lockstep=N))")
        base = session.baseline_rank(request.rank)
        ended, name, last = base.ended, base.run, base.last_step
        latest = session.batches.latest_step(request.rank)
        if ended and session.batches.take(request.rank, request.step, 0.0).batch is None:
            context.abort(grpc.StatusCode.NOT_FOUND,
                          f"baseline run {name!r} rank {request.rank} ended ({base.state}, last step {last}) "
                          f"without publishing the batch of step {request.step}")
        if name is None:
            waiting = f"no baseline has joined session {request.session!r} yet"
        else:
            published = f"its latest batch held is step {latest}" if latest >= 0 else "it has published no batch held now"
            waiting = f"baseline run {name!r} rank {request.rank} is at step {last}; {published}"
        return pb.BatchReply(ready=False, waiting_for=waiting)


def check_batch(value: pb.BatchValue, limit: int) -> int:
    """Storage bytes of a batch's tensors; BatchError for a tensor that does not add up, or a batch over ``limit``."""
    total = 0
    stack = [(value, 0)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise BatchError(f"nested deeper than {MAX_DEPTH} containers")
        kind = node.WhichOneof("kind")
        if kind is None:
            raise BatchError("a node of the batch is empty (no tensor, container or value)")
        if kind in ("list", "tuple"):
            stack.extend((item, depth + 1) for item in getattr(node, kind).items)
        elif kind == "dict":
            if len(node.dict.keys) != len(node.dict.values):
                raise BatchError(f"a dict has {len(node.dict.keys)} keys and {len(node.dict.values)} values")
            stack.extend((item, depth + 1) for item in node.dict.values)
        elif kind == "tensor":
            total += _tensor_bytes(node.tensor)
            if total > limit:
                raise BatchError(f"its tensors hold more than batch_max_bytes ({limit} bytes); publish a smaller "
                                 "batch, or raise batch_max_bytes in the server's config")
    return total


def _tensor_bytes(tensor: pb.BatchTensor) -> int:
    name = codec.WIRE_TO_DTYPE.get(tensor.dtype)
    if name is None:
        raise BatchError(f"a tensor has unknown dtype {tensor.dtype}")
    if any(d < 0 for d in tensor.shape):
        raise BatchError(f"a tensor has a negative dimension in shape {list(tensor.shape)}")
    nbytes = math.prod(tensor.shape) * codec.storage_dtype(name).itemsize
    if tensor.raw_nbytes != nbytes:
        raise BatchError(f"a {name} tensor of shape {list(tensor.shape)} says {tensor.raw_nbytes} bytes, "
                         f"its shape needs {nbytes}")
    if tensor.codec == pb.RAW and len(tensor.data) != nbytes:
        raise BatchError(f"a raw {name} tensor of shape {list(tensor.shape)} carries {len(tensor.data)} bytes, "
                         f"its shape needs {nbytes}")
    if tensor.codec not in (pb.RAW, pb.ZSTD):
        raise BatchError(f"a tensor uses codec {tensor.codec}; batches travel RAW or ZSTD")
    return nbytes
