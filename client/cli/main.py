"""``twinstep``: serve, watch, report, halt, demo."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time

import grpc

from twinstep._version import __version__
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="twinstep", description="Keep two trainings in precision alignment while they run.")
    parser.add_argument("--version", action="version", version=f"twinstep {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the comparison server")
    serve.add_argument("--port", type=int, default=50051)
    serve.add_argument("--host", default="127.0.0.1", help="interface to listen on (0.0.0.0 for all)")
    serve.add_argument("--config", help="YAML config: tolerances, name mapping, window")
    serve.add_argument("--halt-on-divergence", action="store_true", help="halt every run of a session at its first divergence")
    serve.add_argument("--release-freed-memory", action="store_true",
                       help="let the allocator return freed memory to the OS: a smaller resident size after bursts, "
                            "at the cost of page faults on every tensor piece (see twinstep.server.memory)")

    watch = sub.add_parser("watch", help="print live progress and alerts of a session")
    watch.add_argument("session")
    _server_arg(watch)
    watch.add_argument("--follow", action="store_true", help="keep watching after every run has ended")

    report = sub.add_parser("report", help="print a session's report")
    report.add_argument("session", nargs="?")
    _server_arg(report)
    report.add_argument("--json", action="store_true", help="print the report as JSON (see --schema)")
    report.add_argument("--schema", action="store_true",
                        help="print the JSON Schema of the --json form and exit (no server needed)")

    mapping = sub.add_parser("mapping", help="show the module mapping the server worked out when names differ")
    mapping.add_argument("session")
    _server_arg(mapping)
    mapping.add_argument("--write", metavar="FILE", help="write it as a mapping file to pin (server config: mapping_file)")

    halt = sub.add_parser("halt", help="halt every run of a session")
    halt.add_argument("session")
    _server_arg(halt)
    halt.add_argument("--reason", default="halted by an operator")

    demo = sub.add_parser("demo", help="torch baseline vs paddle port, live, with an embedded server")
    bug = demo.add_mutually_exclusive_group()
    bug.add_argument("--bug", choices=("gelu_tanh", "lr"), default="gelu_tanh", help="porting bug in the paddle job (default %(default)s)")
    bug.add_argument("--no-bug", action="store_true", help="a faithful port: stays aligned")
    demo.add_argument("--steps", type=int, default=20)
    demo.add_argument("--capture", choices=("stats", "tensors"), default="stats")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        return {"serve": _serve, "watch": _watch, "report": _report, "mapping": _mapping, "halt": _halt, "demo": _demo}[args.command](args)
    except grpc.RpcError as error:
        print(f"twinstep {args.command}: {error.code().name}: {error.details()}", file=sys.stderr)
        return 2
    except ValueError as error:
        print(f"twinstep {args.command}: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _serve(args: argparse.Namespace) -> int:
    from twinstep.server import ServerConfig, load_config, serve
    from twinstep.server.memory import retain_freed_memory

    config = load_config(args.config) if args.config else ServerConfig()
    if not args.release_freed_memory:
        retain_freed_memory()  # this process is the server's own
    handle = serve(port=args.port, host=args.host, config=config, halt_on_divergence=args.halt_on_divergence or None)
    print(f"twinstep server listening on {args.host}:{handle.port}", flush=True)
    stop = {"requested": False}

    def on_signal(signum: int, frame: object) -> None:
        stop["requested"] = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    while not stop["requested"]:
        time.sleep(0.2)
    handle.stop(grace=2.0)
    return 0


def _stub(address: str) -> tuple[grpc.Channel, pb_grpc.TwinstepStub]:
    channel = grpc.insecure_channel(address)
    return channel, pb_grpc.TwinstepStub(channel)


def _watch(args: argparse.Namespace) -> int:
    channel, stub = _stub(args.server)
    with channel:
        for event in stub.Watch(pb.WatchRequest(session=args.session)):
            line = format_event(event)
            if line:
                print(line, flush=True)
            if not args.follow and event.WhichOneof("body") == "progress" and _all_ended(event.progress):
                return 0
    return 0


def _all_ended(progress: pb.Progress) -> bool:
    return len(progress.runs) >= 2 and all(r.state in ("finished", "halted", "lost") for r in progress.runs)


def format_event(event: pb.Event) -> str:
    """One line for a watch event."""
    kind = event.WhichOneof("body")
    if kind == "progress":
        runs = " | ".join(
            f"{r.name}{'*' if r.baseline else ''} step {r.last_step} {r.state}"
            + (f" dropped {r.dropped}" if r.dropped else "")
            + (f" capture-failures {failures}" if (failures := _capture_failures(r)) else "")
            for r in event.progress.runs
        )
        return f"[{event.session}] {runs} | compared {event.progress.steps_compared}"
    if kind == "divergence":
        d = event.divergence
        return (
            f"[{event.session}] DIVERGENCE run {d.candidate_run!r} step {d.step} rank {d.rank} {d.phase} "
            f"{d.module or '(model)'!r}: {d.metric} {d.value:.3g} > {d.tolerance:.3g}"
            + (f"\n[{event.session}]   stage: {d.stage}" if d.stage else "")
            + (f"\n[{event.session}]   AFTER A GAP (earliest among compared steps; not compared: {d.gaps_summary})"
               if d.after_gap else "")
        )
    if kind == "halt":
        h = event.halt
        at = f" at step {h.at_step}" if h.at_step >= 0 else ""
        return f"[{event.session}] HALT run {h.run!r}{at}: {h.reason}"
    if kind == "alert":
        return f"[{event.session}] {event.alert.level.upper()}: {event.alert.message}"
    return ""


def _capture_failures(run: pb.RunStatus) -> int:
    """Records and whole steps the run could not capture, over its ranks."""
    return sum(sum(f.count for f in h.capture.failures) + h.capture.failed_steps for h in run.health)


def _report(args: argparse.Namespace) -> int:
    if args.schema:
        print(json.dumps(report_schema(), indent=2))
        return 0
    if not args.session:
        raise ValueError("which session? twinstep report SESSION [--json]")
    channel, stub = _stub(args.server)
    with channel:
        report = stub.GetReport(pb.ReportRequest(session=args.session), timeout=_RPC_TIMEOUT)
    if args.json:
        print(json.dumps(report_to_dict(report), indent=2))
    else:
        print(render_text(report))
    return 0


def _mapping(args: argparse.Namespace) -> int:
    channel, stub = _stub(args.server)
    with channel:
        report = stub.GetReport(pb.ReportRequest(session=args.session), timeout=_RPC_TIMEOUT)
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
    channel, stub = _stub(args.server)
    with channel:
        response = stub.Halt(pb.HaltRequest(session=args.session, reason=args.reason), timeout=_RPC_TIMEOUT)
    print(f"halt sent to: {', '.join(response.runs) or 'no connected run'}")
    return 0


def _demo(args: argparse.Namespace) -> int:
    from twinstep.demo.run import run_demo

    return run_demo(bug=None if args.no_bug else args.bug, steps=args.steps, capture=args.capture)


if __name__ == "__main__":
    sys.exit(main())
