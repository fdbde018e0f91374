"""Which parameters a framework stores transposed: shared by the server and the capture code.

Decided from the framework and the owning module's type, never from shapes:
a square Linear weight looks the same either way, yet its layout differs.
The server transposes to compare; the client keys sketches by the canonical
(torch ``[out, in]``) index so both frameworks' fingerprints line up.
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
