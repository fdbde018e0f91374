"""``twinstep report SESSION --html FILE`` and ``--csv DIR``: reports to keep, from a running server.

Both read the session's report (GetReport) and the dashboard's history (GetHistory) over gRPC, so they
work against a remote server with the same address, TLS and token flags as ``twinstep report``.
``--html`` writes the dashboard's page, frozen: its script, styles, chart library and data inline, so
the file opens anywhere with no network.  ``--csv`` writes long-format tables (errors.csv, curves.csv).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from twinstep.v1 import twinstep_pb2 as pb
from twinstep.v1 import twinstep_pb2_grpc as pb_grpc

#: A history answer can be tens of MB (server/view/wire.py bounds it near 40 MB): the channel takes it.
_MAX_RECEIVE = 128 << 20
_TIMEOUT = 60.0


def add_arguments(report: argparse.ArgumentParser) -> None:
    """The --html and --csv flags of ``twinstep report``."""
    report.add_argument("--html", metavar="FILE",
                        help="write the dashboard's views as one self-contained HTML file (opens with no network)")
    report.add_argument("--csv", metavar="DIR",
                        help="write per-module error tables (errors.csv) and loss/gradient-norm curves (curves.csv) "
                             "into DIR")


def wanted(args: argparse.Namespace) -> bool:
    return bool(getattr(args, "html", None) or getattr(args, "csv", None))


def run(args: argparse.Namespace) -> int:
    from twinstep.runtime.transport.security import ClientSecurity

    security = ClientSecurity.resolve(token=args.token, tls_ca=args.tls_ca, tls_client_cert=args.tls_client_cert,
                                      tls_client_key=args.tls_client_key, insecure=args.insecure)
    options = [("grpc.max_receive_message_length", _MAX_RECEIVE)]
    with security.channel(args.server, options=options) as channel:
        stub = pb_grpc.TwinstepStub(channel)
        metadata = security.metadata() or None
        report = stub.GetReport(pb.ReportRequest(session=args.session), timeout=_TIMEOUT, metadata=metadata)
        history = stub.GetHistory(pb.HistoryRequest(session=args.session), timeout=_TIMEOUT, metadata=metadata)
    written = write_files(report, history, html=args.html, csv_dir=args.csv)
    for path in written:
        print(f"wrote {path} ({path.stat().st_size / 1024:.0f} KiB)")
    if not history.steps:
        print("note: the session has left the server's memory and only its report is kept: the files carry "
              "the report without the per-step history")
    return 0


def write_files(report: pb.Report, history: pb.History, *, html: str | None = None,
                csv_dir: str | None = None) -> list[Path]:
    """The HTML file and/or the CSV tables of one session; returns the paths written."""
    from twinstep.server.view.model import build_view
    from twinstep.server.view.page import render_frozen
    from twinstep.server.view.tables import write_tables
    from twinstep.server.view.wire import from_proto

    # A session that left the server's memory keeps its report only: its history comes back empty (steps 0).
    copied = from_proto(history) if history.steps else None
    written: list[Path] = []
    if html:
        path = Path(html)
        if path.parent and not path.parent.exists():
            raise ValueError(f"cannot write {path}: folder {path.parent} does not exist")
        path.write_text(render_frozen(build_view(report, copied, live=None, max_columns=None)), encoding="utf-8")
        written.append(path)
    if csv_dir:
        written.extend(write_tables(copied or from_proto(history), csv_dir))
    return written
