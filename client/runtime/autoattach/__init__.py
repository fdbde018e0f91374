"""Zero-code attach: ``twinstep run`` instruments a training script that never calls twinstep.

``twinstep run`` puts ``bootstrap/`` first on ``PYTHONPATH`` and sets
``TWINSTEP_AUTO_ATTACH=1``; its ``sitecustomize.py`` runs at the start of
every Python process of the job (torchrun's and paddle.distributed.launch's
workers too) and calls :func:`install`.  That only arms import hooks: when
the script imports torch or paddle, that framework's probe
(``autoattach/torch.py``, ``autoattach/paddle.py``) is installed, and the
installer (``installer.py``) finds the model and the optimizer step and calls
``twinstep.attach`` with the settings of the environment and config file
(twinstep.runtime.settings).  A process that never imports a framework pays for one
small import and nothing else.
"""

from __future__ import annotations

import logging
import os
import sys
from types import ModuleType
from typing import Any

from twinstep.runtime.autoattach import postimport

__all__ = ["BOOTSTRAP_DIR", "ENV_ACTIVE", "install", "installed_probes", "uninstall"]

logger = logging.getLogger("twinstep")

#: Set to 1 by ``twinstep run``: the bootstrap installs the probes only then.
ENV_ACTIVE = "TWINSTEP_AUTO_ATTACH"
#: The folder ``twinstep run`` puts first on PYTHONPATH (it holds ``sitecustomize.py``).
BOOTSTRAP_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bootstrap")

_probes: list[Any] = []
_previous_excepthook: Any = None


def install() -> None:
    """Arm the probes: each is installed when its framework is first imported (now, if it already is)."""
    postimport.when_imported("torch", _install_probe)
    postimport.when_imported("paddle", _install_probe)
    _install_excepthook()


def installed_probes() -> list[Any]:
    """The probes installed so far (one per framework imported)."""
    return list(_probes)


def uninstall() -> None:
    """Remove every probe and pending import hook; a monitor already attached is closed."""
    postimport.cancel()
    while _probes:
        _probes.pop().installer.remove()


def _install_probe(module: ModuleType) -> None:
    if module.__name__ == "torch":
        from twinstep.runtime.autoattach.torch import TorchProbe as probe_type
    else:
        from twinstep.runtime.autoattach.paddle import PaddleProbe as probe_type
    _probes.append(probe_type())


def _install_excepthook() -> None:
    """``twinstep.Halted`` left uncaught (the script does not know twinstep) ends the process with one line."""
    global _previous_excepthook
    if _previous_excepthook is not None:
        return
    _previous_excepthook = sys.excepthook

    def excepthook(kind: type[BaseException], error: BaseException, traceback: Any) -> None:
        errors = sys.modules.get("twinstep.errors")
        if errors is not None and isinstance(error, errors.Halted):
            print(f"twinstep: the server halted this run at step {error.step}: {error.reason}", file=sys.stderr,
                  flush=True)
            return
        _previous_excepthook(kind, error, traceback)

    sys.excepthook = excepthook
