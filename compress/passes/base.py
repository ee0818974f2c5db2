"""The pass contract and what weight-quantization passes share.

A layer-pass is a class with an ``Options`` model (its YAML keys; typos fail)
and two methods: ``check(model)`` validates against the model's shapes before
any compute, ``apply(block, data, prefix)`` transforms one decoder block. The
pipeline owns the data flow; ``data`` is None for passes with ``needs_data = False``.
"""

from __future__ import annotations

import re
import warnings
from typing import ClassVar, Literal, Union

import torch
from pydantic import BaseModel, ConfigDict, field_validator

from ..arch import arch_of, block_linears, decoder_layers
from ..quant import QuantScheme, resolve_group_size


class RecipeError(ValueError):
    """A recipe that cannot run on this model; the message names the YAML path."""


class PassOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")


class LayerPass:
    name: ClassVar[str]
    Options: ClassVar[type[PassOptions]]
    needs_data: ClassVar[bool] = True

    def __init__(self, options: PassOptions, where: str):
        self.options = options
        self.where = where  # YAML path of this pass, e.g. "passes[0].rtn"

    def check(self, model: torch.nn.Module) -> None:
        pass

    def apply(self, block: torch.nn.Module, data, prefix: str) -> None:
        raise NotImplementedError

    def summary(self) -> str:
        return self.name


def matches(name: str, pattern: str) -> bool:
    """``re:<regex>`` (searched), an exact module name, or a dotted suffix (``lm_head``, ``mlp.down_proj``)."""
    if pattern.startswith("re:"):
        return re.search(pattern[3:], name) is not None
    return name == pattern or name.endswith("." + pattern)


class WeightQuantOptions(PassOptions):
    bits: Literal[2, 3, 4, 8] = 4
    group_size: Union[Literal["auto"], int] = "auto"
    # Symmetric by default: transformers 5 + compressed-tensors 0.20 cannot reload asymmetric
    # pack-quantized checkpoints (vLLM can); see README "Known limits".
    symmetric: bool = True
    ignore: list[str] = ["lm_head"]

    @field_validator("group_size")
    @classmethod
    def _group(cls, v):
        if v != "auto" and v != -1 and v <= 0:
            raise ValueError("must be auto, -1 (one scale per output channel) or a positive group size")
        return v


class WeightQuantPass(LayerPass):
    """Shared target selection and group-size validation for weight quantizers."""

    Options = WeightQuantOptions
    scheme: QuantScheme
    dtype: torch.dtype

    def targets(self, block: torch.nn.Module, prefix: str) -> dict[str, torch.nn.Linear]:
        return {name: lin for name, lin in block_linears(block, self.arch).items()
                if not any(matches(prefix + name, p) for p in self.options.ignore)}

    def target_groups(self, targets: dict) -> list[tuple[str, ...]]:
        """The architecture's input-sharing groups restricted to ``targets``, in forward order."""
        return [g for g in (tuple(n for n in grp if n in targets) for grp in self.arch.groups) if g]

    def check(self, model: torch.nn.Module) -> None:
        self.arch = arch_of(model)
        self.dtype = model.dtype  # storage dtype: scales are rounded to it (blocks may compute in float32)
        prefix = self.arch.layers + "."
        all_names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
        for pattern in self.options.ignore:
            if not any(matches(n, pattern) for n in all_names):
                warnings.warn(f"{self.where}.ignore: pattern {pattern!r} matches no linear layer", stacklevel=2)
        targeted = {}
        for i, block in enumerate(decoder_layers(model)):
            for name, lin in self.targets(block, f"{prefix}{i}.").items():
                targeted[f"{prefix}{i}.{name}"] = lin.in_features
        if not targeted:
            raise RecipeError(f"{self.where}.ignore: every linear layer is ignored, the pass would do nothing")
        g = resolve_group_size(self.options.group_size, list(targeted.values()))
        if g != -1:
            bad = sorted({(re.sub(r"\.\d+\.", ".*.", n), w) for n, w in targeted.items() if w % g})
            if bad:
                listed = ", ".join(f"{n} (in_features {w})" for n, w in bad[:4])
                listed += f" and {len(bad) - 4} more" if len(bad) > 4 else ""
                raise RecipeError(
                    f"{self.where}.group_size: {g} does not divide the input width of {listed}; "
                    "use group_size: auto, -1, or a divisor of every width"
                )
        self.scheme = QuantScheme(self.options.bits, g, self.options.symmetric)
        if not self.scheme.symmetric:
            warnings.warn(f"{self.where}.symmetric: false exports zero-points that vLLM reads but transformers "
                          "5 with compressed-tensors 0.20 cannot reload (see README, Known limits)", stacklevel=2)

    def summary(self) -> str:
        return f"{self.name} {self.scheme.describe()}"
