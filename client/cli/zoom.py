"""``twinstep zoom SESSION --module PATTERN``: change what the running trainings capture, from one step on.

The server picks (or checks) a step every rank of every run can still reach,
and tells each run to capture the matching modules as asked from that step
for ``--steps`` steps, then go back.  ``--bundle`` also has every run write a
reproducer bundle of the module at that step (twinstep reproduce); ``--ops
MODULE`` has every run capture that module's operations in its first call at
that step, and the report names the first that differs (docs/operations.md).
"""

from __future__ import annotations

import argparse

from twinstep.v1 import twinstep_pb2 as pb

_RPC_TIMEOUT = 30.0  # the server asks every rank where it is, twice, before it answers

EXAMPLES = """\
examples:
  twinstep zoom demo --module layers.1.mlp.act --capture tensors --steps 3
  twinstep zoom demo --module 'layers.1.*' --steps 10 --every 2 --from-step 40
  twinstep zoom demo --module layers.1.mlp.act --bundle              # and a reproducer bundle from every run
  twinstep zoom demo --module 'layers.*.attn' --capture stats --sketch --steps 5 --token $OPERATOR_TOKEN
  twinstep zoom demo --ops layers.0.attn                            # which operation of its forward differs
  twinstep zoom demo --ops layers.1 --capture stats --from-step 40  # statistics of each operation only

The report (twinstep report SESSION) lists each zoom and the steps each candidate rank compared
with full tensors.  See docs/zoom-and-reproduce.md.
"""


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from twinstep.cli.main import _server_arg

    parser = subparsers.add_parser(
        "zoom", help="capture some modules differently (full tensors) from a step on, in every run",
        description="Change what every run of a running session captures, from one step on, the same step on "
                    "every rank: the modules matching --module (globs over the baseline's names; candidates get "
                    "their own names through the session's mapping) are captured as --capture says for --steps "
                    "steps, then as attached again. Needs the operator token when the server has tokens.",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("session")
    parser.add_argument("--module", action="append", default=[], metavar="PATTERN",
                        help="glob over the baseline's module names ('' is the whole model); repeatable")
    parser.add_argument("--ops", default="", metavar="MODULE",
                        help="also capture this module's operations (its exact baseline name) in its first call at "
                             "the first step, in every run, and compare them: the report names the first operation "
                             "that differs and its source line (with --capture tensors, the default, their values "
                             "too)")
    parser.add_argument("--capture", choices=("tensors", "lossy", "stats"), default="tensors",
                        help="what those modules send (default %(default)s; lossy is sent lossless by a run not "
                             "attached with capture='lossy')")
    parser.add_argument("--sketch", action="store_true", help="also a count-sketch of their tensors")
    parser.add_argument("--steps", type=int, default=1, metavar="N", help="steps the zoom lasts (default 1)")
    parser.add_argument("--every", type=int, default=1, metavar="N",
                        help="capture every N-th step of the window (default 1: each)")
    parser.add_argument("--from-step", type=int, metavar="K",
                        help="first step (refused if some rank is already too close to it; default: the earliest "
                             "step every rank can still apply it at)")
    parser.add_argument("--bundle", action="store_true",
                        help="every run also writes a reproducer bundle of the module (one exact name) at the first "
                             "step, into its bundle_dir")
    parser.add_argument("--reason", default="", help="said in the report")
    _server_arg(parser)
    return parser


def run(args: argparse.Namespace) -> int:
    from twinstep.cli.main import _Client

    if args.steps < 1 or args.every < 1:
        raise ValueError("--steps and --every must be at least 1")
    if not args.module and not args.ops:
        raise ValueError("which modules? give --module PATTERN (repeatable) or --ops MODULE")
    request = pb.ZoomRequest(session=args.session, modules=args.module, capture=args.capture, sketch=args.sketch,
                             steps=args.steps, every=args.every, bundle=args.bundle, reason=args.reason,
                             ops_module=args.ops)
    if args.from_step is not None:
        request.from_step = args.from_step
    with _Client(args) as client:
        response = client.stub.Zoom(request, timeout=_RPC_TIMEOUT, metadata=client.metadata)
    steps = (f"step {response.first_step}" if response.first_step == response.last_step
             else f"steps {response.first_step}-{response.last_step}")
    every = f", every {args.every}" if args.every > 1 else ""
    bundle = "; every run writes a reproducer bundle into its bundle_dir" if args.bundle else ""
    if args.ops:
        bundle += f"; every run captures the operations of {args.ops!r} (twinstep report {args.session})"
    print(f"zoom #{response.id}: {', '.join(args.module) or '(no module in full)'} in {args.capture}{' + sketch' if args.sketch else ''}, "
          f"{steps}{every}{bundle}; told: {', '.join(response.runs) or 'no run'}")
    return 0
