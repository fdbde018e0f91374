"""The committed protobuf modules are what proto/ generates."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_generated_protobuf_modules_are_current():
    out = subprocess.run([sys.executable, "scripts/gen_proto.py", "--check"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, f"run `python scripts/gen_proto.py` and commit the result:\n{out.stderr}"


def test_check_notices_a_stale_module(tmp_path, monkeypatch):
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import gen_proto
    finally:
        sys.path.pop(0)
    copy = tmp_path / "proto"
    subprocess.run(["cp", "-r", str(ROOT / "proto"), str(copy)], check=True)
    stale = copy / "twinstep" / "v1" / "twinstep_pb2.py"
    stale.write_text(stale.read_text() + "\n# edited by hand\n")
    monkeypatch.setattr(gen_proto, "PROTO_ROOT", copy)
    assert gen_proto.stale_files() == ["twinstep/v1/twinstep_pb2.py"]
