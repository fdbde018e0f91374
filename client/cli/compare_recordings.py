"""``twinstep compare-recordings A [B]``: two recorded runs judged by twinstep's engine, offline.

A is the baseline, B the candidate; each is ``PATH[:RUN]``, PATH a recording
written by ``twinstep serve --record`` or its directory.  The runs are read a
frame at a time and fed through the server's own Session
(twinstep.server.record.compare): the same alignment, tolerances, first
divergence and report as the live session, text or JSON (the schema of
``twinstep report --json``).  No server is needed.  A damaged recording is
compared up to the damage: the report says so and the exit status is 2.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

EXAMPLES = """\
examples:
  twinstep compare-recordings recordings/port-20250101T120000.twrec      # its baseline vs its first candidate
  twinstep compare-recordings recordings/port-20250101T120000.twrec:torch recordings/port-20250101T120000.twrec:paddle
  twinstep compare-recordings last_week.twrec today.twrec:paddle --json > report.json
  twinstep compare-recordings recordings recordings:paddle --session port   # the newest recording of session 'port'
  twinstep compare-recordings a.twrec b.twrec --config tolerances.yaml --names gpu npu

exit status: 0 aligned, 1 diverged or not fully compared, 2 a recording or an option could not be read
(a damaged recording: the report of what was read before the damage is printed, and the error).
"""


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "compare-recordings", help="compare two recorded runs (twinstep serve --record) with twinstep's engine",
        description="Compare two runs recorded by `twinstep serve --record DIR` offline, through the comparison "
                    "engine and report of a live session: A is the baseline, B the candidate, each PATH[:RUN] "
                    "(a recording file, or a directory of them; RUN: a run of that recording). Without B: A's "
                    "recording, its first candidate. See docs/recording.md.",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("a", metavar="A", help="the baseline: PATH[:RUN] (RUN default: the recording's baseline)")
    parser.add_argument("b", metavar="B", nargs="?",
                        help="the candidate: PATH[:RUN] (default: A's recording; RUN default: its first candidate)")
    parser.add_argument("--session", metavar="NAME",
                        help="when a PATH is a directory: the newest recording of this session (default: the newest)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON (twinstep report --schema)")
    parser.add_argument("--config", metavar="FILE", help="server config YAML: tolerances, mapping, mapping_file")
    parser.add_argument("--names", nargs=2, metavar=("BASELINE", "CANDIDATE"),
                        help="run names in the report (default: the recorded names)")
    return parser


def run(args: argparse.Namespace) -> int:
    from twinstep.server.errors import InputError
    from twinstep.server.record.format import RecordingError

    try:
        report, problems = compare(args)
    except (RecordingError, ValueError) as error:
        return _fail(str(error))
    except InputError as error:
        return _fail(f"the engine refused the recorded inputs: {error.message}")
    except OSError as error:
        return _fail(f"cannot read {error.filename or 'a file'}: {error.strerror or error}")
    except Exception as error:  # never a traceback: say what happened and how to report it
        logging.getLogger("twinstep").debug("compare-recordings failed", exc_info=True)
        return _fail(f"internal error ({type(error).__name__}: {error}); please report it with the recordings")
    from twinstep.server.report.render import render_text, report_to_dict

    if args.json:
        print(json.dumps(report_to_dict(report), indent=2))
    else:
        print(render_text(report))
    for problem in problems:
        print(f"twinstep compare-recordings: {problem}", file=sys.stderr)
    if problems:
        return 2
    return 0 if report.status == "aligned" else 1


def compare(args: argparse.Namespace):
    """(Report, problems) of run A (baseline) against run B; RecordingError or ValueError when one cannot be read."""
    from twinstep.server.config import ServerConfig, load_config
    from twinstep.server.record.compare import compare_sides, resolve

    config = load_config(args.config) if args.config else ServerConfig()
    config.halt.on_divergence = False
    names = tuple(args.names) if args.names else None
    if names and names[0] == names[1]:
        raise ValueError("--names: the two runs need different names")
    sides = resolve(args.a, args.b, args.session, names)
    for side in sides:
        print(f"reading {side.describe()}", file=sys.stderr, flush=True)
    server_log = logging.getLogger("twinstep.server")
    level = server_log.level
    server_log.setLevel(logging.CRITICAL)  # the report says it all; the session's alerts would repeat it
    try:
        return compare_sides(sides, config)
    finally:
        server_log.setLevel(level)


def _fail(message: str) -> int:
    print(f"twinstep compare-recordings: {message}", file=sys.stderr)
    return 2
