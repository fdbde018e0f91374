"""twinstep's lines in a training's log: its own words and format, once each, whatever the framework did to logging.

Each case runs in a fresh process (logging's set-up is per process): paddle installs a handler of its own on
the root logger when it is imported, which rewrote twinstep's lines and showed its informational ones.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from tests.conftest import ROOT

_SCRIPT = """
import logging
{imports}
from twinstep.runtime import logs

logs.install()  # what attach does
log = logging.getLogger("twinstep")
log.info("twinstep: run 'r' rank 0: zoom #1 from the server: full tensors of fc1 at step 12, asked by an operator")
log.warning("twinstep: a warning")
log.debug("twinstep: a debugging line")
logging.getLogger("twinstep.server").info("session s: an embedded server's information")
logging.getLogger("twinstep.server").warning("session s: an embedded server's warning")
logging.getLogger("someone.else").warning("someone else's warning")
"""


def _stderr(imports: str) -> list[str]:
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(_SCRIPT.format(imports=imports))], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return [line for line in done.stderr.splitlines() if "twinstep" in line or "someone" in line or "session" in line]


def test_with_paddle_imported_twinstep_lines_keep_their_format_and_show_once():
    pytest.importorskip("paddle")
    lines = _stderr("import paddle")
    ours = [line for line in lines if "twinstep:" in line]
    assert ours == ["twinstep: run 'r' rank 0: zoom #1 from the server: full tensors of fc1 at step 12, asked by an "
                    "operator", "twinstep: a warning"], lines
    # Everything else still goes where it went: paddle's root handler formats the others' lines its own way.
    others = [line for line in lines if "twinstep:" not in line]
    assert len(others) == 3 and all(line.startswith("[") for line in others), others
    assert any(line.endswith("session s: an embedded server's information") for line in others), others


def test_without_a_root_handler_informational_lines_show_and_an_embedded_servers_warnings_still_do():
    lines = _stderr("import torch")
    assert lines == ["twinstep: run 'r' rank 0: zoom #1 from the server: full tensors of fc1 at step 12, asked by an "
                     "operator", "twinstep: a warning", "session s: an embedded server's warning",
                     "someone else's warning"], lines
