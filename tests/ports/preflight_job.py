"""Attach many port set-ups in one process, without training: the preflight corpus at the cost of one import.

    python -m tests.ports.preflight_job --framework paddle --server HOST:PORT --case phi3:lr --case ernie4_5:none

Each ``--case MODEL:BUG`` builds that model and its AdamW (tests/ports: torch_job's baseline,
paddle_job's or mindspore_job's port with BUG), attaches it to session ``preflight-MODEL-BUG`` as
run FRAMEWORK with the optimizer and closes again: the server receives its set-up
(docs/preflight.md) and nothing else.  The torch side ignores BUG (the baseline has none); the
MindSpore port loads its own random weights (the set-up does not depend on them).  Imports one
framework only, as the other jobs.
"""

from __future__ import annotations

import argparse
import sys

from . import models


def session_name(model: str, bug: str) -> str:
    return f"preflight-{model}-{bug}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.ports.preflight_job", description=__doc__.splitlines()[0])
    p.add_argument("--framework", choices=("torch", "paddle", "mindspore"), required=True)
    p.add_argument("--server", required=True)
    p.add_argument("--case", action="append", default=[], metavar="MODEL:BUG")
    args = p.parse_args(argv)
    import twinstep

    for case in args.case:
        model, bug = case.split(":")
        spec = models.spec(model)
        if args.framework == "torch":
            from .torch_job import TorchPort

            trainer = TorchPort(spec, seed=0)
        elif args.framework == "paddle":
            from .paddle_job import PaddlePort

            trainer = PaddlePort(spec, 0, None, bug)
        else:
            from .mindspore_job import MindSporePort

            trainer = MindSporePort(0, _mindspore_weights(), bug)
        monitor = twinstep.attach(trainer.model, session=session_name(model, bug), run=args.framework,
                                  baseline=args.framework == "torch", server=args.server, optimizer=trainer.opt)
        monitor.close()
    return 0


def _mindspore_weights() -> dict:
    """A freshly initialised port's weights under torch's names, as mindspore_job loads them."""
    from . import mindspore_phi3

    torch_names = {port: torch for torch, port in mindspore_phi3.RENAMED.items()}
    return {torch_names.get(name, name): p.asnumpy()
            for name, p in mindspore_phi3.Phi3ForCausalLM().parameters_and_names()}


if __name__ == "__main__":
    sys.exit(main())
