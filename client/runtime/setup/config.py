"""The model config's keys that can change the numerics (Hugging Face / paddleformers PretrainedConfig).

Both libraries' configs hold dozens of keys the other lacks (parallelism,
generation defaults, fused kernels); only keys whose names say they shape
the model's arithmetic are sent, and the server compares those both sides
have.  Nested dicts (transformers 5's ``rope_parameters``) are flattened to
dotted keys, and a leaf key that is unique is also sent under its own name,
so ``rope_parameters.rope_theta`` meets paddleformers' ``rope_theta``.
"""

from __future__ import annotations

import re
from typing import Any

from twinstep.runtime.setup.base import SetupBuilder

_NUMERICS = re.compile(
    r"(eps|epsilon|rope|theta|base_freq|hidden_act|activation|dropout|pdrop|softcap|scalar|partial_rotary|"
    r"head_dim|hidden_size|intermediate_size|num_.*heads|num_hidden_layers|vocab_size|tie_word|rotary|scaling)",
)
_DROPOUT_SUFFIXES = ("_prob", "_probs", "_rate")
_MAX_DEPTH = 3


def canonical_key(key: str) -> str:
    """``attention_dropout_prob`` (paddleformers) and ``attention_dropout`` (transformers) are one key."""
    for suffix in _DROPOUT_SUFFIXES:
        if "dropout" in key and key.endswith(suffix):
            return key[: -len(suffix)]
    return key


def collect_config(builder: SetupBuilder, model: Any) -> None:
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_dict"):
        return
    flat: dict[str, Any] = {}
    _flatten(config.to_dict(), "", flat, 0)
    leaves: dict[str, list[str]] = {}
    for key in flat:
        leaves.setdefault(key.rsplit(".", 1)[-1], []).append(key)
    for leaf, keys in leaves.items():
        if len(keys) == 1 and "." in keys[0] and leaf not in flat:
            flat[leaf] = flat[keys[0]]
    for key in sorted(flat):
        if _NUMERICS.search(key.rsplit(".", 1)[-1]):
            builder.value("config", "config." + canonical_key(key), flat[key])


def _flatten(data: dict, prefix: str, out: dict[str, Any], depth: int) -> None:
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and depth < _MAX_DEPTH:
            _flatten(value, name + ".", out, depth + 1)
        elif isinstance(value, (bool, int, float, str)) or value is None:
            out[name] = value
