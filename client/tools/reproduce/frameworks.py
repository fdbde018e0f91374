"""What a reproducer needs of a framework: tensors to numpy and back, hooks, state, pickling, a forward.

One small adapter per framework, importing it only when used: a torch job
writing a bundle never imports paddle, and ``twinstep reproduce`` imports
each framework its bundles name (both may share the process).  bfloat16
tensors are kept as float32 arrays (exact) and cast back on replay.
"""

from __future__ import annotations

import copy
import io
import pickle
from typing import Any, Callable

import numpy as np

#: Attributes of a module's __dict__ that hold its children (torch, paddle).
_CHILDREN = ("_modules", "_sub_layers")


class Framework:
    """The operations a bundle needs; subclasses import their framework lazily."""

    name = ""

    def is_tensor(self, value: Any) -> bool:
        raise NotImplementedError

    def to_numpy(self, tensor: Any) -> tuple[np.ndarray, str]:
        """A private host copy of the tensor, and its dtype's name (bfloat16 as float32 values)."""
        raise NotImplementedError

    def from_numpy(self, array: np.ndarray, dtype: str) -> Any:
        raise NotImplementedError

    def add_hooks(self, module: Any, before: Callable[[tuple, dict], None],
                  after: Callable[[Any], None]) -> tuple[list[Any], bool]:
        """Forward pre- and post-hooks; returns the handles and whether keyword arguments reach ``before``."""
        raise NotImplementedError

    def submodules(self, module: Any) -> list[tuple[str, Any]]:
        """Every module of a model by its dotted name ("" itself)."""
        return list(module.named_modules())

    def named_state(self, module: Any) -> tuple[list[tuple[str, Any]], list[tuple[str, Any]]]:
        """(parameters, buffers) of the module, by their names within it."""
        return list(module.named_parameters()), list(module.named_buffers())

    def load_state(self, module: Any, values: dict[str, tuple[np.ndarray, str]]) -> list[str]:
        """Set parameters and buffers by name from arrays; returns the names the module does not have."""
        raise NotImplementedError

    def pickle_module(self, module: Any) -> bytes:
        raise NotImplementedError

    def unpickle_module(self, data: bytes) -> Any:
        raise NotImplementedError

    def forward(self, module: Any, args: tuple, kwargs: dict, training: bool) -> Any:
        raise NotImplementedError

    def version(self) -> str:
        raise NotImplementedError


class TorchFramework(Framework):
    name = "torch"

    def __init__(self) -> None:
        import torch

        self.torch = torch

    def is_tensor(self, value: Any) -> bool:
        return isinstance(value, self.torch.Tensor)

    def to_numpy(self, tensor: Any) -> tuple[np.ndarray, str]:
        dtype = str(tensor.dtype).removeprefix("torch.")
        value = tensor.detach()
        if dtype == "bfloat16":
            value = value.float()
        return np.array(value.cpu().numpy(), copy=True), dtype

    def from_numpy(self, array: np.ndarray, dtype: str) -> Any:
        tensor = self.torch.from_numpy(np.ascontiguousarray(array))
        return tensor.to(getattr(self.torch, dtype)) if dtype != str(tensor.dtype).removeprefix("torch.") else tensor

    def add_hooks(self, module: Any, before: Callable[[tuple, dict], None],
                  after: Callable[[Any], None]) -> tuple[list[Any], bool]:
        pre = module.register_forward_pre_hook(lambda m, args, kwargs: before(args, kwargs), with_kwargs=True)
        post = module.register_forward_hook(lambda m, args, output: after(output))
        return [pre, post], True

    def load_state(self, module: Any, values: dict[str, tuple[np.ndarray, str]]) -> list[str]:
        own = dict(module.named_parameters())
        own.update(module.named_buffers())
        missing = []
        with self.torch.no_grad():
            for name, (array, dtype) in values.items():
                target = own.get(name)
                if target is None:
                    missing.append(name)
                    continue
                target.copy_(self.from_numpy(array, dtype).to(target.dtype).reshape(target.shape))
        return missing

    def pickle_module(self, module: Any) -> bytes:
        out = io.BytesIO()
        self.torch.save(_without_hooks(module), out)
        return out.getvalue()

    def unpickle_module(self, data: bytes) -> Any:
        return self.torch.load(io.BytesIO(data), weights_only=False)

    def forward(self, module: Any, args: tuple, kwargs: dict, training: bool) -> Any:
        module.train(training)
        with self.torch.no_grad():
            return module(*args, **kwargs)

    def version(self) -> str:
        return self.torch.__version__


