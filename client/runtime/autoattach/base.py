"""What a framework's probe offers the framework-neutral installer, and a reversible attribute patch."""

from __future__ import annotations

import abc
from typing import Any, Callable, Iterator


class Probe(abc.ABC):
    """A framework's global hooks: they report optimizers, module calls, backward calls and optimizer steps.

    Every hook runs on the training thread and must not raise into it (the
    installer catches and warns); each is removable, and after ``remove`` the
    framework is as it was.
    """

    framework: str

    @abc.abstractmethod
    def remove_discovery(self) -> None:
        """Remove the per-module-call hook: the model is found (or given up on)."""

    @abc.abstractmethod
    def remove(self) -> None:
        """Remove every hook and patch."""

    @abc.abstractmethod
    def grad_enabled(self) -> bool:
        """True while autograd records (a training forward, not an evaluation under no_grad)."""

    @abc.abstractmethod
    def parameters(self, module: Any) -> Iterator[Any]:
        """The module's parameters, its children's included."""

    @abc.abstractmethod
    def optimizer_parameters(self, optimizer: Any) -> Iterator[Any]:
        """The parameters an optimizer updates."""

    @abc.abstractmethod
    def unwrap(self, module: Any) -> tuple[Any, list[str]]:
        """The model inside data-parallel wrappers (DDP's ``.module``, paddle's ``._layers``), and the wrappers' names."""

    @abc.abstractmethod
    def numel(self, parameter: Any) -> int:
        """Elements of a parameter."""

    @abc.abstractmethod
    def scalar_loss(self, tensors: Any, gradient: Any) -> Any | None:
        """The detached scalar a backward call starts from (a sum over several), or None if it is not one."""


class Patch:
    """``owner.name = replacement`` until ``remove()``, which restores the original if nobody patched over it.

    The replacement should call through when ``active`` is False: if another
    library wrapped it in turn, it cannot be taken out of their chain.
    """

    def __init__(self, owner: Any, name: str, make: Callable[[Any], Any]) -> None:
        self.owner = owner
        self.name = name
        # A class's own attribute (None: inherited, and removing the patch deletes the override).
        self.original = owner.__dict__.get(name) if isinstance(owner, type) else getattr(owner, name)
        self.active = True
        self.replacement = make(self.original if self.original is not None else getattr(owner, name, None))
        setattr(owner, name, self.replacement)

    def remove(self) -> None:
        if not self.active:
            return
        self.active = False
        current = self.owner.__dict__.get(self.name) if isinstance(self.owner, type) else getattr(self.owner, self.name, None)
        if current is not self.replacement:
            return
        if self.original is None:
            delattr(self.owner, self.name)
        else:
            setattr(self.owner, self.name, self.original)
