"""The MindSpore parts of a run's set-up: context, seed, the optimizer, and module values in torch's words.

Two optimizer families hold their hyper-parameters differently.
``mindspore.experimental.optim`` (AdamW, Adam, SGD, ...) keeps torch's
``param_groups``; its learning rate is a 0-d Parameter per group.
``mindspore.nn`` optimizers (Adam, AdamWeightDecay, Momentum, SGD, ...) keep
one value per parameter (``group_lr``, ``group_weight_decay``) when built from
group dicts, or one learning rate (a Parameter, a per-step list or a
``LearningRateSchedule``) and one weight decay that ``decay_filter`` withholds
from parameters whose name holds ``beta`` or ``gamma``; their weight decay is
stored multiplied by ``loss_scale``, divided back here.  ``nn.Momentum`` is
torch's ``SGD`` with momentum and no dampening (the same update), so it is
named ``SGD``; ``nn.AdamWeightDecay`` keeps its name: it has no bias
correction, so it is not torch's ``AdamW``.

Parameter names are the structured ones with torch's local names
(``embedding_table`` -> ``weight``, a norm's ``gamma`` -> ``weight``:
twinstep.wire.layouts.canonical_parameter_name), so the server joins them as it
joins the recorded parameters.  Activations a Cell holds as primitives
(``self.act = ops.GeLU()``) are listed as modules ``cell.act``.

MindSpore's clipping is a call on the gradients (``ops.clip_by_global_norm``)
that may sit inside a ``jit`` graph, where a Python wrapper cannot run: it is
not observed, and the set-up sends no clipping value (nothing is compared).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterator

import mindspore

from twinstep.wire.layouts import canonical_parameter_name
from twinstep.runtime.setup import canonical
from twinstep.runtime.setup.base import SetupBuilder, setup_value
from twinstep.runtime.setup.modules import module_values
from twinstep.runtime.setup.optimizer import add_groups, canonical_rows

#: MindSpore activation classes (cells and primitives) whose names differ from torch's, lower case.
_ACTIVATIONS = {"hswish": "hardswish", "hsigmoid": "hardsigmoid", "fastgelu": "quick_gelu",
                "gelu": "gelu", "silu": "silu", "swish": "silu", "relu": "relu", "relu6": "relu6",
                "leakyrelu": "leaky_relu", "elu": "elu", "selu": "selu", "celu": "celu", "tanh": "tanh",
                "sigmoid": "sigmoid", "mish": "mish", "softplus": "softplus", "softsign": "softsign"}
"""FastGeLU is x * sigmoid(1.702 x) (MindSpore's docs), transformers' quick_gelu, not its tanh FastGELU."""
#: nn optimizer attributes -> the keys twinstep.runtime.setup.optimizer.canonical_rows knows.
_NN_ATTRIBUTES = {"beta1": "beta1", "beta2": "beta2", "eps": "eps", "momentum": "momentum",
                  "dampening": "dampening", "use_nesterov": "nesterov", "nesterov": "nesterov",
                  "use_amsgrad": "amsgrad"}
_NN_NAMES = {"Momentum": "SGD"}


def runtime(builder: SetupBuilder) -> None:
    builder.value("dtype", "default_dtype", str(mindspore.Tensor(1.0).dtype).lower())  # what a Python float becomes
    builder.value("mindspore", "mindspore.mode",
                  "pynative" if mindspore.get_context("mode") == mindspore.PYNATIVE_MODE else "graph")
    builder.value("mindspore", "mindspore.device_target", str(mindspore.get_context("device_target")))
    deterministic = mindspore.get_context("deterministic")
    builder.value("determinism", "mindspore.deterministic", str(deterministic).upper() == "ON")
    seed = mindspore.get_seed()
    if seed is not None:  # None until set_seed: nothing to compare
        builder.value("seed", "seed", int(seed))


def named_modules(model: Any) -> Iterator[tuple[str, Any]]:
    return model.cells_and_names()


def named_parameters(model: Any) -> Iterator[tuple[str, Any]]:
    """Structured names with torch's local names (``model.embed_tokens.weight``); a shared parameter once."""
    seen: set[int] = set()
    for cell_name, cell in model.cells_and_names():
        for local, parameter in cell.parameters_and_names(expand=False):
            if id(parameter) in seen:
                continue
            seen.add(id(parameter))
            name = f"{cell_name}.{local}" if cell_name else local
            yield canonical_parameter_name(type(cell).__name__, name), parameter


def buffer(module: Any, name: str) -> Any:
    table = getattr(module, name, None)
    if not isinstance(table, mindspore.Tensor) or table.ndim != 1 or not table.dtype.is_floating_point:
        return None
    return table.asnumpy().astype("float64")


def optimizer(builder: SetupBuilder, opt: Any, names: dict[int, str]) -> None:
    if isinstance(getattr(opt, "param_groups", None), list):
        per_parameter, unnamed = _torch_like(builder, opt, names)
    else:
        per_parameter, unnamed = _nn(builder, opt, names)
    if unnamed:
        builder.warn_once(f"{unnamed} optimized parameter(s) are not parameters of the attached model: not compared")
    add_groups(builder, per_parameter)


def _torch_like(builder: SetupBuilder, opt: Any, names: dict[int, str]) -> tuple[list, int]:
    """mindspore.experimental.optim: torch's param_groups (their lr a 0-d Parameter)."""
    builder.value("optimizer", "optimizer.class", type(opt).__name__)
    per_parameter, unnamed = [], 0
    for group in opt.param_groups:
        raw = {k: _plain(v) for k, v in group.items() if k not in ("params", "lr", "initial_lr")}
        raw["lr"] = _plain(group.get("initial_lr", group.get("lr")))  # a scheduler's base, as for torch
        rows = canonical_rows(raw)
        for p in group["params"]:
            name = names.get(id(p))
            if name is None:
                unnamed += 1
                continue
            per_parameter.append((name, rows))
    return per_parameter, unnamed


def _nn(builder: SetupBuilder, opt: Any, names: dict[int, str]) -> tuple[list, int]:
    """mindspore.nn optimizers: values per parameter (group_lr, group_weight_decay) or one for all."""
    class_name = type(opt).__name__
    builder.value("optimizer", "optimizer.class", _NN_NAMES.get(class_name, class_name))
    loss_scale = float(getattr(opt, "loss_scale", 1.0) or 1.0)
    if loss_scale != 1.0:
        builder.value("loss_scaling", "loss_scaling", "static")
        builder.value("loss_scaling", "loss_scaling.init_scale", loss_scale)
    shared = {key: _plain(getattr(opt, attribute)) for attribute, key in _NN_ATTRIBUTES.items()
              if getattr(opt, attribute, None) is not None}
    if class_name == "Momentum":
        shared["dampening"] = 0.0
    parameters = list(opt.parameters)
    grouped = bool(getattr(opt, "is_group", False))
    group_lr = list(getattr(opt, "group_lr", [])) if getattr(opt, "is_group_lr", False) else []
    decays = list(getattr(opt, "decay_flags", ()))
    if grouped:
        decay_values = [_decay(v, loss_scale) for v in getattr(opt, "group_weight_decay", [])]
    else:
        decay_values = [_decay(getattr(opt, "weight_decay", None), loss_scale)] * len(parameters)
    schedules: set[str] = set()
    per_parameter, unnamed = [], 0
    for i, p in enumerate(parameters):
        name = names.get(id(p))
        if name is None:
            unnamed += 1
            continue
        raw = dict(shared)
        lr = _learning_rate(group_lr[i] if i < len(group_lr) else opt.learning_rate, schedules)
        if lr is not None:
            raw["lr"] = lr
        decay = decay_values[i] if i < len(decay_values) else None
        if decay is not None:
            raw["weight_decay"] = decay if (i >= len(decays) or decays[i]) else 0.0
        per_parameter.append((name, canonical_rows(raw)))
    for schedule in sorted(schedules):
        builder.value("lr", "scheduler", schedule)
    return per_parameter, unnamed


def _learning_rate(lr: Any, schedules: set[str]) -> float | None:
    """A Parameter's value; a per-step list's first; a schedule's starting rate (its class noted)."""
    lr = getattr(lr, "learning_rate", lr) if type(lr).__name__ == "_ConvertToCell" else lr
    if isinstance(lr, mindspore.Tensor):
        values = lr.asnumpy().reshape(-1)
        if values.size > 1:
            schedules.add("per-step list")
        return float(values[0]) if values.size else None
    schedule = getattr(lr, "learning_rate", None)
    if type(lr).__name__ == "_IteratorLearningRate" and isinstance(schedule, mindspore.Tensor):
        schedules.add("per-step list")
        return float(schedule.asnumpy().reshape(-1)[0])
    if isinstance(lr, mindspore.nn.Cell):
        schedules.add(type(lr).__name__)
        for attribute in ("learning_rate", "start_learning_rate", "max_lr"):
            value = _plain(getattr(lr, attribute, None))
            if isinstance(value, float):
                return value
        return None
    value = _plain(lr)
    return value if isinstance(value, float) else None


def _decay(value: Any, loss_scale: float) -> float | None:
    """A stored weight decay (a Tensor or float times loss_scale) as the user's value; a schedule: unknown."""
    value = _plain(value)
    return value / loss_scale if isinstance(value, float) else None


def _plain(value: Any) -> Any:
    """A 0-d or 1-element Tensor/Parameter as a float; tuples of them element-wise; other values as they are."""
    if isinstance(value, (bool, str)) or value is None:
        return value
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, (tuple, list)):
        return tuple(_plain(v) for v in value)
    if isinstance(value, mindspore.Tensor) and value.size == 1:
        number = float(value.asnumpy().reshape(-1)[0])
        return number if math.isfinite(number) else str(number)
    return value


