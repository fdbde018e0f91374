"""Replay a module's call from its bundles: the baseline's and the candidate's, in one process.

Each side's module is rebuilt (its pickled object, classes imported by path,
so the replay runs the code as it is now; or a factory the user names, for a
fix made in a constructor), given the bundle's parameters and buffers, and
called on the bundle's inputs in the recorded training mode, without
gradients.  Outputs are compared with the server's own metrics
(twinstep.server.compare.metrics) and judged by its forward tolerances:

- ``recorded``: the outputs the two trainings produced at that step;
- ``replayed``: each module on its own recorded inputs (the live divergence,
  reproduced);
- ``same inputs``: the candidate's module on the baseline's inputs (its
  parameters its own): the module's own error, with what came before it
  taken out;
- ``inputs``: how far the two runs' inputs differ;
- each side's replay against its own recording (does replay reproduce it?).

A verdict sentence says where the bug is.  torch and paddle may share the
process: each framework is imported when a bundle names it.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from twinstep.wire import stats
from twinstep.wire.layouts import is_in_out
from twinstep.tools.reproduce.bundle import SUFFIX, Bundle, BundleError, read_bundle
from twinstep.tools.reproduce.frameworks import Framework, framework
from twinstep.tools.reproduce.tree import flat_tensors, rebuild, tensor_names
from twinstep.server.compare import metrics
from twinstep.server.compare.tolerance import ToleranceConfig

#: Metrics shown, in the order shown (the server's statistics metrics, then its full-tensor ones).
SHOWN = ("rms", "mean", "extrema", "nonfinite", "rel_l2", "cosine", "max_abs")


@dataclass
class Comparison:
    label: str
    what: str
    values: dict[str, float] = field(default_factory=dict)
    tolerance: dict[str, float] = field(default_factory=dict)
    note: str = ""
    """Why it could not be made, when it could not (values are then empty)."""

    @property
    def exceeded(self) -> list[str]:
        return [m for m in SHOWN if m in self.values and self.values[m] > self.tolerance.get(m, float("inf"))]


@dataclass
class Side:
    bundle: Bundle
    framework: Framework
    module: Any = None
    built_from: str = ""
    notes: list[str] = field(default_factory=list)
    outputs: list[tuple[np.ndarray, str]] | None = None


@dataclass
class Reproduction:
    baseline: Side | None
    candidate: Side
    comparisons: list[Comparison]
    verdict: str
    module_diverges: bool


def find_counterpart(bundle: Bundle) -> Path | None:
    """The other role's bundle of the same session, rank, step and zoom, in the same folder."""
    meta = bundle.meta
    for path in sorted(bundle.path.parent.glob(f"*{SUFFIX}")):
        if path == bundle.path:
            continue
        try:
            other = read_bundle(path)
        except BundleError:
            continue
        m = other.meta
        if (m["session"], m["rank"], m["step"], m.get("zoom")) == (meta["session"], meta["rank"], meta["step"],
                                                                   meta.get("zoom")) and \
                bool(m["baseline"]) != bool(meta["baseline"]):
            return path
    return None


