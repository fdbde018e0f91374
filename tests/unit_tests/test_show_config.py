"""`--show-config` columns line up on a terminal also when a value or a path has wide (CJK) characters."""

from __future__ import annotations

import subprocess
import sys
import unicodedata


def _columns(line: str) -> list[int]:
    """Terminal columns where each cell after the first starts (cells are separated by two or more spaces)."""
    starts, width, gap = [], 0, 0
    for char in line:
        if char == " ":
            gap += 1
        else:
            if gap >= 2:
                starts.append(width)
            gap = 0
        width += 2 if unicodedata.east_asian_width(char) in ("W", "F") else 1
    return starts


def test_run_show_config_aligns_wide_characters(tmp_path):
    folder = tmp_path / "训练"
    folder.mkdir()
    (folder / "twinstep.yaml").write_text("session: 模型移植\nserver: 127.0.0.1:1\n")
    env = {"PATH": "/usr/bin:/bin", "TWINSTEP_CONFIG": str(folder / "twinstep.yaml")}
    out = subprocess.run([sys.executable, "-m", "twinstep", "run", "--run", "torch", "--show-config"],
                         capture_output=True, text=True, timeout=60, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    header = lines[1]
    session = next(line for line in lines if line.split()[1:2] == ["session"])
    assert session.split()[2] == "模型移植"
    assert _columns(session) == _columns(header), "\n".join([header, session])
