"""oneDNN on the CPU: whether it is here and takes bf16 weights, the prompt-sized product, and a
drop-in linear that speeds up transformers' own forward where a script runs it (the engine runs
every decode method; ``kernels.OneDNN`` is its oneDNN format)."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from .. import machine


class OneDNNLinear(nn.Module):
    """An fp32 CPU linear whose multi-row products run on oneDNN with the weight reordered once
    into its blocked layout; single rows stay on MKL's matrix-vector product.

    A few rows cost oneDNN's prepacked product far less than MKL's GEMM, and one row costs MKL's
    GEMV less than oneDNN on small linears: cheap verify rows are what speculation on a CPU
    lives on (measurements: docs/decoder.md, "What a verify row costs"). ``keep_dense`` False
    drops the MKL copy (the lm_head: always oneDNN).
    """

    def __init__(self, linear: nn.Linear, keep_dense: bool = True):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach()))
        self.weight = linear.weight if keep_dense else None
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if flat.shape[0] == 1 and self.weight is not None:
            y = torch.nn.functional.linear(flat, self.weight, self.bias)
        else:
            y = torch.ops.mkldnn._linear_pointwise(flat, self.packed, self.bias, "none", [], "")
        return y.reshape(*x.shape[:-1], self.out_features)


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


@functools.cache
def onednn_bf16_available() -> bool:
    """Whether oneDNN takes bf16 weights on this CPU: it needs AVX-512 (BW/VL/DQ) or AVX-NE-CONVERT,
    so an AVX2-only part (AMD Zen 1–3) runs bf16 through aten's ``F.linear`` instead."""
    if not onednn_available():
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=torch.bfloat16))
    except RuntimeError:
        return False
    return True


@functools.cache
def bf16_arithmetic() -> bool:
    """Whether this CPU multiplies bf16 in hardware (AVX512-BF16 or AMX) and oneDNN uses it: there a
    prompt's bf16 GEMM beats fp32's several times over; elsewhere bf16 is emulated and fp32 is the
    faster (``scripts/bench_decode.py`` shows which on the machine at hand)."""
    return machine.bf16_arithmetic() and onednn_bf16_available()


def prompt_product(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """A prompt's rows (more than ``VERIFY_ROWS``) times bf16 (or fp32) ``weight``, in ``x``'s dtype:
    a bf16 GEMM where the CPU computes bf16 in hardware (``bf16_arithmetic``: the rows are
    rounded to bf16 first, as transformers' bf16 forward rounds them), else fp32's GEMM over an
    upcast copy. Decode steps never come here, so a prompt's rounding moves no verify step."""
    if bf16_arithmetic():
        return F.linear(x.to(torch.bfloat16), weight.to(torch.bfloat16)).to(x.dtype)
    return F.linear(x.float(), weight.float()).to(x.dtype)


def use_onednn(model: nn.Module) -> int:
    """Swap every plain fp32 CPU linear for a ``OneDNNLinear`` (in place); returns how many.
    Decoding only: the swapped linears do not train."""
    if not onednn_available():
        return 0
    output = model.get_output_embeddings()
    swaps = [
        (name, m)
        for name, m in model.named_modules()
        if type(m) is nn.Linear and m.weight.dtype == torch.float32 and m.weight.device.type == "cpu"
    ]
    for name, linear in swaps:
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent), leaf, OneDNNLinear(linear, keep_dense=linear is not output))
    return len(swaps)
