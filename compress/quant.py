"""Quantization math shared by every pass: schemes, qparams, quantize/dequantize.

Integers use the signed range of compressed-tensors (4 bits: -8..7) and
``w ≈ (q - zero_point) * scale``, so what a pass computes is exactly what the
exported checkpoint dequantizes to. No pass rounds weights by itself.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import ClassVar

import torch

from .state import State

SUPPORTED_BITS = (2, 3, 4, 8)
AUTO_GROUP_SIZES = (128, 64, 32)
OBSERVERS = ("minmax", "mse")
MSE_SHRINKS = [1 - i / 100 for i in range(21)]  # llm-compressor's grid (100 steps, at most 20% shrink)
MSE_NORM = 2.4  # GPTQ's reference code and llm-compressor: between the squared and the largest error


@dataclass(frozen=True)
class QuantScheme:
    """Integer weight quantization: ``group_size=-1`` means one scale per output row."""

    bits: int = 4
    group_size: int = 128
    symmetric: bool = False
    # Scale values are float16 numbers, as GGUF stores them, and when asymmetric have few enough
    # significant bits that Q4_1's minimum -scale*(zero offset) is one too. With float32 storage
    # every dequantized weight is then the same number in our model, the compressed-tensors export
    # and the GGUF file (compress/gguf_file.py).
    fp16_scales: bool = False
    # "minmax": a group's range is its weights' min and max; "mse": the range shrunk by the factor
    # (1, 0.99, ..., 0.80) whose rounding error, summed as |error|^2.4, is smallest (GPTQ's
    # reference code, llm-compressor's and GPTQModel's "mse" observer): clipping a few outliers
    # buys finer steps for the rest
    observer: str = "minmax"

    def __post_init__(self):
        if self.bits not in SUPPORTED_BITS:
            raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {self.bits}")
        if self.group_size != -1 and self.group_size <= 0:
            raise ValueError(f"group_size must be -1 (per channel) or positive, got {self.group_size}")
        if self.observer not in OBSERVERS:
            raise ValueError(f"observer must be one of {OBSERVERS}, got {self.observer!r}")

    @property
    def qmin(self) -> int:
        return -(2 ** (self.bits - 1))

    @property
    def qmax(self) -> int:
        return 2 ** (self.bits - 1) - 1

    def groups(self, in_features: int) -> int:
        return 1 if self.group_size == -1 else in_features // self.group_size

    def bits_per_weight(self, in_features: int, scale_bits: int = 16) -> float:
        """Storage cost per weight including scales and packed zero-points."""
        group = in_features if self.group_size == -1 else self.group_size
        extra = scale_bits + (0 if self.symmetric else self.bits)
        return self.bits + extra / group

    @property
    def scale_significant_bits(self) -> int:
        """float16 has 11 significant bits; Q4_1's minimum is the scale times a zero offset of up to
        ``bits`` bits, so an asymmetric scale keeps 11 - bits of them."""
        return 11 if self.symmetric else 11 - self.bits

    def describe(self) -> str:
        g = "channel" if self.group_size == -1 else f"g{self.group_size}"
        return f"W{self.bits} {g} {'sym' if self.symmetric else 'asym'}" + (" mse" if self.observer == "mse" else "")


@dataclass
class QuantizedWeight(State, attr="quantized"):
    """The integer form of a linear's weight, kept on the module for export (``attach``)."""

    scheme: QuantScheme
    q: torch.Tensor  # int8, same shape as the weight
    scale: torch.Tensor  # (out, groups), in the storage dtype (what the export writes)
    zero_point: torch.Tensor  # (out, groups), int8; zeros when symmetric

    def dequantized(self) -> torch.Tensor:
        """The weight these integers stand for, in the storage dtype (the scale's)."""
        return dequantize(self.q, self.scale, self.zero_point, self.scale.dtype)

    def saved(self):
        return {"q": self.q, "scale": self.scale, "zero_point": self.zero_point}, asdict(self.scheme)

    @classmethod
    def restored(cls, tensors, meta):
        return cls(QuantScheme(**meta), tensors["q"], tensors["scale"], tensors["zero_point"])

    @classmethod
    def restore(cls, block, name, tensors, meta) -> None:
        attach(block.get_submodule(name), cls.restored(tensors, meta))

    def rebuilds(self, module: torch.nn.Module) -> list[str]:
        return ["weight"] if torch.equal(module.weight, self.dequantized().to(module.weight)) else []

    def stored_bits(self, module):
        n = self.q.numel()
        return self.scheme.bits_per_weight(self.q.shape[1], 8 * self.scale.element_size()) * n, n


def resolve_group_size(group_size: int | str, in_features: list[int]) -> int:
    """``auto`` -> the largest of 128/64/32 that divides every width; else checked as given."""
    if group_size == "auto":
        for g in AUTO_GROUP_SIZES:
            if all(n % g == 0 for n in in_features):
                return g
        return -1
    return int(group_size)


def compute_qparams(w: torch.Tensor, scheme: QuantScheme, dtype: torch.dtype):
    """Scale and zero-point per group of ``w`` (out, in) -> (out, groups) each, from the group's
    range: its min and max, or with ``scheme.observer == "mse"`` the shrunk range that rounds best.

    The scale is rounded to ``dtype`` (the storage dtype) here, so quantizing with
    it gives the integers that the exported checkpoint will dequantize.
    """
    out_features, in_features = w.shape
    groups = scheme.groups(in_features)
    wg = w.float().reshape(out_features, groups, -1)
    wmin = wg.amin(-1).clamp(max=0)
    wmax = wg.amax(-1).clamp(min=0)
    if scheme.observer == "minmax":
        return _range_qparams(wmin, wmax, scheme, dtype)
    w = w.float()
    best_error = best_scale = best_zero = None
    for shrink in MSE_SHRINKS:
        scale, zero = _range_qparams(wmin * shrink, wmax * shrink, scheme, dtype)
        rounded = dequantize(quantize(w, scale, zero, scheme), scale, zero, torch.float32)
        error = (rounded - w).reshape(wg.shape).abs().pow(MSE_NORM).sum(-1)
        if best_error is None:
            best_error, best_scale, best_zero = error, scale, zero
            continue
        better = error < best_error
        best_error = torch.where(better, error, best_error)
        best_scale, best_zero = torch.where(better, scale, best_scale), torch.where(better, zero, best_zero)
    return best_scale, best_zero


