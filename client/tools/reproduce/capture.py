"""Capturing a reproducer bundle in a training process: one module's first call at one step.

Armed by the monitor at the start of the step a zoom names (``bundle_module``):
a forward pre-hook copies the call's inputs (positional and keyword), the
module's parameters and buffers and its training mode; a post-hook copies
its output.  Copies are made in the hooks, on the training thread (the
values must be those of that call); pickling the module and writing the file
happen on a background thread.  The module's later calls in the step are
counted, not stored.  Nothing here raises into training: a failure is logged
once and the bundle says what it lacks.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from pathlib import Path
from typing import Any

from twinstep._version import __version__
from twinstep.tools.reproduce.bundle import bundle_name, write_bundle
from twinstep.tools.reproduce.frameworks import framework as framework_named
from twinstep.tools.reproduce.tree import Flattener
from twinstep.v1 import twinstep_pb2 as pb

logger = logging.getLogger("twinstep")

#: Parameters and buffers stored at most (bytes); past it they are left out (and listed as missing).
DEFAULT_MAX_STATE_BYTES = 1 << 30


class BundleCapture:
    """One bundle: hooks on one module for one step, then a file written off the training thread."""

    def __init__(self, framework: str, module: Any, spec: pb.ZoomSpec, step: int, about: dict[str, Any],
                 directory: Path, max_state_bytes: int = DEFAULT_MAX_STATE_BYTES) -> None:
        self.spec = spec
        self.step = step
        self.about = about
        self.directory = directory
        self.max_state_bytes = max_state_bytes
        self.path: Path | None = None
        self.size = 0
        self._framework = framework_named(framework)
        self._module = module
        self._flat = Flattener(self._framework)
        self._meta: dict[str, Any] = {}
        self._calls = 0
        self._output_done = False
        self._handles: list[Any] = []
        self._keywords = True
        self._failure: str | None = None
        self.writer: threading.Thread | None = None

    def arm(self) -> None:
        if self._module is None:
            return
        try:
            self._handles, self._keywords = self._framework.add_hooks(self._module, self._before, self._after)
        except Exception as error:  # noqa: BLE001 - a bundle must never break the training
            self._failure = f"its hooks could not be installed ({type(error).__name__}: {error})"

    def _before(self, args: tuple, kwargs: dict) -> None:
        self._calls += 1
        if self._calls > 1:
            return
        try:
            self._meta["inputs"] = {"args": self._flat.flatten(tuple(args), "input", "args"),
                                    "kwargs": self._flat.flatten(dict(kwargs), "input", "kwargs")}
            self._meta["training"] = bool(getattr(self._module, "training", False))
            self._copy_state()
        except Exception as error:  # noqa: BLE001
            self._failure = f"its inputs could not be copied ({type(error).__name__}: {error})"

    def _copy_state(self) -> None:
        parameters, buffers = self._framework.named_state(self._module)
        size = sum(_nbytes(t) for _, t in parameters + buffers)
        self._meta["parameters"], self._meta["buffers"] = {}, {}
        if size > self.max_state_bytes:
            self._flat.missing.append(f"parameters and buffers: {size} bytes, over the bundle's bound of "
                                      f"{self.max_state_bytes} (they are the module's as trained: load them from a "
                                      "checkpoint)")
            return
        types = {name: type(module).__name__ for name, module in self._framework.submodules(self._module)}
        self._meta["parameter_types"] = {name: types.get(name.rsplit(".", 1)[0] if "." in name else "", "")
                                         for name, _ in parameters}
        for kind, pairs in (("parameters", parameters), ("buffers", buffers)):
            for name, tensor in pairs:
                array, dtype = self._framework.to_numpy(tensor)
                key = f"{kind[:-1]}.{name}"
                self._flat.arrays[key] = array
                self._flat.dtypes[key] = dtype
                self._meta[kind][name] = key

    def _after(self, output: Any) -> None:
        if self._output_done:
            return
        self._output_done = True
        try:
            self._meta["output"] = self._flat.flatten(output, "output", "output")
        except Exception as error:  # noqa: BLE001
            self._failure = self._failure or f"its output could not be copied ({type(error).__name__}: {error})"

    def finish(self) -> None:
        """The step ended: remove the hooks and write the bundle on a background thread."""
        for handle in self._handles:
            try:
                handle.remove()
            except Exception:  # noqa: BLE001
                pass
        self._handles = []
        self.writer = threading.Thread(target=self._write, name="twinstep-bundle", daemon=True)
        self.writer.start()

    def _write(self) -> None:
        spec = self.spec
        missing = list(self._flat.missing)
        if self._module is None:
            missing.append(f"everything: this run has no module {spec.bundle_module!r} (attach hooks the model's "
                           "own names)")
        elif self._failure:
            missing.append(f"part of the call: {self._failure}")
        elif self._calls == 0:
            missing.append(f"the call: the module was not called at step {self.step}")
        if self._calls > 1:
            missing.append(f"calls 2 to {self._calls} of the step (the first call is stored)")
        if not self._keywords:
            missing.append("keyword arguments (this paddle's hooks do not pass them)")
        if spec.divergent_step >= 0 and spec.divergent_step != self.step:
            missing.append(f"step {spec.divergent_step} itself, where the divergence was found: the runs had moved "
                           f"on when it was declared, so this bundle holds step {self.step}")
        module_pickle = None
        if self._module is not None:
            try:
                module_pickle = self._framework.pickle_module(self._module)
            except Exception as error:  # noqa: BLE001
                missing.append(f"the module object: it cannot be pickled ({type(error).__name__}: {error}); "
                               "replay it with --baseline-factory/--candidate-factory")
        meta = {
            **self.about,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "twinstep": __version__,
            "framework": self._framework.name,
            "framework_version": self._framework.version(),
            "module": spec.bundle_module,
            "module_type": type(self._module).__name__ if self._module is not None else "",
            "module_class": (f"{type(self._module).__module__}.{type(self._module).__qualname__}"
                             if self._module is not None else ""),
            "step": self.step,
            "divergent_step": spec.divergent_step if spec.divergent_step >= 0 else None,
            "zoom": spec.id,
            "reason": spec.reason,
            "calls": self._calls,
            "training": self._meta.get("training", False),
            "inputs": self._meta.get("inputs", {"args": {"tuple": []}, "kwargs": {"dict": {}}}),
            "output": self._meta.get("output", {"missing": "not captured"}),
            "parameters": self._meta.get("parameters", {}),
            "buffers": self._meta.get("buffers", {}),
            "parameter_types": self._meta.get("parameter_types", {}),
            "tensors": {name: {"dtype": self._flat.dtypes[name], "shape": list(array.shape)}
                        for name, array in self._flat.arrays.items()},
            "missing": missing,
        }
        path = self.directory / bundle_name(self.about["session"], self.about["run"], self.about["rank"], self.step,
                                            spec.bundle_module)
        try:
            self.size = write_bundle(path, meta, self._flat.arrays, module_pickle)
            self.path = path
            logger.warning("twinstep: wrote a reproducer bundle of %r at step %d: %s (%d bytes)%s; "
                           "run it with: twinstep reproduce %s", spec.bundle_module, self.step, path, self.size,
                           f"; missing: {'; '.join(missing)}" if missing else "", path)
        except Exception as error:  # noqa: BLE001
            logger.warning("twinstep: could not write the reproducer bundle %s: %s: %s", path, type(error).__name__,
                           error)


def _nbytes(tensor: Any) -> int:
    try:
        return int(math.prod(int(d) for d in tensor.shape)) * int(tensor.element_size())
    except Exception:  # noqa: BLE001 - an exotic tensor: counted as nothing
        return 0
