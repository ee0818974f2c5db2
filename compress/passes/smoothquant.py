"""SmoothQuant (Xiao et al. 2023): move activation outliers into the weights, then int8 both.

Per input channel ``j`` of the linears behind one op (norm -> q/k/v, norm -> gate/up,
up -> down): ``s_j = max|X_j|^α / max|W_j|^(1-α)``; the op's output is divided by ``s`` and
the linears' input columns multiplied by it, exactly (AWQ's ``fold``; Gemma's ``1 + w``
norms included). Then every targeted linear reads its input fake-quantized to int8 per
token (or per tensor, the naive baseline), as an int8 kernel would. The weights are rounded
by the pass that follows (``rtn`` or ``gptq`` with ``bits: 8``).
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

from .. import distributed
from ..arch import fold, foldable_scalings
from ..quant import ActivationScheme
from .base import LinearOptions, LinearPass, RecipeError, WeightQuantPass


class SmoothQuantOptions(LinearOptions):
    alpha: float = Field(0.5, ge=0, le=1)  # migration strength: 0 leaves the activations, 1 moves all to weights
    smooth: bool = True  # false: activation quantization alone, the baseline
    activations: Literal["token", "tensor"] = "token"  # a dynamic scale per token, or one per tensor


class _AbsMax:
    def __init__(self, linear: torch.nn.Linear):
        self.max = torch.zeros(linear.in_features, device=linear.weight.device)

    def add(self, x: torch.Tensor) -> None:
        self.max = torch.maximum(self.max, x.reshape(-1, x.shape[-1]).abs().amax(0).float())

    def reduce(self) -> None:
        distributed.max_(self.max)


def smoothing_factors(x_max: torch.Tensor, weights: list[torch.Tensor], alpha: float) -> torch.Tensor:
    w_max = torch.cat([w.float().abs() for w in weights]).amax(0)
    return (x_max.clamp(min=1e-5).pow(alpha) / w_max.clamp(min=1e-5).pow(1 - alpha)).clamp(min=1e-5)


class SmoothQuant(LinearPass):
    name = "smoothquant"
    leaves = frozenset({"input_quant"})
    Options = SmoothQuantOptions

    def __init__(self, options, where):
        super().__init__(options, where)
        self.needs_data = options.smooth
        self.activation = ActivationScheme(8, per_token=options.activations == "token")

    def order_problem(self, before, after):
        """int8 activations need int8 weights after them: W8A8 is one kernel (and one export format)."""
        if not any(isinstance(q, WeightQuantPass) and q.weight_bits == 8 and q.rounding.format == "int" for q in after):
            return "int8 activations need int8 weights; follow it with rtn or gptq, bits: 8"
        return None

    def check(self, model) -> None:
        super().check(model)
        self.mappings = foldable_scalings(model) if self.options.smooth else []
        if self.options.smooth and not self.mappings:
            raise RecipeError(
                f"{self.where}: model_type {self.arch.name!r} has no scaling mapping (a norm or linear whose output "
                "feeds linears that a folded scale leaves exact); set smooth: false"
            )

    def apply(self, block, data, prefix: str) -> None:
        targets = self.targets(block, prefix)
        if self.options.smooth and targets:
            stats = data.observe(self.target_groups(targets), _AbsMax)
            for m in self.mappings:
                observed = [n for n in m.linears if n in stats]
                if not observed:
                    continue
                weights = [block.get_submodule(n).weight for n in m.linears]  # fold scales all of them
                fold(
                    block,
                    m,
                    smoothing_factors(stats[observed[0]].max, weights, self.options.alpha),
                    self.arch.norm_plus_one,
                )
        for lin in targets.values():
            self.activation.attach(lin)

    def summary(self) -> str:
        smoothing = f"smoothquant α={self.options.alpha}" if self.options.smooth else "no smoothing"
        return f"{smoothing}, {self.activation.describe()}"
