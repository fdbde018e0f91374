"""Command line and training loop shared by torch_job and paddle_job.

The two jobs must differ only in the framework (and an injected --bug), so the
arguments, the step loop, the twinstep calls and the result file are defined once
here. The loop is the one of client/tools/demo/job.py: forward + loss + backward +
optimizer step inside ``trainer.train_step``, then ``mon.step(loss=loss)`` before the
gradients are cleared, and ``twinstep.Halted`` ends the run cleanly.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any, Protocol

from . import models


class Trainer(Protocol):
    """What a framework job provides to the shared loop."""

    model: Any  # the module/layer handed to twinstep.attach

    def batch(self, step: int) -> tuple[Any, Any]: ...
    def train_step(self, ids: Any, tgt: Any) -> Any: ...
    def zero_grad(self) -> None: ...


class _NoMonitor:
    """Stands in for the twinstep monitor when the job trains on its own (--no-monitor)."""

    def step(self, loss: Any) -> None:
        pass

    def close(self) -> None:
        pass


def parser(prog: str, description: str, framework: str) -> argparse.ArgumentParser:
    """The CLI of client/tools/demo/job.py (minus --framework), plus --model and --weights."""
    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument("--model", choices=models.MODEL_NAMES, required=True)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--session", default=os.environ.get("TWINSTEP_SESSION", "ports"))
    p.add_argument("--run", default=framework, help=f"run name (default: {framework})")
    p.add_argument("--baseline", action="store_true", help="this run is the one the others are judged against")
    p.add_argument("--reference", action="store_true", help="a rerun of the baseline that measures its own noise")
    p.add_argument("--server", default=os.environ.get("TWINSTEP_SERVER"))
    p.add_argument("--capture", choices=("stats", "tensors", "lossy"), default="stats")
    p.add_argument("--sketch", action="store_true", help="also send a count-sketch of every floating tensor")
    p.add_argument("--no-monitor", action="store_true", help="train without twinstep")
    p.add_argument("--step-delay", type=float, default=0.0, metavar="SECONDS",
                   help="sleep per step (simulate a slow job)")
    p.add_argument("--lockstep", type=int, default=0, metavar="N",
                   help="wait while this run leads the other by N steps (0: never wait)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--wait-for-runs", type=int, default=0, metavar="N",
                   help="baseline: attach only once N other runs have joined the session (candidates that join "
                        "after the baseline's steps went by find them released: docs/three-way.md)")
    p.add_argument("--result-file", default=None, metavar="PATH", help="write a JSON summary here at exit")
    p.add_argument("--weights", required=True, metavar="PATH",
                   help="initial weights (.npz, torch names and layouts): written by the torch job, read by the paddle job")
    p.add_argument("--share-weights", action="store_true",
                   help="baseline: share the initial weights through twinstep (attach(share_weights=True))")
    p.add_argument("--init-from-baseline", action="store_true",
                   help="candidate: start from its own random weights and load the baseline's through twinstep "
                        "(attach(init_from_baseline=True)) instead of reading --weights")
    p.add_argument("--embed-std", type=float, default=None, metavar="STD",
                   help="std of the initial embedding table (default 0.02; models.unit_embed_std gives a residual "
                        "stream of order 1). Applied where the weights are made (torch job); a paddle job reads "
                        "them from --weights, so it ignores the flag")
    p.add_argument("--warmup", type=int, default=0, metavar="N",
                   help="linear learning-rate warmup over N steps (models.warmup_factor); give both jobs the same N "
                        "(default 0: a constant learning rate)")
    return p


def wait_for_runs(server: str, session: str, runs: int, timeout: float = 600.0) -> None:
    """Poll the server's report until ``runs`` runs have joined ``session`` (the test bed's several candidates)."""
    import grpc

    from twinstep.v1 import twinstep_pb2 as pb
    from twinstep.v1 import twinstep_pb2_grpc as pb_grpc

    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(server) as channel:
        stub = pb_grpc.TwinstepStub(channel)
        while True:
            try:
                if len(stub.GetReport(pb.ReportRequest(session=session), timeout=10).runs) >= runs:
                    return
            except grpc.RpcError:
                pass  # no such session yet
            if time.monotonic() > deadline:
                raise SystemExit(f"{runs} run(s) did not join session {session!r} within {timeout:.0f}s")
            time.sleep(0.2)


def run(args: argparse.Namespace, trainer: Trainer, extra: dict[str, Any] | None = None) -> int:
    """Train args.steps steps, optionally under twinstep; write args.result_file at the end."""
    prefix = f"[{args.run}]"
    if args.no_monitor:
        mon: Any = _NoMonitor()
        halted_type: Any = ()  # an empty tuple in `except` catches nothing
    else:
        import twinstep

        if args.wait_for_runs:
            wait_for_runs(args.server, args.session, args.wait_for_runs)
        mon = twinstep.attach(
            trainer.model, session=args.session, run=args.run, baseline=args.baseline, reference=args.reference,
            server=args.server, capture=args.capture, sketch=args.sketch, lockstep=args.lockstep,
            share_weights=args.share_weights or None, init_from_baseline=args.init_from_baseline or None,
            # A MindSpore trainer hands twinstep its optimizer, where its gradients are captured.
            # Every trainer's optimizer: its set-up is diffed before step 0 (preflight, docs/preflight.md).
            **{"optimizer": getattr(trainer, "opt", None),
               **(trainer.attach_options() if hasattr(trainer, "attach_options") else {})},
        )
        halted_type = twinstep.Halted

    losses: list[float] = []
    halted, halt_reason, halt_step = False, None, None
    try:
        for step in range(args.steps):
            ids, tgt = trainer.batch(step)
            loss = trainer.train_step(ids, tgt)
            losses.append(float(loss.item()))
            print(f"{prefix} step {step} loss {losses[-1]:.6f}", flush=True)
            mon.step(loss=loss)
            trainer.zero_grad()
            if args.step_delay > 0:
                time.sleep(args.step_delay)
    except halted_type as h:
        halted, halt_reason, halt_step = True, h.reason, h.step
        print(f"{prefix} halted at step {h.step}: {h.reason}", flush=True)
    finally:
        mon.close()
        if args.result_file:
            result = {
                "model": args.model,
                "steps_completed": len(losses),  # optimizer steps taken, including a step whose report halted
                "halted": halted,
                "halt_reason": halt_reason,
                "halt_step": halt_step,
                "losses": losses,
                "rank": 0,
                **(extra or {}),
            }
            with open(args.result_file, "w") as f:
                json.dump(result, f)
    return 0