def reproduce(paths: list[str], *, baseline_factory: str | None = None, candidate_factory: str | None = None,
              tolerances: ToleranceConfig | None = None, training: bool | None = None) -> Reproduction:
    """Rebuild, run and compare; BundleError for bundles that cannot be used, and why."""
    bundles = [read_bundle(p) for p in paths]
    if len(bundles) == 1:
        other = find_counterpart(bundles[0])
        if other is not None:
            bundles.append(read_bundle(other))
    if len(bundles) > 2:
        raise BundleError("give one bundle, or two: the baseline's and a candidate's")
    baselines = [b for b in bundles if b.meta["baseline"]]
    others = [b for b in bundles if not b.meta["baseline"]]
    if len(bundles) == 2 and (len(baselines) != 1 or len(others) != 1):
        roles = " and ".join(b.role for b in bundles)
        raise BundleError(f"two bundles must be a baseline's and a candidate's, got a {roles}")
    tolerances = tolerances or ToleranceConfig()
    if len(bundles) == 1:  # one bundle alone: its replay against its recording
        alone = bundles[0]
        side = _side(alone, baseline_factory if alone.meta["baseline"] else candidate_factory, training)
        comparisons = [_compare("replay vs recording", "the module on its recorded inputs against its recorded "
                                "output", _recorded(side), side.outputs, side, tolerances)]
        bad = comparisons[0].exceeded
        verdict = (f"the replay does not reproduce the recording ({', '.join(bad)} over tolerance): the module is "
                   "not deterministic, or its code changed since" if bad else
                   "the replay reproduces the recording; give the other run's bundle too to compare them")
        return Reproduction(None, side, comparisons, verdict, False)
    base = _side(baselines[0], baseline_factory, training)
    cand = _side(others[0], candidate_factory, training)
    same_inputs = _on_inputs_of(cand, base)
    same_code = _with_parameters_of(cand, base)
    comparisons = [
        _compare("recorded", "the outputs the two trainings produced", _recorded(base), _recorded(cand), base,
                 tolerances),
        _compare("replayed", "each module on its own recorded inputs", base.outputs, cand.outputs, base, tolerances),
        _compare("same inputs", "the candidate's module on the baseline's inputs", base.outputs, same_inputs[0], base,
                 tolerances, same_inputs[1]),
        _compare("same parameters", "the candidate's module on the baseline's inputs and parameters: its code alone",
                 base.outputs, same_code[0], base, tolerances, same_code[1]),
        _compare("inputs", "the two runs' inputs", _inputs(base), _inputs(cand), base, tolerances),
        _compare("baseline replay", "the baseline's replay against its recording", _recorded(base), base.outputs,
                 base, tolerances),
        _compare("candidate replay", "the candidate's replay against its recording", _recorded(cand), cand.outputs,
                 cand, tolerances),
    ]
    return Reproduction(base, cand, comparisons, *_verdict(comparisons, base))


# -- each side ------------------------------------------------------------------------------------


def _side(bundle: Bundle, factory: str | None, training: bool | None) -> Side:
    meta = bundle.meta
    side = Side(bundle, framework(meta["framework"]))
    side.module, side.built_from = _module(bundle, side.framework, factory)
    values = {}
    for kind in ("parameters", "buffers"):
        for name, key in meta[kind].items():
            values[name] = (bundle.arrays[key], bundle.dtypes[key])
    unknown = side.framework.load_state(side.module, values)
    if unknown:
        side.notes.append(f"the rebuilt module has no {', '.join(unknown[:5])}: left as it was built")
    if not values and any(side.framework.named_state(side.module)):
        side.notes.append("no parameters or buffers in the bundle: the rebuilt module's own are used")
    mode = meta["training"] if training is None else training
    args, kwargs = _call_inputs(bundle, side.framework)
    try:
        output = side.framework.forward(side.module, args, kwargs, mode)
    except Exception as error:
        raise BundleError(f"{bundle.describe()}: the rebuilt module failed on the recorded inputs: "
                          f"{type(error).__name__}: {error}") from error
    side.outputs = flat_tensors(output, side.framework)
    return side


def _module(bundle: Bundle, fw: Framework, factory: str | None) -> tuple[Any, str]:
    name = bundle.meta["module"]
    if factory:
        built = _call_factory(factory)
        if name:  # a factory may build the whole model: its module of that name is the one replayed
            for found, module in fw.submodules(built):
                if found == name:
                    return module, f"{factory}, its {name!r}"
        return built, factory
    if bundle.module_pickle is None:
        raise BundleError(f"{bundle.describe()}: the bundle holds no module object ({'; '.join(bundle.meta['missing'])}"
                          f"); name a factory that builds it: --{bundle.role}-factory MODULE:FUNCTION")
    try:
        return fw.unpickle_module(bundle.module_pickle), f"the bundle's {bundle.meta.get('module_class', '')}"
    except Exception as error:
        raise BundleError(f"{bundle.describe()}: its module cannot be rebuilt ({type(error).__name__}: {error}); is "
                          f"{bundle.meta.get('module_class')!r} importable here? Or name a factory: "
                          f"--{bundle.role}-factory MODULE:FUNCTION") from error


