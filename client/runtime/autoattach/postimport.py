"""Run a function right after a module is first imported, without importing it ourselves.

``twinstep run`` must not import torch into a paddle job (or either into a
launcher), so its probes wait for the training script's own ``import torch``.
A finder on ``sys.meta_path`` finds the module as the next finders would, and
wraps its loader for the one load: after the module's code has run, the
callbacks run.  The module's ``__spec__.loader`` and ``__loader__`` are the
original loader before its code runs, so nothing inside sees the wrapper.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import logging
import sys
import threading
from types import ModuleType
from typing import Any, Callable

logger = logging.getLogger("twinstep")

_lock = threading.Lock()
_finder: "_PostImportFinder | None" = None


def when_imported(name: str, callback: Callable[[ModuleType], None]) -> None:
    """Call ``callback(module)`` once ``name`` (a top-level module) is imported; now if it already is."""
    global _finder
    module = sys.modules.get(name)
    if module is not None:
        _run(name, [callback], module)
        return
    with _lock:
        if _finder is None or _finder not in sys.meta_path:
            _finder = _PostImportFinder()
            sys.meta_path.insert(0, _finder)
        _finder.callbacks.setdefault(name, []).append(callback)


def cancel() -> None:
    """Forget every pending callback and take the finder off ``sys.meta_path``."""
    global _finder
    with _lock:
        if _finder is not None and _finder in sys.meta_path:
            sys.meta_path.remove(_finder)
        _finder = None


def _run(name: str, callbacks: list[Callable[[ModuleType], None]], module: ModuleType) -> None:
    for callback in callbacks:
        try:
            callback(module)
        except Exception as error:  # a probe that fails leaves the import, and the training, as they were
            logger.warning("twinstep: after importing %s, %s failed: %r; continuing without it", name,
                           getattr(callback, "__qualname__", callback), error)


class _PostImportFinder(importlib.abc.MetaPathFinder):
    def __init__(self) -> None:
        self.callbacks: dict[str, list[Callable[[ModuleType], None]]] = {}
        self._finding: set[str] = set()

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in self.callbacks or fullname in self._finding:
            return None
        self._finding.add(fullname)
        try:
            spec = importlib.util.find_spec(fullname)  # the other finders' answer (this one is skipped meanwhile)
        finally:
            self._finding.discard(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        with _lock:
            callbacks = self.callbacks.pop(fullname, [])
            if not self.callbacks and self in sys.meta_path:
                sys.meta_path.remove(self)
        spec.loader = _CallbackLoader(spec.loader, fullname, callbacks)
        return spec


class _CallbackLoader(importlib.abc.Loader):
    def __init__(self, loader: Any, name: str, callbacks: list[Callable[[ModuleType], None]]) -> None:
        self._loader = loader
        self._name = name
        self._callbacks = callbacks

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        if module.__spec__ is not None:
            module.__spec__.loader = self._loader
        module.__loader__ = self._loader
        self._loader.exec_module(module)
        _run(self._name, self._callbacks, sys.modules.get(self._name, module))
