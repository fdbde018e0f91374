"""Whether this environment can run MindSpore, for the test modules that need it.

MindSpore 2.x wheels are built against numpy 1.x (2.10 fails its first scalar operation under numpy 2),
so the tests run in the legs with numpy 1.x (tests/envs: paddleformers, oldest) and skip elsewhere, saying why.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest


def why_not() -> str | None:
    """None when MindSpore can run here, else the reason in words."""
    if importlib.util.find_spec("mindspore") is None:
        return "MindSpore is not installed in this environment"
    if int(np.__version__.split(".")[0]) >= 2:
        return f"MindSpore's wheels are built against numpy 1.x; this environment has numpy {np.__version__}"
    return None


def skip_module_without_mindspore() -> None:
    """Skip the calling test module (at import) where MindSpore cannot run."""
    reason = why_not()
    if reason is not None:
        pytest.skip(reason, allow_module_level=True)