def scheduler(builder: SetupBuilder, sched: Any) -> None:
    builder.value("lr", "scheduler", type(sched).__name__)


def fingerprint(opt: Any) -> tuple:
    """Cheap, per step: the torch-like groups' plain values; an nn optimizer's hyper-parameters are fixed."""
    groups = getattr(opt, "param_groups", None)
    if not isinstance(groups, list):
        return (type(getattr(opt, "learning_rate", None)).__name__,)
    return tuple(tuple(sorted((k, v) for k, v in g.items() if k not in ("params", "lr", "initial_lr")
                              and isinstance(v, (bool, int, float, str, tuple))))
                 for g in groups)


def watch_loop(listener: Callable[[str, dict], None]) -> Callable[[], None]:
    """Nothing is observed (see the module's docstring: clipping may run inside a jit graph)."""
    return lambda: None


# -- module values in torch's words ----------------------------------------------------------


def collect_modules(builder: SetupBuilder, model: Any) -> None:
    """As twinstep.runtime.setup.modules.collect_modules over every Cell, with MindSpore's activations in torch's
    words, ``nn.Dropout(keep_prob=...)`` as its drop rate, and the activation and dropout primitives a
    Cell holds as attributes as modules of their own (``mlp.act``)."""
    for name, cell in model.cells_and_names():
        try:
            builder.module(name, type(cell).__name__, _cell_values(cell))
            if type(cell).__module__.startswith("mindspore.") or _activation(cell) is not None:
                continue  # MindSpore's own Cells run on primitives: those are how they work, not modules
            for attribute, primitive in list(getattr(cell, "_primitives", {}).items()):
                kind = _activation(primitive)
                if kind is not None:
                    values = [setup_value("activation", "activation", kind)]
                elif type(primitive).__name__ == "Dropout":
                    values = _keep_prob(primitive)
                else:
                    continue
                builder.module(f"{name}.{attribute}" if name else attribute, type(primitive).__name__, values)
        except Exception as error:  # one odd module must not hide the others
            builder.failed(f"hyper-parameters of module {name!r}", error)


