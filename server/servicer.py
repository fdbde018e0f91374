"""gRPC servicer: protocol handling only; state lives in sessions."""

from __future__ import annotations

import logging
import queue
import threading
from typing import Any, Iterator

import grpc

from twinstep._version import PROTOCOL_VERSION
from twinstep.server.alert.events import EventBus
from twinstep.server.batches.service import BatchSyncService
from twinstep.server.connection import Connection, StreamEnd, StreamFailure
from twinstep.server.control.service import ZoomService
from twinstep.server.errors import InputError, invalid
from twinstep.server.ingest.wire import ReceivedPiece, Unreadable, parse_client_message
from twinstep.server.report.builder import build_report
from twinstep.server.security import Authorizer, Caller, Denied
from twinstep.server.journal.store import JournalClosed
from twinstep.server.registry import SessionRegistry
from twinstep.server.session import Session
from twinstep.server.view.wire import to_proto as history_to_proto
from twinstep.server.weights.service import WeightExchange, WeightSyncService
from twinstep.v1 import twinstep_pb2 as pb
from twinstep.v1 import twinstep_pb2_grpc as pb_grpc

logger = logging.getLogger("twinstep.server")
_POLL = 0.5


class TwinstepServicer(BatchSyncService, ZoomService, WeightSyncService, pb_grpc.TwinstepServicer):
    def __init__(self, registry: SessionRegistry, stopping: threading.Event, auth: Authorizer | None = None) -> None:
        self.registry = registry
        self._stopping = stopping
        self.auth = auth or Authorizer()  # no tokens: open
        self.weights = WeightExchange(registry, self.auth)  # weight sync's publications (server.weights)

    # -- training processes -------------------------------------------------------

    def Stream(self, request_iterator: Iterator[pb.ClientMessage | ReceivedPiece], context: grpc.ServicerContext) -> Iterator[pb.ServerMessage]:
        # The token is checked before anything is read; its session once the hello names one.
        caller = self.auth.authorize(context, "stream", check=False)
        conn = Connection(context.peer(), self.registry.config.window.bytes)
        context.add_callback(conn.finish)  # the client left: stop yielding
        reader = threading.Thread(
            target=self._read, args=(request_iterator, conn, caller), name="twinstep-stream-reader", daemon=True
        )
        reader.start()
        while True:
            item = conn.next(_POLL)
            if item is None:
                if not context.is_active():
                    return
                continue
            if isinstance(item, StreamFailure):
                context.abort(item.code, item.details)
            if isinstance(item, StreamEnd):
                return
            yield item

    def _read(self, requests: Iterator[pb.ClientMessage | ReceivedPiece], conn: Connection, caller: Caller) -> None:
        session: Session | None = None
        try:
            for message in requests:
                if isinstance(message, Unreadable):
                    raise invalid(f"a message of {message.nbytes} bytes is not a twinstep ClientMessage "
                                  f"({message.reason}); is the client twinstep of the same protocol?")
                if isinstance(message, ReceivedPiece):  # parsed without copying its payload (ingest.wire)
                    if session is None:
                        raise InputError(grpc.StatusCode.FAILED_PRECONDITION, "first message must be hello, got tensor")
                    conn.pieces.add(message.header, message.data)
                    continue
                kind = message.WhichOneof("body")
                if session is None:
                    if kind != "hello":
                        raise InputError(grpc.StatusCode.FAILED_PRECONDITION, f"first message must be hello, got {kind or 'an empty message'}")
                    hello = message.hello
                    # Before the session is created or joined: a token for another session creates nothing.
                    self.auth.check(caller, "stream", hello.session)
                    conn.session, conn.run, conn.rank = hello.session, hello.run, hello.rank  # for log lines
                    share = self.registry.share
                    if not share.owns(hello.session, hello.rank):  # a shard reached directly: back to the front
                        conn.send(pb.ServerMessage(welcome=pb.Welcome(protocol_version=PROTOCOL_VERSION,
                                                                      stream_to=share.front)))
                        conn.finish()
                        return
                    joining = self.registry.get_or_create(hello.session)
                    joining.join(conn, hello)  # queues the Welcome
                    session = joining
                elif kind == "manifest":
                    session.add_manifest(conn, message.manifest)
                elif kind == "tensor":
                    conn.pieces.add(message.tensor)
                elif kind == "step":
                    session.add_step(conn, message.step)
                elif kind == "health":
                    session.add_health(conn, message.health)
                elif kind == "setup":
                    session.add_setup(conn, message.setup)
                elif kind == "halt_ack":
                    session.halt_ack(conn, message.halt_ack)
                elif kind == "close":
                    session.close_stream(conn, message.close)
                elif kind == "hello":
                    raise invalid("hello sent twice on one stream")
                else:
                    raise invalid("empty client message")
            conn.finish()
        except Denied as denied:
            self.auth.note(conn.peer, "stream", denied)
            conn.fail(denied.code, denied.message)
        except JournalClosed:
            conn.fail(grpc.StatusCode.UNAVAILABLE, "the server is stopping; reconnect to resume")
        except InputError as error:
            label = conn.label if conn.session else conn.peer
            logger.warning("rejected stream %s: %s", label, error.message)
            conn.fail(error.code, error.message)
            if session is not None:
                session.events.publish(
                    pb.Event(alert=pb.AlertNotice(level="error", message=f"{label}: {error.message}")), keep=True
                )
        except grpc.RpcError:
            conn.finish()  # the client went away
        except Exception:  # a server bug must end one stream, not the server
            logger.exception("internal error on stream %s", conn.peer)
            conn.fail(grpc.StatusCode.INTERNAL, "internal server error (see the server log)")
        finally:
            conn.pieces.discard()
            if session is not None:
                session.leave(conn)

    # -- observers ------------------------------------------------------------------------

    def Watch(self, request: pb.WatchRequest, context: grpc.ServicerContext) -> Iterator[pb.Event]:
        self.auth.authorize(context, "watch", request.session)
        if not request.session:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "watch needs a session name")
        # Watching a session that no stream has named yet waits for it; it never creates it.
        session = self.registry.get(request.session)
        if session is None:
            yield pb.Event(session=request.session, progress=pb.Progress())
            while session is None:
                if not context.is_active() or self._stopping.is_set():
                    return
                session = self.registry.wait_for(request.session, _POLL)
        yield from watch_events(session.events, pb.Event(session=session.name, progress=session.progress()), context,
                                self._stopping)

    def GetReport(self, request: pb.ReportRequest, context: grpc.ServicerContext) -> pb.Report:
        caller = self.auth.authorize(context, "report", request.session)
        session = self.registry.get(request.session)
        if session is None:
            archived = self.registry.archived_report(request.session)
            if archived is not None:
                return archived
            # Other sessions' names are the operator's to see.
            names = f" (sessions: {', '.join(self.registry.names()) or 'none'})" if caller.operator else ""
            context.abort(grpc.StatusCode.NOT_FOUND, f"no session {request.session!r} on this server{names}")
        return build_report(session.snapshot())

    def GetHistory(self, request: pb.HistoryRequest, context: grpc.ServicerContext) -> pb.History:
        """The dashboard's history of a session (an archived session's is empty: only its report is kept)."""
        caller = self.auth.authorize(context, "report", request.session)
        session = self.registry.get(request.session)
        if session is None:
            if self.registry.archived_report(request.session) is not None:
                return pb.History(session=request.session)
            names = f" (sessions: {', '.join(self.registry.names()) or 'none'})" if caller.operator else ""
            context.abort(grpc.StatusCode.NOT_FOUND, f"no session {request.session!r} on this server{names}")
        return history_to_proto(session.history())

    def ListSessions(self, request: pb.ListSessionsRequest, context: grpc.ServicerContext) -> pb.SessionList:
        # The operator sees every session; a session token sees its own.
        caller = self.auth.authorize(context, "list", check=False)
        return self.registry.list_sessions(only=None if caller.operator else caller.session)

    def Halt(self, request: pb.HaltRequest, context: grpc.ServicerContext) -> pb.HaltResponse:
        self.auth.authorize(context, "halt", request.session)
        session = self.registry.get(request.session)
        if session is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"no session {request.session!r} on this server")
        runs = session.halt(request.reason or "halted by an operator")
        return pb.HaltResponse(runs=runs)


