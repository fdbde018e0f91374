"""Rules the folder layout promises: imports point toward the contract."""

from __future__ import annotations

import ast
from pathlib import Path

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]


def imported_modules(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
    return found


def top_level(modules: set[str]) -> set[str]:
    return {m.split(".")[0] for m in modules}


def test_capture_code_never_imports_grpc():
    for path in (ROOT / "client" / "capture").rglob("*.py"):
        assert "grpc" not in top_level(imported_modules(path)), path


def test_server_never_imports_a_framework():
    for path in (ROOT / "server").rglob("*.py"):
        mods = imported_modules(path)
        assert not top_level(mods) & {"torch", "paddle"}, path
        assert not any(m.startswith(("twinstep.capture", "twinstep.api", "twinstep.transport")) for m in mods), path


def test_each_capture_backend_imports_only_its_framework():
    for framework, other in (("torch", "paddle"), ("paddle", "torch")):
        for path in (ROOT / "client" / "capture" / framework).rglob("*.py"):
            assert other not in top_level(imported_modules(path)), path


def test_backends_share_file_names():
    torch_files = sorted(p.name for p in (ROOT / "client" / "capture" / "torch").glob("*.py"))
    paddle_files = sorted(p.name for p in (ROOT / "client" / "capture" / "paddle").glob("*.py"))
    assert torch_files == paddle_files


def test_every_package_folder_is_packaged():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    found = set()
    for package, folder in config["package-dir"].items():
        for init in (ROOT / folder).rglob("__init__.py"):
            found.add(".".join([package, *init.parent.relative_to(ROOT / folder).parts]))
    assert found == listed


def test_a_torch_job_never_imports_paddle(tmp_path):
    import subprocess
    import sys

    script = (
        "import sys, torch, twinstep\n"
        "mon = twinstep.attach(torch.nn.Linear(2, 2), session='s', run='r', server='127.0.0.1:9')\n"
        "mon.step(); mon.close(timeout=0.5)\n"
        "assert 'paddle' not in sys.modules, 'paddle was imported'\n"
        "assert 'twinstep.server' not in sys.modules\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
