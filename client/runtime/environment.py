"""What twinstep supports, what this process runs with, and a clear word when they differ.

The ranges below are the ones the test legs install and pass (``tests/envs``,
README "Supported environments"); pyproject.toml declares the same.  A library
outside its range is not refused: the training must go on, and most of
twinstep may still work.  It gets one warning at ``attach`` that names the
library, its version and the range, and the warning travels to the server in
``Hello.warnings`` so the report shows it next to the run's capture health.
"""

from __future__ import annotations

import importlib.metadata
import logging
import re
import sys
from dataclasses import dataclass

logger = logging.getLogger("twinstep")

Version = tuple[int, ...]


@dataclass(frozen=True)
class Supported:
    """A tested version range: ``low`` <= version < ``below``."""

    distribution: str
    """The installed distribution's name (pip's)."""
    low: Version
    below: Version

    def describe(self) -> str:
        return f">={_text(self.low)},<{_text(self.below)}"

    def contains(self, version: Version) -> bool:
        return self.low <= version < self.below


#: Library name as twinstep reports it -> its tested range.
SUPPORTED: dict[str, Supported] = {
    "python": Supported("python", (3, 10), (3, 14)),
    "numpy": Supported("numpy", (1, 26), (3,)),
    "torch": Supported("torch", (2, 4), (2, 14)),
    "paddle": Supported("paddlepaddle", (3, 0), (3, 4)),
    "mindspore": Supported("mindspore", (2, 7), (2, 11)),
    "grpcio": Supported("grpcio", (1, 85, 1), (2,)),
    "protobuf": Supported("protobuf", (7, 35, 1), (8,)),
    "zstandard": Supported("zstandard", (0, 22), (1,)),
    "numba": Supported("numba", (0, 60), (1,)),
}

#: What a run reports about itself, beside its framework (twinstep's own dependencies).
_REPORTED = ("numpy", "grpcio", "protobuf", "zstandard", "numba")

_warned: set[str] = set()


def parse_version(text: str) -> Version:
    """The release numbers of a version string: "2.13.0+cpu" -> (2, 13, 0), "3.0.0rc1" -> (3, 0, 0)."""
    numbers = []
    for part in text.split("+", 1)[0].split("."):
        match = re.match(r"\d+", part)
        if match is None:
            break
        numbers.append(int(match.group()))
        if match.end() < len(part):  # "0rc1": a pre-release of 0; nothing after it counts
            break
    return tuple(numbers)


def installed_version(distribution: str) -> str | None:
    """The installed version of a distribution, or None when it is not installed."""
    if distribution == "python":
        return ".".join(map(str, sys.version_info[:3]))
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def check(library: str, version: str | None = None) -> str | None:
    """A sentence when ``library`` (a key of SUPPORTED) is installed outside its tested range, else None."""
    supported = SUPPORTED[library]
    version = version if version is not None else installed_version(supported.distribution)
    if version is None:
        return None
    parsed = parse_version(version)
    if not parsed or supported.contains(parsed):
        return None
    return (f"{library} {version} is outside the range twinstep is tested with ({library}{supported.describe()}); "
            "capture may fail for some tensors, and the report will say where")


def mindspore_numpy_conflict(numpy_version: str | None = None) -> str | None:
    """A sentence when MindSpore runs with numpy 2: its 2.x wheels are built against numpy 1.x.

    Measured with MindSpore 2.10.0 and numpy 2.4.6: its first operator that parses a
    Python argument fails ("numpy.core.multiarray failed to import", then SystemError),
    whatever twinstep does; with numpy 1.26 the same training runs.
    """
    version = numpy_version if numpy_version is not None else installed_version("numpy")
    if version is None or parse_version(version) < (2,):
        return None
    return (f"MindSpore runs here with numpy {version}, but its wheels are built against numpy 1.x: its operators "
            "can fail with 'numpy.core.multiarray failed to import' (SystemError); install numpy<2 "
            "(twinstep tests MindSpore with numpy 1.26)")


def attach_warnings(framework: str, framework_version: str) -> list[str]:
    """Every library of this process outside its tested range; each logged once per process."""
    found = []
    conflict = mindspore_numpy_conflict() if framework == "mindspore" else None
    if conflict is not None:
        found.append(conflict)
        if "mindspore-numpy" not in _warned:
            _warned.add("mindspore-numpy")
            logger.warning("twinstep: %s", conflict)
    for library, version in [("python", None), *((name, None) for name in _REPORTED), (framework, framework_version)]:
        if library not in SUPPORTED:
            continue
        sentence = check(library, version)
        if sentence is None:
            continue
        found.append(sentence)
        if library not in _warned:
            _warned.add(library)
            logger.warning("twinstep: %s", sentence)
    return found


def describe_environment(framework: str, framework_version: str) -> dict[str, str]:
    """Versions a run sends in its Hello, so the report says what each side ran with."""
    from twinstep._version import __version__

    environment = {"python": installed_version("python") or "", "twinstep": __version__,
                   framework: framework_version}
    for library in _REPORTED:
        version = installed_version(SUPPORTED[library].distribution)
        if version is not None:
            environment[library] = version
    return environment


def _text(version: Version) -> str:
    return ".".join(map(str, version))