def _cell_values(cell: Any) -> list:
    kind = _activation(cell)
    if kind is not None:
        return [setup_value("activation", "activation", kind)]
    values = module_values(cell, buffer)
    if "Dropout" in type(cell).__name__ and getattr(cell, "p", None) is None:
        values = _keep_prob(cell) + values  # nn.Dropout(keep_prob=...) leaves p None
    return values


def _keep_prob(dropout: Any) -> list:
    keep = getattr(dropout, "keep_prob", None)
    if isinstance(keep, bool) or not isinstance(keep, (int, float)):
        return []
    return [setup_value("dropout", "p", 1.0 - float(keep))]


def _activation(obj: Any) -> str | None:
    """The canonical activation of a MindSpore activation Cell or primitive (None for anything else).

    ``nn.GELU(approximate=False)`` keeps ``approximate='none'`` (older releases: a bool); ``nn.GELU()``
    and the primitive ``ops.GeLU`` are the tanh form (MindSpore's docs).
    """
    if not type(obj).__module__.startswith("mindspore."):
        return canonical.activation(obj)  # a user's Cell: by class name, as for torch and paddle
    kind = _ACTIVATIONS.get(type(obj).__name__.lower())
    if kind == "gelu":
        approximate = getattr(obj, "approximate", True)
        kind = "gelu_tanh" if approximate is True or approximate == "tanh" else "gelu"
    return kind
