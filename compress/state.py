"""What a pass leaves on a module, declared once.

A pass compresses a layer by attaching a *state* to it: the integer form of its weight, an input
scheme, a prune mask, a LoRA correction, a KV-cache scheme, bitsandbytes' 4-bit codes, or (a state
that is the module itself) a factored pair. Each kind is a class that subclasses ``State`` with the
attribute it occupies on a module (``class PruneMask(State, attr="prune_mask")``), as gguf-py's block
types register themselves with their traits. A kind lives next to its math (``quant.QuantizedWeight``,
``sparsity.PruneMask``, ...); ``KINDS`` is where they are all found, so code that handles every kind
(a resume checkpoint, freeing a block, the export's bit count) loops over it and names none of them.

A kind says:
- how it attaches (``attach``; ``of`` reads it back, ``drop`` removes it),
- what it saves in a resume checkpoint (``saved``: tensors and JSON metadata), how it is
  rebuilt from them (``restore``) and which of the module's parameters that sets (``rebuilds``),
- what it stores in an export (``stored_bits``), for the report's bits per weight, and what it
  folds into the module's dense tensors there (``exported``; by default nothing).
Which tensors an on-disk format writes for it is the format's business (``compress/formats/``).
"""

from __future__ import annotations

from typing import ClassVar

import torch

KINDS: dict[str, type[State]] = {}  # attribute -> kind, in the order their modules are imported


class State:
    """A kind of compressed state on a module (see the module docstring)."""

    attr: ClassVar[str]
    # restored before the block's tensors are loaded (it changes which tensors the block has)
    structural: ClassVar[bool] = False
    # freed with the module's tensors (``drop_all``); a scheme that only says how the module
    # computes (its inputs, its KV cache) stays, as the module's hooks do
    holds_tensors: ClassVar[bool] = True

    def __init_subclass__(cls, attr: str | None = None, **kwargs):
        super().__init_subclass__(**kwargs)
        if attr is not None:
            # a class of the same name claiming it again is the same kind defined anew (a reloaded module)
            if attr in KINDS and KINDS[attr].__qualname__ != cls.__qualname__:
                raise TypeError(f"two kinds of state claim the attribute {attr!r}: {KINDS[attr]} and {cls}")
            cls.attr = attr
            KINDS[attr] = cls

    @classmethod
    def of(cls, module: torch.nn.Module):
        """This kind's state on ``module``, or None."""
        return module.__dict__.get(cls.attr)

    def attach(self, module: torch.nn.Module) -> None:
        module.__dict__[self.attr] = self

    @classmethod
    def drop(cls, module: torch.nn.Module) -> None:
        module.__dict__.pop(cls.attr, None)

    def saved(self) -> tuple[dict[str, torch.Tensor], dict]:
        """(tensors, JSON-able metadata) that ``restore`` rebuilds this state from."""
        raise NotImplementedError(f"{type(self).__name__} is not kept in resume checkpoints")

    @classmethod
    def restore(cls, block: torch.nn.Module, name: str, tensors: dict[str, torch.Tensor], meta: dict) -> None:
        """Attach the state ``saved`` described to the submodule ``name`` of ``block``."""
        cls.restored(tensors, meta).attach(block.get_submodule(name))

    @classmethod
    def restored(cls, tensors: dict[str, torch.Tensor], meta: dict):
        raise NotImplementedError

    def rebuilds(self, module: torch.nn.Module) -> list[str]:
        """``module``'s parameters that ``restore`` sets again (a resume checkpoint need not keep them)."""
        return []

    def exported(self, leaf: str, tensor: torch.Tensor) -> torch.Tensor:
        """The module's dense tensor ``leaf`` as an export writes it: the tensor itself, unless this
        state changes how the module computes without changing its tensors (a hook) and must be
        folded into them for the export to compute the same anywhere."""
        return tensor

    def stored_bits(self, module: torch.nn.Module) -> tuple[float, int] | None:
        """(bits the export stores for ``module``'s weight, how many weights that is), or None
        when the weight is stored dense."""
        return None


def states_of(module: torch.nn.Module) -> list[State]:
    """Every state on ``module`` itself (not its children)."""
    return [s for kind in KINDS.values() if (s := kind.of(module)) is not None]


def drop_all(module: torch.nn.Module) -> None:
    """Remove the states that hold tensors from ``module`` and its children (their tensors are being freed)."""
    for sub in module.modules():
        for kind in KINDS.values():
            if kind.holds_tensors:
                kind.drop(sub)


class LoRA(State, attr="lora"):
    """A low-rank correction ``B @ A`` added to a linear's weight (LoRC, QLoRA), exported as a PEFT
    adapter beside the base weights."""

    def __init__(self, B: torch.Tensor, A: torch.Tensor):
        self.B, self.A = B, A

    def saved(self):
        return {"B": self.B, "A": self.A}, {}

    @classmethod
    def restored(cls, tensors, meta):
        return cls(tensors["B"], tensors["A"])
