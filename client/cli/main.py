"""``twinstep``: serve, watch, report, halt, demo."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

import grpc

from twinstep._version import __version__
from twinstep.cli import watch as watch_cli
from twinstep.cli import run as run_cli
from twinstep.cli import serve as serve_cli
from twinstep.cli import report_files
from twinstep.cli import compare_dumps as compare_dumps_cli
from twinstep.cli import reproduce as reproduce_cli
from twinstep.cli import zoom as zoom_cli
from twinstep.cli import compare_recordings as compare_recordings_cli
from twinstep.cli.watch import format_event  # noqa: F401  (its home was here: callers import it from main)
from twinstep.cli.examples import add_examples
from twinstep.server.report.render import render_text, report_schema, report_to_dict
from twinstep.v1 import twinstep_pb2 as pb
from twinstep.v1 import twinstep_pb2_grpc as pb_grpc

_DEFAULT_SERVER = "127.0.0.1:50051"
_RPC_TIMEOUT = 10.0


def _server_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--server",
        default=os.environ.get("TWINSTEP_SERVER", _DEFAULT_SERVER),
        help="server address host:port (default: $TWINSTEP_SERVER or %(default)s)",
    )
    parser.add_argument("--token", help="session or operator token (default: $TWINSTEP_TOKEN)")
    parser.add_argument("--tls-ca", metavar="FILE", help="CA or self-signed certificate to trust (default: $TWINSTEP_TLS_CA)")
    parser.add_argument("--tls-client-cert", metavar="FILE", help="client certificate for mutual TLS (default: $TWINSTEP_TLS_CLIENT_CERT)")
    parser.add_argument("--tls-client-key", metavar="FILE", help="its key (default: $TWINSTEP_TLS_CLIENT_KEY)")
    parser.add_argument("--insecure", action="store_true", default=None,
                        help="plaintext to a server that is not on loopback (default: $TWINSTEP_INSECURE)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="twinstep", description="Keep two trainings in precision alignment while they run.")
    parser.add_argument("--version", action="version", version=f"twinstep {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    serve_cli.add_parser(sub)
    watch_cli.add_parser(sub)
    compare_dumps_cli.add_parser(sub)
    zoom_cli.add_parser(sub)
    reproduce_cli.add_parser(sub)
    compare_recordings_cli.add_parser(sub)

    report = sub.add_parser("report", help="print a session's report")
    report.add_argument("session", nargs="?")
    _server_arg(report)
    report.add_argument("--json", action="store_true", help="print the report as JSON (see --schema)")
    report.add_argument("--schema", action="store_true",
                        help="print the JSON Schema of the --json form and exit (no server needed)")
    report_files.add_arguments(report)

    mapping = sub.add_parser("mapping", help="show the module mapping the server worked out when names differ")
    mapping.add_argument("session")
    _server_arg(mapping)
    mapping.add_argument("--write", metavar="FILE", help="write it as a mapping file to pin (server config: mapping_file)")

    sessions = sub.add_parser("sessions", help="list the sessions a server holds, in memory or in its journal")
    _server_arg(sessions)
    sessions.add_argument("--json", action="store_true", help="print them as JSON")

    halt = sub.add_parser("halt", help="halt every run of a session")
    halt.add_argument("session")
    _server_arg(halt)
    halt.add_argument("--reason", default="halted by an operator")

    demo = sub.add_parser("demo", help="torch baseline vs paddle (or MindSpore) port, live, with an embedded server")
    bug = demo.add_mutually_exclusive_group()
    bug.add_argument("--bug", choices=("gelu_tanh", "lr"), default="gelu_tanh",
                     help="porting bug in the candidate jobs (default %(default)s)")
    bug.add_argument("--no-bug", action="store_true", help="a faithful port: stays aligned")
    demo.add_argument("--candidate", default="paddle", metavar="FRAMEWORKS",
                      help="the port(s) judged against the torch baseline: paddle (default), mindspore, or both "
                           "comma-separated (paddle,mindspore: a three-way session)")
    demo.add_argument("--steps", type=int, default=20)
    demo.add_argument("--capture", choices=("stats", "tensors"), default="stats")
    serve_cli.add_server_flag(demo, "dashboard.port", help="show the live dashboard of the demo's server on PORT (0: a free port)")
    run_cli.add_parser(sub)
    add_examples(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        return {"serve": serve_cli.run, "watch": watch_cli.run, "report": _report, "mapping": _mapping, "halt": _halt, "demo": _demo, "sessions": _sessions, "run": run_cli.run,
                "compare-dumps": compare_dumps_cli.run, "zoom": zoom_cli.run, "reproduce": reproduce_cli.run, "compare-recordings": compare_recordings_cli.run}[args.command](args)
    except grpc.RpcError as error:
        from twinstep.runtime.transport.security import explain

        details = error.details() or ""
        print(f"twinstep {args.command}: {error.code().name}: {details}{explain(details, _uses_tls(args))}",
              file=sys.stderr)
        return 2
    except ValueError as error:
        print(f"twinstep {args.command}: {error}", file=sys.stderr)
        return 2
    except OSError as error:  # a port in use, a file that cannot be written: say which, no traceback
        print(f"twinstep {args.command}: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _uses_tls(args: argparse.Namespace) -> bool | None:
    """Whether the command's calls to the server went over TLS (None: not known), for a failure's hint."""
    if not hasattr(args, "tls_ca") or not getattr(args, "server", None):
        return None
    from twinstep.runtime.transport.security import ClientSecurity

    try:
        return ClientSecurity.resolve(token=args.token, tls_ca=args.tls_ca, tls_client_cert=args.tls_client_cert,
                                      tls_client_key=args.tls_client_key, insecure=args.insecure).uses_tls(args.server)
    except (ValueError, AttributeError):
        return None


class _Client:
    """A channel to the server by the loopback rule, and the token every call carries."""

    def __init__(self, args: argparse.Namespace) -> None:
        from twinstep.runtime.transport.security import ClientSecurity

        security = ClientSecurity.resolve(token=args.token, tls_ca=args.tls_ca, tls_client_cert=args.tls_client_cert,
                                          tls_client_key=args.tls_client_key, insecure=args.insecure)
        self.channel = security.channel(args.server)
        self.stub = pb_grpc.TwinstepStub(self.channel)
        self.metadata = security.metadata() or None

    def __enter__(self) -> "_Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.channel.close()


def _report(args: argparse.Namespace) -> int:
    if args.schema:
        print(json.dumps(report_schema(), indent=2))
        return 0
    if not args.session:
        raise ValueError("which session? twinstep report SESSION [--json]")
    if report_files.wanted(args):
        return report_files.run(args)
    with _Client(args) as client:
        report = client.stub.GetReport(pb.ReportRequest(session=args.session), timeout=_RPC_TIMEOUT,
                                       metadata=client.metadata)
    if args.json:
        print(json.dumps(report_to_dict(report), indent=2))
    else:
        print(render_text(report))
    return 0


def _mapping(args: argparse.Namespace) -> int:
    with _Client(args) as client:
        report = client.stub.GetReport(pb.ReportRequest(session=args.session), timeout=_RPC_TIMEOUT,
                                       metadata=client.metadata)
    if not report.proposed_mapping:
        print("module names matched directly; no mapping was needed")
        return 0
    if args.write:
        with open(args.write, "w") as f:
            f.write(report.proposed_mapping)
        print(f"wrote {args.write}")
    else:
        print(report.proposed_mapping, end="")
    return 0


def _halt(args: argparse.Namespace) -> int:
    with _Client(args) as client:
        response = client.stub.Halt(pb.HaltRequest(session=args.session, reason=args.reason), timeout=_RPC_TIMEOUT,
                                    metadata=client.metadata)
    print(f"halt sent to: {', '.join(response.runs) or 'no connected run'}")
    return 0


def _sessions(args: argparse.Namespace) -> int:
    with _Client(args) as client:
        listing = client.stub.ListSessions(pb.ListSessionsRequest(), timeout=_RPC_TIMEOUT, metadata=client.metadata)
    if args.json:
        from google.protobuf import json_format

        print(json.dumps(json_format.MessageToDict(listing, always_print_fields_with_no_presence=True), indent=2))
        return 0
    print(format_sessions(listing))
    return 0


def format_sessions(listing: pb.SessionList) -> str:
    """A table of sessions: where each lives, its verdict, runs, steps compared and first divergence."""
    if not listing.sessions:
        return "no sessions" + (f" (journal {listing.journal})" if listing.journal else "")
    lines = [f"{'SESSION':24} {'WHERE':8} {'STATUS':11} {'STEPS':>6} {'ENDED':19} RUNS / FIRST DIVERGENCE"]
    for s in listing.sessions:
        ended = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(s.ended_unix)) if s.ended_unix else "-"
        where = "memory" if s.in_memory else "journal" if listing.journal else "archived"
        line = f"{s.name[:24]:24} {where:8} {s.status:11} {s.steps_compared:>6} {ended:19} {', '.join(s.runs)}"
        if s.first_divergence:
            line += f"\n{'':24} {s.first_divergence}"
        lines.append(line)
    if listing.journal:
        lines.append(f"journal: {listing.journal}")
    return "\n".join(lines)


def _demo(args: argparse.Namespace) -> int:
    from twinstep.tools.demo.run import run_demo

    return run_demo(bug=None if args.no_bug else args.bug, steps=args.steps, capture=args.capture,
                    http_port=serve_cli.server_flag(args, "dashboard.port"), candidates=args.candidate)


if __name__ == "__main__":
    sys.exit(main())
