"""Names both frameworks give the same thing, so a faithful port's set-up does not differ in words.

torch's ``nn.SiLU`` and paddle's ``nn.Silu`` are one activation; transformers'
``GELUTanh`` and paddleformers' ``PaddleGELUTanh`` another.  Activations are
recognised by class name (lower case, without an ``activation`` suffix); a
class not listed here is not an activation as far as the set-up goes (a
custom autograd function, say), so it is never compared.
"""

from __future__ import annotations

from typing import Any

_ACTIVATIONS = {
    "silu": "silu", "swish": "silu", "siluactivation": "silu",
    "gelu": "gelu", "geluactivation": "gelu",
    "gelutanh": "gelu_tanh", "pytorchgelutanh": "gelu_tanh", "paddlegelutanh": "gelu_tanh",
    "newgelu": "gelu_tanh", "newgeluactivation": "gelu_tanh", "fastgelu": "gelu_tanh", "fastgeluactivation": "gelu_tanh",
    "quickgelu": "quick_gelu", "quickgeluactivation": "quick_gelu",
    "relu": "relu", "relu6": "relu6", "leakyrelu": "leaky_relu", "elu": "elu", "selu": "selu", "celu": "celu",
    "tanh": "tanh", "sigmoid": "sigmoid", "mish": "mish", "hardswish": "hardswish", "hardsigmoid": "hardsigmoid",
    "softplus": "softplus", "softsign": "softsign", "gelu_tanh": "gelu_tanh",
}

#: Optimizer hyper-parameters: framework key -> (category, canonical key).
OPTIMIZER_KEYS = {
    "lr": ("lr", "lr"), "learning_rate": ("lr", "lr"),
    "beta1": ("betas", "beta1"), "beta2": ("betas", "beta2"),
    "eps": ("epsilon", "epsilon"), "epsilon": ("epsilon", "epsilon"),
    "weight_decay": ("weight_decay", "weight_decay"),
    "momentum": ("momentum", "momentum"), "nesterov": ("momentum", "nesterov"),
    "use_nesterov": ("momentum", "nesterov"), "dampening": ("momentum", "dampening"),
    "amsgrad": ("optimizer", "amsgrad"), "alpha": ("optimizer", "alpha"), "rho": ("optimizer", "rho"),
    "centered": ("optimizer", "centered"), "lr_decay": ("optimizer", "lr_decay"),
}


def activation(module: Any) -> str | None:
    """The canonical activation of a module, or None when it is not a known one."""
    name = type(module).__name__.lower()
    canonical = _ACTIVATIONS.get(name) or _ACTIVATIONS.get(name.removesuffix("activation"))
    if canonical == "gelu":  # torch: approximate="none"/"tanh"; paddle: _approximate True/False
        approximate = getattr(module, "approximate", getattr(module, "_approximate", None))
        if approximate is True or approximate == "tanh":
            return "gelu_tanh"
    return canonical


def clipping_kind(class_name: str) -> str:
    """paddle's clip classes in the words torch's clip calls get (twinstep.runtime.setup.torch)."""
    return {"ClipGradByGlobalNorm": "global_norm", "ClipGradByNorm": "per_tensor_norm",
            "ClipGradByValue": "value"}.get(class_name, class_name)
