"""The server's allocator setting: freed tensor pieces are reused without page faults."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

# Like a server holding one step of pieces until it is compared: 40 blocks of 4 MiB
# live at once, then all freed; page faults counted over the rounds after the first.
_SCRIPT = """
import resource, sys
from twinstep.server.memory import retain_freed_memory
if sys.argv[1] == "retain":
    assert retain_freed_memory()
def one_step():
    held = [b"\\x01" * (4 << 20) for _ in range(40)]
    del held
one_step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(3):
    one_step()
print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 3)
"""


def _faults_per_step(mode: str) -> float:
    out = subprocess.run([sys.executable, "-c", _SCRIPT, mode], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return float(out.stdout.strip())


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_retained_memory_is_reused_without_page_faults() -> None:
    pages_per_step = 40 * (4 << 20) // 4096
    # By default glibc hands the blocks back and every step faults them in again...
    assert _faults_per_step("default") > 0.5 * pages_per_step
    # ...and with the server's setting the second step reuses the first one's pages.
    assert _faults_per_step("retain") < 0.02 * pages_per_step


def test_serve_has_an_opt_out() -> None:
    from twinstep.cli.main import build_parser

    from twinstep.cli.serve import resolved

    assert resolved(build_parser().parse_args(["serve", "--release-freed-memory"]), {}).config.memory.release_freed
    assert not resolved(build_parser().parse_args(["serve"]), {}).config.memory.release_freed