class PaddleFramework(Framework):
    name = "paddle"

    def __init__(self) -> None:
        import warnings

        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="No ccache found")
            import paddle
        self.paddle = paddle

    def is_tensor(self, value: Any) -> bool:
        return isinstance(value, self.paddle.Tensor)

    def submodules(self, module: Any) -> list[tuple[str, Any]]:
        return list(module.named_sublayers(include_self=True))

    def to_numpy(self, tensor: Any) -> tuple[np.ndarray, str]:
        dtype = str(tensor.dtype).removeprefix("paddle.")
        value = tensor.detach()
        if dtype == "bfloat16":
            value = self.paddle.cast(value, "float32")
        return np.array(value.numpy(), copy=True), dtype

    def from_numpy(self, array: np.ndarray, dtype: str) -> Any:
        tensor = self.paddle.to_tensor(np.ascontiguousarray(array))
        return self.paddle.cast(tensor, dtype) if str(tensor.dtype).removeprefix("paddle.") != dtype else tensor

    def add_hooks(self, module: Any, before: Callable[[tuple, dict], None],
                  after: Callable[[Any], None]) -> tuple[list[Any], bool]:
        post = module.register_forward_post_hook(lambda m, args, output: after(output))
        try:
            pre = module.register_forward_pre_hook(lambda m, args, kwargs: before(args, kwargs), with_kwargs=True)
            return [pre, post], True
        except TypeError:  # an older paddle: positional inputs only
            pre = module.register_forward_pre_hook(lambda m, args: before(args, {}))
            return [pre, post], False

    def load_state(self, module: Any, values: dict[str, tuple[np.ndarray, str]]) -> list[str]:
        own = dict(module.named_parameters())
        own.update(module.named_buffers())
        missing = []
        for name, (array, dtype) in values.items():
            target = own.get(name)
            if target is None:
                missing.append(name)
                continue
            value = self.paddle.cast(self.from_numpy(array, dtype), target.dtype).reshape(target.shape)
            target.set_value(value)
        return missing

    def pickle_module(self, module: Any) -> bytes:
        return pickle.dumps(_without_hooks(module), protocol=4)

    def unpickle_module(self, data: bytes) -> Any:
        return pickle.loads(data)

    def forward(self, module: Any, args: tuple, kwargs: dict, training: bool) -> Any:
        module.train() if training else module.eval()
        with self.paddle.no_grad():
            return module(*args, **kwargs)

    def version(self) -> str:
        return self.paddle.__version__


_MADE: dict[str, Framework] = {}
FRAMEWORKS = ("torch", "paddle")


def framework(name: str) -> Framework:
    """The adapter of ``name`` ("torch" or "paddle"), importing the framework the first time."""
    if name not in _MADE:
        if name == "torch":
            _MADE[name] = TorchFramework()
        elif name == "paddle":
            _MADE[name] = PaddleFramework()
        else:
            raise ValueError(f"unknown framework {name!r} (expected one of {', '.join(FRAMEWORKS)})")
    return _MADE[name]


def _without_hooks(module: Any) -> Any:
    """A shallow copy of the module tree with no hooks (twinstep's own, a launcher's): what can be pickled.

    Parameters and buffers are shared with the live module, not copied.
    """
    clone = copy.copy(module)
    state = dict(module.__dict__)
    for key, value in module.__dict__.items():
        if "hook" in key and isinstance(value, dict):
            state[key] = type(value)()
    for key in _CHILDREN:
        children = module.__dict__.get(key)
        if isinstance(children, dict):
            state[key] = type(children)((name, _without_hooks(child) if child is not None else None)
                                        for name, child in children.items())
    clone.__dict__.update(state)
    return clone
