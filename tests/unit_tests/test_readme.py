"""README.md and the reference pages stay true: the config example loads, the commands and benchmarks exist."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from twinstep.server.config import load_config

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
SERVER_PAGE = (ROOT / "docs" / "server.md").read_text()
PERFORMANCE_PAGE = (ROOT / "docs" / "performance.md").read_text()


def test_config_example_loads(tmp_path, caplog):
    """docs/server.md's config file loads, in the current spelling (no warning about older keys)."""
    block = re.search(r"```yaml\n(halt:.*?)```", SERVER_PAGE, re.S).group(1)
    path = tmp_path / "server.yaml"
    path.write_text(block)
    with caplog.at_level("WARNING"):
        config = load_config(path)
    # Only the loader's own warnings count: a server thread left by an earlier test may still log.
    loader = [r for r in caplog.records if r.levelname == "WARNING" and r.module in ("_settings", "config")]
    assert not loader, caplog.text
    assert config.halt.on_divergence is True
    assert config.mapping.to_baseline("decoder.final_layernorm.weight") == "norm.weight"
    assert config.mapping.to_baseline("model.decoder.layers.3.mlp") == "layers.3.mlp"
    assert config.tolerances.for_record("forward", "layers.1.mlp.act", "float32")["mean"] == 1e-4
    assert config.journal.directory == str(tmp_path / "journal") and config.sessions.ttl == 3600 and config.sessions.resume_grace == 120


def test_ci_runs_the_readme_test_command():
    command = re.search(r"Run the tests:\n\n```bash\n(.*?)\n```", README).group(1)
    assert command in (ROOT / ".ci" / "run").read_text().splitlines()


def test_documented_subcommands_exist():
    for sub in ("serve", "watch", "report", "halt", "demo", "sessions", "mapping"):
        assert f"twinstep {sub}" in README
        out = subprocess.run([sys.executable, "-m", "twinstep", sub, "--help"], capture_output=True, text=True)
        assert out.returncode == 0, out.stderr


def test_documented_benchmarks_exist():
    scripts = set(re.findall(r"python (benchmarks/\w+\.py)", PERFORMANCE_PAGE))
    assert len(scripts) >= 7, scripts
    for script in scripts:
        assert (ROOT / script).is_file(), script


def test_readme_is_a_front_door():
    """What a newcomer needs on one page; the reference lives in docs/."""
    assert len(README.splitlines()) <= 250, "README.md grew past 250 lines: move the detail to a page in docs/"


def test_relative_links_resolve():
    """Every relative Markdown link of README.md, ARCHITECTURE.md and docs/ names a file that exists."""
    pages = [ROOT / "README.md", ROOT / "ARCHITECTURE.md", *sorted((ROOT / "docs").glob("*.md"))]
    broken = []
    for page in pages:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" in target or target.startswith("mailto:"):
                continue
            if not (page.parent / target).exists():
                broken.append(f"{page.relative_to(ROOT)} -> {target}")
    assert not broken, broken


def test_readme_command_lines_parse():
    """Every `twinstep ...` line of README.md's bash blocks parses with the real argument parser (as docs/ pages' do)."""
    from tests.cli_lines import parse_command_line, twinstep_lines

    lines = [line for lang, body in re.findall(r"^```(\w*)[^\n]*\n(.*?)^```", README, re.M | re.S) if lang == "bash"
             for line in twinstep_lines(body)]
    assert len(lines) >= 3, lines
    for line in lines:
        parse_command_line(line)


def _requirements(extras: dict[str, list[str]], names: list[str]) -> set[str]:
    """The distributions the extras ``names`` bring, through extras naming twinstep's own."""
    found: set[str] = set()
    for name in names:
        for spec in extras[name]:
            inner = re.fullmatch(r"twinstep\[([\w,]+)\]", spec)
            if inner:
                found |= _requirements(extras, inner.group(1).split(","))
            else:
                found.add(re.match(r"[A-Za-z0-9_.-]+", spec).group().lower())
    return found


def test_the_readme_install_brings_what_its_commands_need():
    """The README's install line brings cryptography (`twinstep serve --self-signed`), and the mindspore
    extra a numpy MindSpore 2.x runs with (its wheels are built against numpy 1.x)."""
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    install = re.search(r'```bash\npip install -e "\.\[([\w,]+)\]"\n```', README).group(1).split(",")
    assert "cryptography" in _requirements(extras, install), install
    assert any(re.fullmatch(r"numpy(>=[\d.]+,)?<2", spec.replace(" ", "")) for spec in extras["mindspore"]), \
        extras["mindspore"]
