"""Which parameters a framework stores transposed, and under which names: shared by the server and the capture code.

Decided from the framework and the owning module's type, never from shapes:
a square Linear weight looks the same either way, yet its layout differs.
The server transposes to compare; the client keys sketches by the canonical
(torch ``[out, in]``) index so both frameworks' fingerprints line up.

MindSpore's ``nn.Dense`` stores ``[out, in]`` like torch (nothing to
transpose), but its norms and embeddings name their parameters otherwise:
``gamma``/``beta`` for ``weight``/``bias``, ``embedding_table`` for ``weight``,
``moving_mean``/``moving_variance`` for ``running_mean``/``running_var``.
:func:`canonical_parameter_name` gives the torch name, so the server joins
those parameters with no mapping rule (msprobe's MindSpore-to-PyTorch
comparison makes the same correspondence).
"""

from __future__ import annotations

# (framework, module type) -> parameter local names stored as [in, out] rather than [out, in].
_IN_OUT_WEIGHTS: dict[tuple[str, str], frozenset[str]] = {
    ("paddle", "Linear"): frozenset({"weight"}),
    ("paddle", "ColumnParallelLinear"): frozenset({"weight"}),
    ("paddle", "RowParallelLinear"): frozenset({"weight"}),
    ("paddle", "FusedLinear"): frozenset({"weight"}),
}


def is_in_out(framework: str, module_type: str, parameter_name: str) -> bool:
    """Whether the parameter is stored [in, out], the transpose of the canonical [out, in]."""
    local = parameter_name.rsplit(".", 1)[-1]
    return local in _IN_OUT_WEIGHTS.get((framework, module_type), frozenset())


_NORMS = frozenset({"LayerNorm", "BatchNorm1d", "BatchNorm2d", "BatchNorm3d", "GroupNorm", "InstanceNorm1d",
                    "InstanceNorm2d", "InstanceNorm3d", "RMSNorm", "Norm"})
# (module types, MindSpore's local parameter name) -> torch's local name.
_TORCH_NAMES: dict[str, tuple[frozenset[str], str]] = {
    "gamma": (_NORMS, "weight"),
    "beta": (_NORMS, "bias"),
    "moving_mean": (_NORMS, "running_mean"),
    "moving_variance": (_NORMS, "running_var"),
    "embedding_table": (frozenset({"Embedding", "EmbeddingExt"}), "weight"),
}


def canonical_parameter_name(module_type: str, parameter_name: str) -> str:
    """The parameter's name with torch's local name where MindSpore's module of that type names it otherwise.

    "ln.gamma" of a LayerNorm -> "ln.weight"; every other name is returned unchanged.
    """
    module, dot, local = parameter_name.rpartition(".")
    found = _TORCH_NAMES.get(local)
    if found is None or module_type not in found[0]:
        return parameter_name
    return f"{module}{dot}{found[1]}"
