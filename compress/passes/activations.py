"""Quantized activations: each targeted linear sees its input rounded as the serving kernel rounds
it, FP8 E4M3 with a scale per token computed as the input arrives (dynamic), or one per tensor.

With FP8 weights before it this is compressed-tensors' ``FP8_DYNAMIC`` scheme, which vLLM runs on
FP8 tensor cores (Hopper and newer). Evaluation simulates the rounding exactly (``quant``'s
pre-hook); the export names it as ``input_activations`` and stores nothing for it.
"""

from __future__ import annotations

from typing import Literal

from ..quant import ActivationScheme
from .base import LinearOptions, LinearPass


class ActivationOptions(LinearOptions):
    format: Literal["fp8"] = "fp8"
    strategy: Literal["token", "tensor"] = "token"


class Activations(LinearPass):
    name = "activations"
    Options = ActivationOptions
    needs_data = False
    compresses = False  # the weights stay as the passes before it left them
    leaves = frozenset({"input_quant"})

    def order_problem(self, before, after):
        if not any(q.rounding is not None and q.rounding.format == "fp8" for q in before):
            return "FP8 activations run with FP8 weights; put a quantization pass with format: fp8 before it"
        return None

    def apply(self, block, data, prefix: str) -> None:
        scheme = ActivationScheme(8, per_token=self.options.strategy == "token", format="fp8")
        for lin in self.targets(block, prefix).values():
            scheme.attach(lin)

    def summary(self) -> str:
        return f"activations {ActivationScheme(8, self.options.strategy == 'token', 'fp8').describe()}"