def _range_qparams(wmin: torch.Tensor, wmax: torch.Tensor, scheme: QuantScheme, dtype: torch.dtype):
    """Scale and zero-point that map [wmin, wmax] (wmin <= 0 <= wmax) onto the integer grid."""
    if scheme.symmetric:
        scale = torch.maximum(wmax, -wmin) / ((scheme.qmax - scheme.qmin) / 2)
    else:
        scale = (wmax - wmin) / (scheme.qmax - scheme.qmin)
    scale = scale.clamp(min=1e-8).to(dtype).float()
    if scheme.fp16_scales:
        scale = round_significand(scale, scheme.scale_significant_bits)
    if scheme.symmetric:
        zero = torch.zeros_like(scale)
    else:
        zero = (scheme.qmin - torch.round(wmin / scale)).clamp(scheme.qmin, scheme.qmax)
    return scale, zero


def round_significand(x: torch.Tensor, bits: int) -> torch.Tensor:
    """``x`` (positive) rounded to ``bits`` significant bits within float16's normal range: a
    float16 number, whose products with integers of up to 11 - ``bits`` bits are float16 too."""
    x = x.float().clamp(min=2.0**-14, max=65504.0)
    mantissa, exponent = torch.frexp(x)  # x = mantissa * 2^exponent, 0.5 <= mantissa < 1
    return torch.ldexp(torch.round(torch.ldexp(mantissa, torch.tensor(bits))), exponent - bits).clamp(max=65504.0)


def quantize(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
    """Integers (int8) for ``w`` given per-group ``scale``/``zero`` of shape (out, groups)."""
    out_features, in_features = w.shape
    wg = w.float().reshape(out_features, scale.shape[1], -1)
    q = torch.round(wg / scale.float().unsqueeze(-1)) + zero.float().unsqueeze(-1)
    return q.clamp(scheme.qmin, scheme.qmax).reshape(out_features, in_features).to(torch.int8)


def dequantize(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    out_features, in_features = q.shape
    qg = q.float().reshape(out_features, scale.shape[1], -1) - zero.float().unsqueeze(-1)
    return (qg * scale.float().unsqueeze(-1)).reshape(out_features, in_features).to(dtype)


def quantize_weight(w: torch.Tensor, scheme: QuantScheme, dtype: torch.dtype) -> QuantizedWeight:
    """Round-to-nearest with min/max qparams: the baseline every method is compared to."""
    scale, zero = compute_qparams(w, scheme, dtype)
    q = quantize(w, scale, zero, scheme)
    return QuantizedWeight(scheme, q, scale.to(dtype), zero.to(torch.int8))


def fake_quantize(w: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
    """Round-to-nearest and back, in float32: what a search scores a candidate by."""
    qw = quantize_weight(w, scheme, torch.float32)
    return dequantize(qw.q, qw.scale, qw.zero_point, torch.float32)


def attach(linear: torch.nn.Linear, qw: QuantizedWeight) -> None:
    """Store the integer form on the module and make its weight the dequantized value.

    The value is rounded to the storage dtype (the scale's) even while the block computes
    in float32, so the weight is bit for bit what the export reloads to.
    """
    linear.weight.data = qw.dequantized().to(linear.weight.dtype)
    qw.attach(linear)


def quantized_of(linear: torch.nn.Module) -> QuantizedWeight | None:
    return QuantizedWeight.of(linear)


@dataclass(frozen=True)
class ActivationScheme(State, attr="input_quant"):
    """Dynamic symmetric integer activations: a scale per token (row), or one per tensor. Attached
    to a linear, it makes the linear see its input as the integer kernel would (a pre-hook)."""

    bits: int = 8
    per_token: bool = True

    holds_tensors: ClassVar[bool] = False

    def describe(self) -> str:
        return f"A{self.bits} {'per-token' if self.per_token else 'per-tensor'} dynamic"

    def attach(self, module: torch.nn.Module) -> None:
        if ActivationScheme.of(module) is None:
            module.register_forward_pre_hook(_quantize_input)
        super().attach(module)

    def saved(self):
        return {}, asdict(self)

    @classmethod
    def restored(cls, tensors, meta):
        return cls(**meta)


def fake_quantize_activation(x: torch.Tensor, scheme: ActivationScheme) -> torch.Tensor:
    """What an int8 matmul would see of ``x``: rounded with a scale from its current max |x|
    (the compressed-tensors convention: ``scale = max|x| / ((2^b - 1) / 2)``)."""
    qmax = 2 ** (scheme.bits - 1) - 1
    amax = x.abs().amax(-1, keepdim=True) if scheme.per_token else x.abs().amax()
    scale = (amax.float() / ((2**scheme.bits - 1) / 2)).clamp(min=1e-8)
    return (torch.round(x.float() / scale).clamp(-qmax - 1, qmax) * scale).to(x.dtype)


def _quantize_input(module: torch.nn.Module, args: tuple):
    return (fake_quantize_activation(args[0], ActivationScheme.of(module)), *args[1:])


def input_quant_of(linear: torch.nn.Module) -> ActivationScheme | None:
    return ActivationScheme.of(linear)