def watch_events(bus: EventBus, first: pb.Event, context: grpc.ServicerContext,
                 stopping: threading.Event) -> Iterator[pb.Event]:
    """A Watch stream: ``first``, then ``bus``'s events until the watcher or the server goes (a sharded
    server's front streams its coordinator's bus the same way)."""
    events = bus.subscribe()
    context.add_callback(lambda: events.put(None) if not events.full() else None)
    try:
        yield first
        while context.is_active() and not stopping.is_set():
            try:
                event = events.get(timeout=_POLL)
            except queue.Empty:
                continue
            if event is None:
                return
            yield event
    finally:
        bus.unsubscribe(events)


# -- registration -------------------------------------------------------------------------------

_SERVICE = pb.DESCRIPTOR.services_by_name["Twinstep"]


def add_servicer(servicer: Any, server: grpc.Server) -> None:
    """Register the Twinstep service, as the generated code does, with Stream reading pieces zero-copy."""
    handlers = {
        "Stream": grpc.stream_stream_rpc_method_handler(
            servicer.Stream, request_deserializer=parse_client_message,
            response_serializer=pb.ServerMessage.SerializeToString,
        ),
        "Watch": grpc.unary_stream_rpc_method_handler(
            servicer.Watch, request_deserializer=pb.WatchRequest.FromString,
            response_serializer=pb.Event.SerializeToString,
        ),
        "GetReport": grpc.unary_unary_rpc_method_handler(
            servicer.GetReport, request_deserializer=pb.ReportRequest.FromString,
            response_serializer=pb.Report.SerializeToString,
        ),
        "Halt": grpc.unary_unary_rpc_method_handler(
            servicer.Halt, request_deserializer=pb.HaltRequest.FromString,
            response_serializer=pb.HaltResponse.SerializeToString,
        ),
        "GetHistory": grpc.unary_unary_rpc_method_handler(
            servicer.GetHistory, request_deserializer=pb.HistoryRequest.FromString,
            response_serializer=pb.History.SerializeToString,
        ),
        "ListSessions": grpc.unary_unary_rpc_method_handler(
            servicer.ListSessions, request_deserializer=pb.ListSessionsRequest.FromString,
            response_serializer=pb.SessionList.SerializeToString,
        ),
        "PublishBatch": grpc.unary_unary_rpc_method_handler(
            servicer.PublishBatch, request_deserializer=pb.PublishedBatch.FromString,
            response_serializer=pb.PublishBatchReply.SerializeToString,
        ),
        "GetBatch": grpc.unary_unary_rpc_method_handler(
            servicer.GetBatch, request_deserializer=pb.BatchRequest.FromString,
            response_serializer=pb.BatchReply.SerializeToString,
        ),
    }
    handlers["Zoom"] = grpc.unary_unary_rpc_method_handler(
        servicer.Zoom, request_deserializer=pb.ZoomRequest.FromString,
        response_serializer=pb.ZoomResponse.SerializeToString,
    )
    handlers["PublishWeights"] = grpc.stream_unary_rpc_method_handler(
        servicer.PublishWeights, request_deserializer=pb.WeightsUpload.FromString,
        response_serializer=pb.WeightsPublished.SerializeToString,
    )
    handlers["FetchWeights"] = grpc.unary_stream_rpc_method_handler(
        servicer.FetchWeights, request_deserializer=pb.WeightsRequest.FromString,
        response_serializer=pb.WeightsDownload.SerializeToString,
    )
    missing = set(_SERVICE.methods_by_name) - set(handlers)
    if missing:  # a method added to the .proto must be registered here too
        raise RuntimeError(f"twinstep.server.servicer does not register {sorted(missing)}")
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(_SERVICE.full_name, handlers),))
    server.add_registered_method_handlers(_SERVICE.full_name, handlers)
