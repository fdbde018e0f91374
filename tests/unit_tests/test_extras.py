"""Without the server extra (or the tls extra): what works, and what says up front which pip command it needs.

Each case runs in a fresh interpreter where the extra's packages cannot be imported (None in sys.modules),
as in an environment that has only the core dependencies.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SERVER_EXTRA = ("starlette", "uvicorn", "prometheus_client", "rich")


def _run(script: str, blocked: tuple[str, ...] = SERVER_EXTRA) -> subprocess.CompletedProcess:
    prologue = ("import sys\n"
                f"BLOCKED = {blocked!r}\n"
                "for name in BLOCKED:\n"
                "    sys.modules[name] = None  # import fails: not installed\n")
    return subprocess.run([sys.executable, "-c", prologue + script], capture_output=True, text=True, timeout=120,
                          cwd=ROOT)


def _cli(*argv: str, blocked: tuple[str, ...] = SERVER_EXTRA, tty: bool = False) -> subprocess.CompletedProcess:
    script = ""
    if tty:  # stdout reads as a terminal (watch's live view); what is printed is still captured
        script += ("import io\n"
                   "class Terminal(io.TextIOWrapper):\n"
                   "    def isatty(self): return True\n"
                   "sys.stdout = Terminal(sys.stdout.buffer, encoding='utf-8', line_buffering=True)\n")
    script += f"from twinstep.cli.main import main\nsys.exit(main({list(argv)!r}))\n"
    return _run(script, blocked)


def test_the_grpc_server_serves_with_the_core_dependencies_alone():
    out = _run(
        "import grpc\n"
        "from twinstep.server import serve\n"
        "from twinstep.v1 import twinstep_pb2 as pb, twinstep_pb2_grpc as pb_grpc\n"
        "handle = serve(port=0)\n"
        "with grpc.insecure_channel(handle.address) as channel:\n"
        "    listing = pb_grpc.TwinstepStub(channel).ListSessions(pb.ListSessionsRequest(), timeout=30)\n"
        "handle.stop(grace=0.5)\n"
        "print('sessions', len(listing.sessions))\n")
    assert out.returncode == 0, out.stderr
    assert "sessions 0" in out.stdout


@pytest.mark.parametrize("argv", [["serve", "--port", "0", "--http-port", "0"],
                                  ["demo", "--steps", "1", "--http-port", "0"]])
def test_the_dashboard_without_the_server_extra_names_the_pip_command(argv):
    out = _cli(*argv)
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert "Traceback" not in out.stderr
    assert (f"twinstep {argv[0]}: the dashboard and /metrics (--http-port) needs starlette, uvicorn, "
            "prometheus_client, which the server extra installs: pip install 'twinstep[server]'") in out.stderr
    assert "listening" not in out.stdout and "server on" not in out.stdout  # nothing was started


def test_watch_s_live_view_without_rich_names_the_pip_command_and_plain_needs_nothing_more():
    out = _cli("watch", "s", "--server", "127.0.0.1:9", tty=True)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert ("twinstep watch: twinstep watch's live view needs rich, which the server extra installs: "
            "pip install 'twinstep[server]' (or --plain: one line per event)") in out.stderr
    plain = _cli("watch", "s", "--server", "127.0.0.1:9", "--plain", tty=True)
    assert plain.returncode == 2 and "UNAVAILABLE" in plain.stderr and "twinstep[server]" not in plain.stderr


def test_self_signed_without_cryptography_names_the_pip_command(tmp_path):
    out = _cli("serve", "--port", "0", "--self-signed", str(tmp_path / "tls"), blocked=("cryptography",))
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert "--self-signed needs the cryptography package: pip install 'twinstep[tls]'" in out.stderr
    assert not (tmp_path / "tls").exists()
