"""README.md stays true: its config example loads, its commands exist."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from twinstep.server.config import load_config

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def test_config_example_loads(tmp_path):
    block = re.search(r"```yaml\n(halt_on_divergence.*?)```", README, re.S).group(1)
    path = tmp_path / "server.yaml"
    path.write_text(block)
    config = load_config(path)
    assert config.halt_on_divergence is True
    assert config.mapping.to_baseline("decoder.final_layernorm.weight") == "norm.weight"
    assert config.mapping.to_baseline("model.decoder.layers.3.mlp") == "layers.3.mlp"
    assert config.tolerances.for_record("forward", "layers.1.mlp.act", "float32")["mean"] == 1e-4
    assert config.journal == str(tmp_path / "journal") and config.session_ttl == 3600 and config.resume_grace == 120


def test_ci_runs_the_readme_test_command():
    command = re.search(r"Run the tests:\n\n```bash\n(.*?)\n```", README).group(1)
    assert command in (ROOT / ".ci" / "run").read_text().splitlines()


def test_documented_subcommands_exist():
    for sub in ("serve", "watch", "report", "halt", "demo", "sessions", "mapping"):
        assert f"twinstep {sub}" in README
        out = subprocess.run([sys.executable, "-m", "twinstep", sub, "--help"], capture_output=True, text=True)
        assert out.returncode == 0, out.stderr


def test_documented_benchmarks_exist():
    scripts = set(re.findall(r"python (benchmarks/\w+\.py)", README))
    assert len(scripts) >= 7, scripts
    for script in scripts:
        assert (ROOT / script).is_file(), script
