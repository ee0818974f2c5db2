"""Quantized activations: each targeted linear sees its input rounded as the serving kernel rounds
it, so that evaluation measures the model the server runs.

- ``format: fp8``: E4M3 with a scale per token computed as the input arrives (``strategy:
  token``, dynamic), one per tensor (``tensor``), or one per tensor calibrated here on the
  calibration data (``static: true``, the largest |x| seen). With FP8 weights before it this is
  compressed-tensors' ``FP8_DYNAMIC`` (or, static, ``FP8``), which vLLM runs on FP8 tensor cores;
  with symmetric INT4 weights it is ``W4AFP8``.
- ``format: nvfp4``: E2M1 with a dynamic FP8 scale per 16 values under a global scale calibrated
  here (compressed-tensors' ``NVFP4``, W4A4 with NVFP4 weights).
- ``format: mxfp4``: E2M1 with a dynamic power-of-two scale per 32 values (``MXFP4``, with MXFP4 weights).
- ``format: int``: symmetric integers (``bits`` 8 or 4) with a dynamic scale per token, after
  symmetric integer weights: compressed-tensors' ``W4A8`` / ``W4A4`` with int4 weights (``W8A8``
  itself is ``smoothquant``'s). Outlier channels decide each token's scale, so below 8 bits this
  wants a ``rotate`` pass first (QuaRot).

Evaluation simulates the rounding exactly (``quant.fake_quantize_activation``, a pre-hook); the
export names it as ``input_activations`` and stores the calibrated scale beside the weights.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import model_validator

from .. import distributed
from ..quant import ActivationScheme, InputScale
from .base import LinearOptions, LinearPass

# activation format -> the weight grids it runs with (one kernel, one export format)
WEIGHTS_FOR = {
    "fp8": "fp8 weights, or symmetric int4 (W4AFP8)",
    "nvfp4": "nvfp4 weights",
    "mxfp4": "mxfp4 weights",
    "int": "symmetric int weights of 2 to 4 bits (W4A8, W4A4; int8 weights: smoothquant)",
}


class ActivationOptions(LinearOptions):
    format: Literal["fp8", "nvfp4", "mxfp4", "int"] = "fp8"
    bits: Literal[4, 8] = 8  # int: the integers' width (fp8 is 8 bits, nvfp4 and mxfp4 4)
    # fp8: a scale per token, per token and group of 128 values (with fp8_block weights), or one per tensor
    strategy: Literal["token", "group", "tensor"] = "token"
    static: bool = False  # fp8, per tensor: one scale calibrated on the calibration data

    @model_validator(mode="after")
    def _one_way(self):
        fields = self.model_fields_set
        if self.format != "fp8" and fields & {"strategy", "static"}:
            what = "per token" if self.format == "int" else "per group"
            raise ValueError(f"{self.format} activations have a dynamic scale {what}; strategy and static are fp8's")
        if self.format != "int" and "bits" in fields:
            raise ValueError(f"bits is for int activations; {self.format} has its own width")
        if self.static and self.strategy == "token":
            raise ValueError("a static scale is one per tensor; with static: true set strategy: tensor")
        return self


class _LargestInput:
    """The largest |x| a linear reads over the calibration data."""

    def __init__(self, linear: torch.nn.Linear):
        self.max = torch.zeros((), device=linear.weight.device)

    def add(self, x: torch.Tensor) -> None:
        self.max = torch.maximum(self.max, x.detach().abs().amax().float())

    def reduce(self) -> None:
        distributed.max_(self.max)


def _fits(scheme: ActivationScheme, weights) -> bool:
    if weights is None:
        return False
    if scheme.format == "int":  # W4A8, W4A4: the int8 case with int8 weights is SmoothQuant's W8A8
        return weights.format == "int" and weights.bits <= 4 and weights.symmetric
    if scheme.format == "fp8":  # FP8 weights, or W4AFP8
        return weights.format in ("fp8", "fp8_block") or (
            weights.format == "int" and weights.bits == 4 and weights.symmetric
        )
    return weights.format == scheme.format


class Activations(LinearPass):
    name = "activations"
    Options = ActivationOptions
    compresses = False  # the weights stay as the passes before it left them
    leaves = frozenset({"input_quant", "input_scale"})

    def __init__(self, options, where):
        super().__init__(options, where)
        fmt = options.format
        group = {"nvfp4": 16, "mxfp4": 32}.get(fmt, 128 if options.strategy == "group" else None)
        self.scheme = ActivationScheme(
            options.bits if fmt == "int" else 8 if fmt == "fp8" else 4,
            per_token=fmt == "int" or (fmt == "fp8" and options.strategy == "token"),
            format=fmt,
            static=options.static,
            group_size=group,
        )
        self.needs_data = self.scheme.calibrated

    def order_problem(self, before, after):
        rounding = [q.rounding for q in before if q.rounding is not None]
        if not rounding or not _fits(self.scheme, rounding[-1]):
            return (
                f"{self.options.format} activations run with {WEIGHTS_FOR[self.options.format]}; "
                "put a quantization pass with those weights before it"
            )
        return None

    def apply(self, block, data, prefix: str) -> None:
        targets = self.targets(block, prefix)
        largest = data.observe(self.target_groups(targets), _LargestInput) if self.needs_data else {}
        for name, lin in targets.items():
            self.scheme.attach(lin)
            if self.scheme.calibrated:
                InputScale.calibrated(largest[name].max, self.scheme, self.dtype).attach(lin)
        # experts that saw too few tokens take the largest input their block's others saw
        self.block_largest = max((s.max for s in largest.values()), default=None)

    def without_data(self, block, prefix: str) -> None:
        for lin in self.targets(block, prefix, starved=True).values():
            self.scheme.attach(lin)
            if self.scheme.calibrated:
                InputScale.calibrated(self.block_largest, self.scheme, self.dtype).attach(lin)

    def summary(self) -> str:
        return f"activations {self.scheme.describe()}"