def _call_factory(spec: str) -> Any:
    module_name, sep, attribute = spec.partition(":")
    if not sep or not module_name or not attribute:
        raise BundleError(f"factory {spec!r}: expected MODULE:FUNCTION (e.g. my_port.model:build_mlp)")
    try:
        target = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as error:
        raise BundleError(f"factory {spec!r}: {error}") from None
    return target()


def _call_inputs(bundle: Bundle, fw: Framework) -> tuple[tuple, dict]:
    meta = bundle.meta
    try:
        args = rebuild(meta["inputs"]["args"], bundle.arrays, bundle.dtypes, fw)
        kwargs = rebuild(meta["inputs"]["kwargs"], bundle.arrays, bundle.dtypes, fw)
    except (ValueError, KeyError, TypeError) as error:
        raise BundleError(f"{bundle.describe()}: its inputs cannot be rebuilt ({error})") from None
    return tuple(args), dict(kwargs)


def _on_inputs_of(side: Side, inputs_of: Side) -> tuple[list[tuple[np.ndarray, str]] | None, str]:
    """The side's module called on the other side's recorded inputs (None and why, when it cannot be)."""
    try:
        args, kwargs = _call_inputs(inputs_of.bundle, side.framework)
        output = side.framework.forward(side.module, args, kwargs,
                                        side.bundle.meta["training"])
    except Exception as error:  # other argument names or structure: said, not raised
        return None, f"not possible: {type(error).__name__}: {error}"
    return flat_tensors(output, side.framework), ""


def _with_parameters_of(side: Side, other: Side) -> tuple[list[tuple[np.ndarray, str]] | None, str]:
    """The side's module with the other side's parameters and buffers (by name, each in this side's layout),
    on the other side's inputs; None and why when they do not carry over."""
    mine, theirs = side.bundle.meta, other.bundle.meta
    values: dict[str, tuple[np.ndarray, str]] = {}
    for kind in ("parameters", "buffers"):
        if set(mine[kind]) != set(theirs[kind]):
            return None, f"not possible: the two modules' {kind} have other names"
        for name, key in theirs[kind].items():
            array, dtype = other.bundle.arrays[key], other.bundle.dtypes[key]
            own = side.bundle.arrays[mine[kind][name]]
            flip = is_in_out(theirs["framework"], theirs.get("parameter_types", {}).get(name, ""), name) != \
                is_in_out(mine["framework"], mine.get("parameter_types", {}).get(name, ""), name)
            if flip and array.ndim == 2:
                array = np.ascontiguousarray(array.T)
            if array.shape != own.shape:
                return None, f"not possible: {name} is {list(array.shape)} against {list(own.shape)}"
            values[name] = (array, dtype)
    if not values:
        return None, "the module has no parameters or buffers: the same as the row above"
    own_values = {name: (side.bundle.arrays[key], side.bundle.dtypes[key])
                  for kind in ("parameters", "buffers") for name, key in mine[kind].items()}
    try:
        side.framework.load_state(side.module, values)
        return _on_inputs_of(side, other)
    finally:
        side.framework.load_state(side.module, own_values)


def _recorded(side: Side) -> list[tuple[np.ndarray, str]]:
    bundle = side.bundle
    return [(bundle.arrays[n], bundle.dtypes[n]) for n in tensor_names(bundle.meta["output"])]


