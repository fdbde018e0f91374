"""The reproducer bundle file: one module's call at one step, self-described and versioned.

A bundle is a zip file (``*.twinstep-bundle.zip``) holding:

- ``bundle.json``: what it is (``format``, ``version``), where it comes from
  (session, run, role, rank, framework and its version, step, the divergent
  step it stands in for), the module (name, class, import path, training
  mode), the structure of the call's inputs and output (see
  twinstep.tools.reproduce.tree), its parameters and buffers, each array's dtype
  and shape, and ``missing``: everything the bundle could not hold;
- ``arrays/NAME.npy``: one numpy array per tensor (bfloat16 stored as exact
  float32 values, with its dtype in bundle.json);
- ``module.pkl``: the module object pickled by its framework (classes by
  import path, so replaying runs the module's current code), when it could be.

docs/zoom-and-reproduce.md documents the fields.  ``read_bundle`` checks
everything it reads and raises :class:`BundleError` saying what is wrong.
"""

from __future__ import annotations

import io
import json
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

FORMAT = "twinstep-bundle"
#: Bumped on incompatible changes: a reader refuses a bundle of a later major version.
VERSION = 1
SUFFIX = ".twinstep-bundle.zip"
_REQUIRED = ("session", "run", "baseline", "rank", "framework", "module", "step", "inputs", "output", "parameters",
             "buffers", "tensors", "missing", "training")


class BundleError(ValueError):
    """A bundle that cannot be read or used, and why."""


@dataclass
class Bundle:
    """A bundle as read: its description, its arrays (by name) and the pickled module, if any."""

    path: Path
    meta: dict[str, Any]
    arrays: dict[str, np.ndarray]
    module_pickle: bytes | None

    @property
    def dtypes(self) -> dict[str, str]:
        return {name: info["dtype"] for name, info in self.meta["tensors"].items()}

    @property
    def role(self) -> str:
        return "baseline" if self.meta["baseline"] else "reference" if self.meta.get("reference") else "candidate"

    def describe(self) -> str:
        m = self.meta
        return (f"{self.role} run {m['run']!r} rank {m['rank']} ({m['framework']} {m.get('framework_version', '')}), "
                f"{m['module'] or '(model)'!r} at step {m['step']}")


def write_bundle(path: Path, meta: dict[str, Any], arrays: dict[str, np.ndarray], module_pickle: bytes | None) -> int:
    """Write a bundle atomically (a temporary file renamed); returns its size in bytes."""
    meta = {"format": FORMAT, "version": VERSION, **meta}
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    with zipfile.ZipFile(partial, "w", compression=zipfile.ZIP_STORED) as archive:
        archive.writestr("bundle.json", json.dumps(meta, indent=1, sort_keys=True), compress_type=zipfile.ZIP_DEFLATED)
        for name, array in arrays.items():
            buffer = io.BytesIO()
            np.save(buffer, array, allow_pickle=False)
            archive.writestr(f"arrays/{name}.npy", buffer.getvalue())
        if module_pickle is not None:
            archive.writestr("module.pkl", module_pickle)
    partial.replace(path)
    return path.stat().st_size


def read_bundle(path: str | Path) -> Bundle:
    """Read and check a bundle; BundleError names the file and what is wrong."""
    path = Path(path)
    where = f"bundle {path}"
    try:
        archive = zipfile.ZipFile(path)
    except FileNotFoundError:
        raise BundleError(f"{where}: no such file") from None
    except (zipfile.BadZipFile, OSError) as exc:
        raise BundleError(f"{where}: not a twinstep bundle (not a readable zip file: {exc}); bundles are the "
                          f"*{SUFFIX} files a run writes into its bundle_dir") from None
    with archive:
        names = set(archive.namelist())
        if "bundle.json" not in names:
            raise BundleError(f"{where}: not a twinstep bundle (no bundle.json inside)")
        try:
            meta = json.loads(archive.read("bundle.json"))
        except (ValueError, zipfile.BadZipFile, OSError) as exc:
            raise BundleError(f"{where}: bundle.json cannot be read ({exc}); the file is damaged or truncated") from None
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            raise BundleError(f"{where}: bundle.json does not describe a {FORMAT}")
        version = meta.get("version")
        if not isinstance(version, int) or version > VERSION or version < 1:
            raise BundleError(f"{where}: bundle format version {version!r}; this twinstep reads versions 1 to "
                              f"{VERSION} (upgrade twinstep to read it)")
        absent = [key for key in _REQUIRED if key not in meta]
        if absent:
            raise BundleError(f"{where}: bundle.json lacks {', '.join(absent)}")
        arrays: dict[str, np.ndarray] = {}
        tensors = meta["tensors"]
        if not isinstance(tensors, dict):
            raise BundleError(f"{where}: bundle.json 'tensors' must map array names to their dtype and shape")
        for name, info in tensors.items():
            entry = f"arrays/{name}.npy"
            if entry not in names:
                raise BundleError(f"{where}: array {name!r} is listed but not stored (a truncated bundle?)")
            try:
                array = np.load(io.BytesIO(archive.read(entry)), allow_pickle=False)
            except (ValueError, OSError, zipfile.BadZipFile, EOFError) as exc:
                raise BundleError(f"{where}: array {name!r} cannot be read ({exc})") from None
            if not isinstance(info, dict) or list(array.shape) != list(info.get("shape", [])) or "dtype" not in info:
                raise BundleError(f"{where}: array {name!r} has shape {list(array.shape)}, bundle.json says "
                                  f"{info.get('shape') if isinstance(info, dict) else info!r}")
            arrays[name] = array
        module_pickle = archive.read("module.pkl") if "module.pkl" in names else None
    return Bundle(path=path, meta=meta, arrays=arrays, module_pickle=module_pickle)


def bundle_name(session: str, run: str, rank: int, step: int, module: str) -> str:
    """The file name of a bundle: every part made safe for file systems."""
    def safe(text: str) -> str:
        return "".join(c if c.isalnum() or c in "-_." else "_" for c in text)[:80] or "model"

    return f"{safe(session)}-{safe(run)}-rank{rank}-step{step}-{safe(module)}{SUFFIX}"
