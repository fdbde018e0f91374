"""The paddle parts of a run's set-up: runtime flags and the optimizer, clipping included.

paddle's optimizer holds everything a parameter's update uses: group values,
the optimizer's own defaults, a per-parameter learning-rate multiplier
(``optimize_attr``), and ``apply_decay_param_fun``, which is keyed by the
framework's unique parameter name (``linear_3.w_0``): it is asked for every
parameter here and its answer recorded under the structured name.
"""

from __future__ import annotations

import os
from typing import Any, Callable

import paddle

from twinstep.runtime.setup import canonical
from twinstep.runtime.setup.base import SetupBuilder
from twinstep.runtime.setup.optimizer import add_groups, canonical_rows

_DETERMINISM_FLAGS = ("FLAGS_cudnn_deterministic", "FLAGS_embedding_deterministic")


def runtime(builder: SetupBuilder) -> None:
    builder.value("dtype", "default_dtype", str(paddle.get_default_dtype()))
    tracer = paddle.base.framework._dygraph_tracer()
    level = getattr(tracer, "_amp_level", None)
    enabled = level is not None and "O0" not in str(level)
    builder.value("autocast", "autocast_at_attach", enabled)
    for flag in _DETERMINISM_FLAGS:
        raw = os.environ.get(flag)
        if raw is not None:
            builder.value("determinism", flag, raw.strip().lower() in ("1", "true"))
    try:
        builder.value("seed", "seed", int(paddle.framework.core.default_cpu_generator().initial_seed()))
    except Exception:  # not every paddle exposes the generator's seed
        pass


def named_modules(model: Any):
    return model.named_sublayers(include_self=True)


def named_parameters(model: Any):
    return model.named_parameters()


def buffer(module: Any, name: str) -> Any:
    table = getattr(module, name, None)
    if not isinstance(table, paddle.Tensor) or len(table.shape) != 1 or not table.is_floating_point():
        return None
    return table.detach().cpu().numpy().astype("float64")


def _base_lr(opt: Any) -> tuple[float | None, Any]:
    lr = opt._learning_rate
    if isinstance(lr, paddle.optimizer.lr.LRScheduler):
        return getattr(lr, "base_lr", None), lr
    return float(lr), None


def _decay(value: Any) -> Any:
    """A float, or a regularizer object (L2Decay(coeff)) as its coefficient."""
    if value is None or isinstance(value, (int, float)):
        return value
    return getattr(value, "_coeff", value)


def optimizer(builder: SetupBuilder, opt: Any, names: dict[int, str]) -> None:
    builder.value("optimizer", "optimizer.class", type(opt).__name__)
    base_lr, scheduler = _base_lr(opt)
    if scheduler is not None:
        builder.value("lr", "scheduler", type(scheduler).__name__)
        for key, value in sorted(vars(scheduler).items()):
            if key not in ("last_lr", "last_epoch", "verbose", "base_lr") and isinstance(value, (int, float)):
                builder.value("lr", f"scheduler.{key}", value)
    clip = getattr(opt, "_grad_clip", None)
    _clipping(builder, clip)
    decay_fun = getattr(opt, "_apply_decay_param_fun", None)
    defaults = {"beta1": getattr(opt, "_beta1", None), "beta2": getattr(opt, "_beta2", None),
                "epsilon": getattr(opt, "_epsilon", None), "momentum": getattr(opt, "_momentum", None),
                "use_nesterov": getattr(opt, "_use_nesterov", None),
                "weight_decay": _decay(getattr(opt, "_weight_decay", None) if getattr(opt, "_weight_decay", None)
                                       is not None else getattr(opt, "regularization", None))}
    defaults = {k: v for k, v in defaults.items() if v is not None}
    groups = opt._param_groups
    if groups and not isinstance(groups[0], dict):
        groups = [{"params": list(groups)}]
    per_parameter = []
    unnamed = 0
    for group in groups:
        values = dict(defaults)
        values.update({k: _decay(v) if k == "weight_decay" else v for k, v in group.items()
                       if k not in ("params", "grad_clip", "learning_rate")})
        for p in group["params"]:
            name = names.get(id(p))
            if name is None:
                unnamed += 1
                continue
            mine = dict(values)
            multiplier = (getattr(p, "optimize_attr", None) or {}).get("learning_rate", 1.0)
            mine["lr"] = None if base_lr is None else base_lr * float(multiplier)
            if "weight_decay" in mine and decay_fun is not None and not decay_fun(p.name):
                mine["weight_decay"] = 0.0
            if clip is not None and not getattr(p, "need_clip", True):
                mine["need_clip"] = False
            per_parameter.append((name, canonical_rows(mine)))
    if unnamed:
        builder.warn_once(f"{unnamed} optimized parameter(s) are not parameters of the attached model: not compared")
    add_groups(builder, per_parameter)


def _clipping(builder: SetupBuilder, clip: Any) -> None:
    if clip is None:
        builder.value("clipping", "clipping", "none")
        return
    builder.value("clipping", "clipping", canonical.clipping_kind(type(clip).__name__))
    for key, canonical_key in (("clip_norm", "max_norm"), ("max", "clip_value")):
        value = getattr(clip, key, None)
        if isinstance(value, (int, float)):
            builder.value("clipping", f"clipping.{canonical_key}", value)


def scheduler(builder: SetupBuilder, sched: Any) -> None:
    builder.value("lr", "scheduler", type(sched).__name__)


def fingerprint(opt: Any) -> tuple:
    clip = getattr(opt, "_grad_clip", None)
    return (type(clip).__name__, getattr(clip, "clip_norm", None), getattr(opt, "_epsilon", None),
            getattr(opt, "_beta1", None) if isinstance(getattr(opt, "_beta1", None), float) else None)


def watch_loop(listener: Callable[[str, dict], None]) -> Callable[[], None]:
    """paddle's clipping is the optimizer's (read above): nothing in the loop to observe."""
    return lambda: None
