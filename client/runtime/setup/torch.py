"""The torch parts of a run's set-up: runtime flags, the optimizer, clipping and loss scaling seen in the loop.

Clipping in torch is a call in the training loop, not a property of the
optimizer: while a run is attached, ``torch.nn.utils.clip_grad_norm_`` and
``clip_grad_value_`` (and ``GradScaler.scale``, for loss scaling) are wrapped
by one process-wide watcher that notes their arguments and calls through;
the set-up is sent again once a new kind of call is seen.  The wrappers are
removed when the last attached run closes (if nothing wrapped them since).
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import torch

from twinstep.runtime.setup.base import SetupBuilder
from twinstep.runtime.setup.optimizer import add_groups, canonical_rows


def runtime(builder: SetupBuilder) -> None:
    builder.value("dtype", "default_dtype", str(torch.get_default_dtype()).replace("torch.", ""))
    builder.value("autocast", "autocast_at_attach", torch.is_autocast_enabled())
    builder.value("determinism", "deterministic_algorithms", torch.are_deterministic_algorithms_enabled())
    builder.value("determinism", "torch.cudnn.deterministic", bool(torch.backends.cudnn.deterministic))
    builder.value("determinism", "torch.cudnn.benchmark", bool(torch.backends.cudnn.benchmark))
    builder.value("tf32", "torch.cuda.matmul.allow_tf32", bool(torch.backends.cuda.matmul.allow_tf32))
    builder.value("tf32", "torch.cudnn.allow_tf32", bool(torch.backends.cudnn.allow_tf32))
    builder.value("seed", "seed", int(torch.initial_seed()))


def named_modules(model: Any):
    return model.named_modules()


def named_parameters(model: Any):
    return model.named_parameters()


def buffer(module: Any, name: str) -> Any:
    table = getattr(module, name, None)
    if not isinstance(table, torch.Tensor) or table.dim() != 1 or not table.is_floating_point():
        return None
    return table.detach().double().cpu().numpy()


def optimizer(builder: SetupBuilder, opt: Any, names: dict[int, str]) -> None:
    builder.value("optimizer", "optimizer.class", type(opt).__name__)
    per_parameter = []
    unnamed = 0
    for group in opt.param_groups:
        raw = {k: v for k, v in group.items() if k not in ("params", "lr", "initial_lr")}
        raw["lr"] = group.get("initial_lr", group.get("lr"))  # a scheduler's base, not this step's value
        rows = canonical_rows(raw)
        for p in group["params"]:
            name = names.get(id(p))
            if name is None:
                unnamed += 1
                continue
            per_parameter.append((name, rows))
    if unnamed:
        builder.warn_once(f"{unnamed} optimized parameter(s) are not parameters of the attached model: not compared")
    add_groups(builder, per_parameter)


def scheduler(builder: SetupBuilder, sched: Any) -> None:
    """An LR scheduler given by a trainer integration (torch's optimizer does not know its scheduler)."""
    builder.value("lr", "scheduler", type(sched).__name__)


def fingerprint(opt: Any) -> tuple:
    """Cheap, per step: what a set-up change would show (the learning rate's schedule is left out)."""
    return tuple(tuple(sorted((k, v) for k, v in g.items() if k not in ("params", "lr", "initial_lr")
                              and isinstance(v, (bool, int, float, str, tuple))))
                 for g in opt.param_groups)


class _Watcher:
    """Process-wide wrappers of the loop's clip and scale calls; each attached run listens."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.listeners: list[Callable[[str, dict], None]] = []
        self._originals: dict[tuple[Any, str], Any] = {}

    def add(self, listener: Callable[[str, dict], None]) -> None:
        with self._lock:
            if not self.listeners:
                self._install()
            self.listeners.append(listener)

    def remove(self, listener: Callable[[str, dict], None]) -> None:
        with self._lock:
            if listener in self.listeners:
                self.listeners.remove(listener)
            if not self.listeners:
                self._uninstall()

    def _tell(self, kind: str, about: dict) -> None:
        for listener in list(self.listeners):
            try:
                listener(kind, about)
            except Exception:  # a listener's bug must not break the training's call
                pass

    def _install(self) -> None:
        utils = torch.nn.utils
        clip_module = getattr(utils, "clip_grad", None)

        def norm(original: Any) -> Any:
            def clip_grad_norm_(parameters: Any, max_norm: float, norm_type: float = 2.0, *args: Any, **kwargs: Any):
                self._tell("clip_norm", {"max_norm": max_norm, "norm_type": kwargs.get("norm_type", norm_type)})
                return original(parameters, max_norm, norm_type, *args, **kwargs)
            clip_grad_norm_.__wrapped__ = original  # type: ignore[attr-defined]
            return clip_grad_norm_

        def value(original: Any) -> Any:
            def clip_grad_value_(parameters: Any, clip_value: float, *args: Any, **kwargs: Any):
                self._tell("clip_value", {"clip_value": clip_value})
                return original(parameters, clip_value, *args, **kwargs)
            clip_grad_value_.__wrapped__ = original  # type: ignore[attr-defined]
            return clip_grad_value_

        def scale(original: Any) -> Any:
            def scale_(scaler: Any, outputs: Any, *args: Any, **kwargs: Any):
                self._tell("loss_scale", {"enabled": bool(getattr(scaler, "_enabled", True)),
                                          "init_scale": getattr(scaler, "_init_scale", None),
                                          "growth_interval": getattr(scaler, "_growth_interval", None)})
                return original(scaler, outputs, *args, **kwargs)
            scale_.__wrapped__ = original  # type: ignore[attr-defined]
            return scale_

        targets = [(utils, "clip_grad_norm_", norm), (utils, "clip_grad_value_", value)]
        if clip_module is not None:
            targets += [(clip_module, "clip_grad_norm_", norm), (clip_module, "clip_grad_value_", value)]
        scaler_class = getattr(getattr(torch, "amp", None), "GradScaler", None)
        if scaler_class is not None:
            targets.append((scaler_class, "scale", scale))
        for owner, name, wrap in targets:
            original = getattr(owner, name, None)
            if original is None:
                continue
            self._originals[(owner, name)] = original
            setattr(owner, name, wrap(original))

    def _uninstall(self) -> None:
        for (owner, name), original in self._originals.items():
            current = getattr(owner, name, None)
            if getattr(current, "__wrapped__", None) is original:  # only ours: someone may have wrapped it since
                setattr(owner, name, original)
        self._originals.clear()


_WATCHER = _Watcher()


def watch_loop(listener: Callable[[str, dict], None]) -> Callable[[], None]:
    """Observe clip and loss-scale calls; returns the function that stops observing."""
    _WATCHER.add(listener)
    return lambda: _WATCHER.remove(listener)
