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
    for path in (ROOT / "client" / "runtime" / "capture").rglob("*.py"):
        assert "grpc" not in top_level(imported_modules(path)), path


def test_server_never_imports_a_framework():
    for path in (ROOT / "server").rglob("*.py"):
        mods = imported_modules(path)
        assert not top_level(mods) & {"torch", "paddle"}, path
        assert not any(m.startswith(("twinstep.runtime", "twinstep.cli", "twinstep.tools")) for m in mods), path


def test_each_capture_backend_imports_only_its_framework():
    for framework, other in (("torch", "paddle"), ("paddle", "torch")):
        for path in (ROOT / "client" / "runtime" / "capture" / framework).rglob("*.py"):
            assert other not in top_level(imported_modules(path)), path


def test_backends_share_file_names():
    torch_files = sorted(p.name for p in (ROOT / "client" / "runtime" / "capture" / "torch").glob("*.py"))
    paddle_files = sorted(p.name for p in (ROOT / "client" / "runtime" / "capture" / "paddle").glob("*.py"))
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


#: The server extra (pip install 'twinstep[server]'): the dashboard, /metrics and `twinstep watch`'s live view.
SERVER_EXTRA = ("starlette", "uvicorn", "prometheus_client", "rich")


def test_a_training_job_never_imports_the_server_extra(tmp_path):
    """A training job runs without the server extra installed: attach, steps and close load none of it."""
    import subprocess
    import sys

    script = (
        "import sys, torch, twinstep\n"
        "mon = twinstep.attach(torch.nn.Linear(2, 2), session='s', run='r', server='127.0.0.1:9')\n"
        "mon.step(); mon.close(timeout=0.5)\n"
        f"loaded = sorted(m for m in sys.modules if m.split('.')[0] in {SERVER_EXTRA!r})\n"
        "assert not loaded, loaded\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr


def test_the_server_extra_is_not_a_core_dependency():
    import re

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]

    def names(specs: list[str]) -> set[str]:
        return {re.split(r"[<>=!~;\[ ]", spec)[0].replace("-", "_").lower() for spec in specs}

    extras = project["optional-dependencies"]
    assert not names(project["dependencies"]) & set(SERVER_EXTRA)
    # And cryptography, for `twinstep serve --self-signed` (also the tls extra alone): the README installs this extra.
    assert names(extras["server"]) == set(SERVER_EXTRA) | {"cryptography"}
    assert not names(project["dependencies"]) & {"cryptography"}
    # The test legs install the test extra's own names, not the extras inside "twinstep[...]" (tests/envs/build.sh).
    assert names(extras["test"]) >= set(SERVER_EXTRA)


# -- the server stands apart from the training side --------------------------------------------

#: Client modules the server may use: the contract and framework-neutral definitions, nothing that
#: runs on the training side (api, capture, transport, kernels, cli, demo, inprocess).
SHARED = {"twinstep", "twinstep._version", "twinstep.wire", "twinstep.wire.phases", "twinstep.wire.codec",
          "twinstep.wire.stats", "twinstep.wire.sketch", "twinstep.wire.layouts", "twinstep.wire.netrules",
          "twinstep.wire.weight_pieces",  # weight sync's pieces: both ends cut and assemble them alike
          "twinstep.wire.inputs",  # which argument is a call's input: the hooks and the dump reader alike
          "twinstep.wire.progress",  # how far behind a run is: the dashboard and `twinstep watch` alike
          # One retry helper (backoff with jitter, a deadline, a stop) for the runtime's gRPC calls and the
          # server's webhooks: standard library only, and no part of the wire contract, so not in twinstep.wire.
          "twinstep._retry",
          # The machinery of settings declared as typed dataclass fields, under both attach's settings and the
          # server's (declaration, readers, where each value came from): standard library only, no wire contract.
          "twinstep._settings"}
TRAINING_SIDE = ("twinstep.runtime", "twinstep.cli", "twinstep.tools")