def _inputs(side: Side) -> list[tuple[np.ndarray, str]]:
    bundle = side.bundle
    inputs = bundle.meta["inputs"]
    names = tensor_names(inputs["args"]) + tensor_names(inputs["kwargs"])
    return [(bundle.arrays[n], bundle.dtypes[n]) for n in names]


# -- comparing ------------------------------------------------------------------------------------


def _compare(label: str, what: str, a: list | None, b: list | None, judged_as: Side, tolerances: ToleranceConfig,
             note: str = "") -> Comparison:
    """The server's metrics of two lists of tensors (the worst over pairs), and its forward tolerances."""
    out = Comparison(label, what, note=note)
    if note:
        return out
    if not a or not b:
        out.note = "nothing to compare (a side recorded no tensor)"
        return out
    if len(a) != len(b):
        out.note = f"{len(a)} tensors against {len(b)}"
        return out
    worst: dict[str, float] = {}
    dtypes = []
    for (x, dtype_x), (y, dtype_y) in zip(a, b):
        dtypes += [dtype_x, dtype_y]
        if x.shape != y.shape:
            if x.size != y.size:
                out.note = f"shapes differ: {list(x.shape)} against {list(y.shape)}"
                return out
            y = y.reshape(x.shape)
        if x.dtype.kind not in "fc" or y.dtype.kind not in "fc":
            x, y = x.astype(np.float64), y.astype(np.float64)
        found = metrics.from_statistics(stats.of_array(x), stats.of_array(y))
        values = {k: float(v[0]) for k, v in found.items()}
        values.update(metrics.from_tensors(x, y))
        for key, value in values.items():
            worst[key] = max(worst.get(key, 0.0), value)
    out.values = {m: worst[m] for m in SHOWN if m in worst}
    from twinstep.server.compare.tolerance import effective_dtype

    limits = tolerances.for_record("forward", judged_as.bundle.meta["module"], effective_dtype(*dtypes))
    out.tolerance = {m: limits.get(m, float("inf")) for m in SHOWN}
    return out


def _verdict(comparisons: list[Comparison], base: Side) -> tuple[str, bool]:
    by = {c.label: c for c in comparisons}
    module = base.bundle.meta["module"] or "(model)"
    code, same, replayed, inputs = by["same parameters"], by["same inputs"], by["replayed"], by["inputs"]

    def worst(c: Comparison) -> str:
        m = max(c.exceeded, key=lambda k: c.values[k] / max(c.tolerance[k], 1e-300))
        return f"{m} {c.values[m]:.3g} > {c.tolerance[m]:.3g}"

    if code.exceeded:
        return (f"the candidate's {module!r} itself computes differently from the baseline's on the same inputs and "
                f"parameters ({worst(code)}): the bug is in this module's code; fix it and run twinstep reproduce "
                "again"), True
    judged = code if code.values else same  # without parameters to carry over, the same inputs are the test
    if judged is same and same.exceeded:
        return (f"the candidate's {module!r} itself differs from the baseline's on the same inputs ({worst(same)}): "
                "the bug is in this module; fix it and run twinstep reproduce again"), True
    if same.exceeded:
        return (f"with the baseline's parameters the candidate's {module!r} agrees; with its own it does not "
                f"({worst(same)}): its parameters have drifted (an earlier step, the optimizer, loading): look "
                "there"), False
    if same.note and not code.values and replayed.exceeded:
        return (f"the modules' outputs differ ({worst(replayed)}), and the candidate's could not be run on the "
                f"baseline's inputs ({same.note}): compare the inputs too"), True
    if replayed.exceeded and inputs.exceeded:
        return (f"the outputs differ ({worst(replayed)}) only because the inputs do ({worst(inputs)}): on the same "
                f"inputs the two {module!r} agree; look before this module"), False
    if replayed.exceeded:
        return f"the outputs differ ({worst(replayed)}) though neither the module nor its inputs seem to: see the "\
               "replays against their recordings", False
    return f"the two {module!r} agree within tolerance on this call: not reproduced here", False