def _module_files() -> dict[str, Path]:
    """Every twinstep module name -> its file, from pyproject's package folders."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    files = {}
    for package, folder in config["package-dir"].items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            name = ".".join([package, *parts])
            files[name.removesuffix(".__init__")] = path
    return files


def _import_time_imports(path: Path) -> set[str]:
    """Modules imported when ``path`` is imported: module-level statements (a function's imports run later)."""
    found: set[str] = set()

    def visit(nodes) -> None:
        for node in nodes:
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module:
                found.add(node.module)
                found.update(f"{node.module}.{alias.name}" for alias in node.names)
            elif isinstance(node, ast.If) and not (isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"):
                visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body)
                for handler in node.handlers:
                    visit(handler.body)

    visit(ast.parse(path.read_text()).body)
    return found


def test_server_modules_import_only_the_server_the_contract_and_shared_definitions():
    """Transitively, at import time: what `import twinstep.server` can load, read from the source."""
    files = _module_files()
    start = [name for name in files if name.startswith("twinstep.server")]
    seen, stack = set(start), list(start)
    while stack:
        for imported in _import_time_imports(files[stack.pop()]):
            if imported in files and imported not in seen:  # a submodule, or a name imported from a package
                seen.add(imported)
                stack.append(imported)
                parent = imported.rsplit(".", 1)[0]
                while parent and parent not in seen and parent in files:  # importing a.b.c imports a and a.b
                    seen.add(parent)
                    stack.append(parent)
                    parent = parent.rsplit(".", 1)[0] if "." in parent else ""
    outside = {m for m in seen if not m.startswith(("twinstep.server", "twinstep.v1")) and m not in SHARED}
    assert not outside, f"the server reaches client modules: {sorted(outside)}"


def test_importing_the_server_loads_no_training_side_module():
    """In a fresh interpreter, by what lands in sys.modules."""
    import subprocess
    import sys

    script = ("import sys, twinstep.server\n"
              "print('\\n'.join(sorted(sys.modules)))\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    loaded = set(out.stdout.split())
    assert not {m for m in loaded if m.startswith(TRAINING_SIDE)}, sorted(m for m in loaded if m.startswith(TRAINING_SIDE))
    assert not loaded & {"torch", "paddle", "numba"}


def test_the_client_package_loads_its_runtime_only_when_asked():
    import subprocess
    import sys

    script = ("import sys, twinstep\n"
              "assert 'twinstep.runtime.api' not in sys.modules\n"
              "twinstep.attach\n"
              "assert 'twinstep.runtime.api' in sys.modules\n"
              "assert twinstep.Halted.__module__ == 'twinstep.errors'\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr


def test_the_wire_definitions_stand_alone():
    """Both sides load twinstep.wire: at import time it needs no framework, no gRPC and no runtime module."""
    for path in (ROOT / "client" / "wire").rglob("*.py"):
        mods = _import_time_imports(path)
        assert not top_level(mods) & {"torch", "paddle", "mindspore", "grpc", "numba"}, path
        assert not any(m.startswith(("twinstep.runtime", "twinstep.cli", "twinstep.tools", "twinstep.server"))
                       for m in mods), path


def test_one_module_owns_the_phase_vocabulary():
    """No list, tuple or set of (most of) the phase names outside twinstep.wire.phases.

    Tables keyed by phase (tolerances per phase) are configuration, not vocabulary, and may name them.
    """
    names = {"forward", "loss", "backward", "grad", "param", "input"}
    owner = ROOT / "client" / "wire" / "phases.py"
    offenders = []
    for folder in ("client", "server"):
        for path in (ROOT / folder).rglob("*.py"):
            if path == owner:
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if not isinstance(node, (ast.Tuple, ast.List, ast.Set)):
                    continue
                values = {e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)}
                if len(values & names) >= 4:
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not offenders, offenders
