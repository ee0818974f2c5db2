"""Quantization math shared by every pass: schemes, qparams, quantize/dequantize.

Integers use the signed range of compressed-tensors (4 bits: -8..7) and
``w ≈ (q - zero_point) * scale``, so what a pass computes is exactly what the
exported checkpoint dequantizes to. No pass rounds weights by itself.

Float formats put ``q`` on a float grid instead (``w ≈ q * scale``, symmetric), as GPU servers
run them: ``fp8`` (E4M3 values, a scale per output channel in the storage dtype), ``fp8_block``
(E4M3 values, one scale per tile of 128 × 128 weights: ``scale`` holds it on each of the tile's
rows, so every reader of a scale per row and group works unchanged), ``nvfp4``
(E2M1 values; a scale per 16 weights stored as FP8 E4M3 under one float32 global scale per
tensor, ``scale = fp8 / global``) and ``mxfp4`` (E2M1 values, a power-of-two scale per 32
weights). Each scale is rounded to what the format stores *before* any weight is rounded with
it, so GPTQ's sweep and every search see the weights the export holds.

llama.cpp's k-quants (``q2_k`` ... ``q6_k``) are integer grids whose group scales sit on a grid of
their own, one float16 scale per 256 weights (``compress/kquant.py``); those with a minimum store
it as a float (``w = q * scale - zero_point``), which no integer zero-point can hold.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import ClassVar

import torch

from . import kquant
from .state import State

SUPPORTED_BITS = (2, 3, 4, 5, 8)  # 5: GGUF's Q5_0 and Q5_1, which k-quants fall back to
# format -> (bits, group size it fixes (None: any), largest grid value)
FORMATS = {
    "int": (None, None, None),
    "fp8": (8, -1, 448.0),
    "fp8_block": (8, 128, 448.0),
    "nvfp4": (4, 16, 6.0),
    "mxfp4": (4, 32, 6.0),
} | {name: (t.bits, t.group, None) for name, t in kquant.TYPES.items()}
FLOAT_FORMATS = ("fp8", "fp8_block", "nvfp4", "mxfp4")
BLOCK_ROWS = 128  # fp8_block's tiles are BLOCK_ROWS output rows by its group size of inputs
FP4_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])  # E2M1's magnitudes
FP8_MAX = 448.0  # E4M3's largest value
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
    format: str = "int"  # or a float grid: "fp8", "nvfp4", "mxfp4" (module docstring)

    def __post_init__(self):
        if self.bits not in SUPPORTED_BITS and not (self.is_kquant and self.bits == FORMATS[self.format][0]):
            raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {self.bits}")
        if self.group_size != -1 and self.group_size <= 0:
            raise ValueError(f"group_size must be -1 (per channel) or positive, got {self.group_size}")
        if self.observer not in OBSERVERS:
            raise ValueError(f"observer must be one of {OBSERVERS}, got {self.observer!r}")
        if self.format not in FORMATS:
            raise ValueError(f"format must be one of {tuple(FORMATS)}, got {self.format!r}")
        bits, group, _ = FORMATS[self.format]
        if self.is_float and (self.bits, self.group_size, self.symmetric) != (bits, group, True):
            raise ValueError(f"{self.format} is {bits}-bit symmetric with group size {group}")
        if self.is_kquant:
            symmetric = kquant.TYPES[self.format].symmetric
            if (self.bits, self.group_size, self.symmetric) != (bits, group, symmetric):
                kind = "symmetric" if symmetric else "asymmetric"
                raise ValueError(f"{self.format} is {bits}-bit {kind} with group size {group}")

    @property
    def is_float(self) -> bool:
        return self.format in FLOAT_FORMATS

    @property
    def is_kquant(self) -> bool:
        return self.format in kquant.TYPES

    @property
    def subtracts_minimum(self) -> bool:
        """Whether ``zero_point`` is a float minimum, ``w = q * scale - zero_point`` (k-quants with one)."""
        return self.is_kquant and not self.symmetric

    @property
    def qmin(self) -> float:
        if self.subtracts_minimum:
            return 0
        return -FORMATS[self.format][2] if self.is_float else -(2 ** (self.bits - 1))

    @property
    def qmax(self) -> float:
        if self.subtracts_minimum:
            return 2**self.bits - 1
        return FORMATS[self.format][2] if self.is_float else 2 ** (self.bits - 1) - 1

    @property
    def q_dtype(self) -> torch.dtype:
        """What ``QuantizedWeight.q`` holds: int8 integers, or float grid values (E2M1's are E4M3 numbers too)."""
        return torch.float8_e4m3fn if self.is_float else torch.int8

    def scale_dtype(self, storage: torch.dtype) -> torch.dtype:
        """The dtype of ``QuantizedWeight.scale``: the storage dtype, or float32 where the stored scale
        (FP8 over a global scale, a power of two, a k-quant's product of two codes) is exact in float32 only."""
        return torch.float32 if self.format in ("nvfp4", "mxfp4") or self.is_kquant else storage

    @property
    def zero_dtype(self) -> torch.dtype:
        """The dtype of ``QuantizedWeight.zero_point``: int8, or float32 for a k-quant's minimum."""
        return torch.float32 if self.subtracts_minimum else torch.int8

    @property
    def stored_scale_bits(self) -> int | None:
        """Bits the format stores per scale (None: the storage dtype's); a GGUF file's float16 scales
        count as the file stores them, whatever the storage dtype of the weights beside it."""
        if self.format in ("nvfp4", "mxfp4"):
            return 8
        return 16 if self.fp16_scales else None

    def groups(self, in_features: int) -> int:
        return 1 if self.group_size == -1 else in_features // self.group_size

    def bits_per_weight(self, in_features: int, scale_bits: int = 16) -> float:
        """Storage cost per weight including scales and packed zero-points."""
        if self.is_kquant:
            return kquant.TYPES[self.format].bits_per_weight
        group = in_features if self.group_size == -1 else self.group_size
        group *= BLOCK_ROWS if self.format == "fp8_block" else 1
        extra = scale_bits + (0 if self.symmetric else self.bits)
        return self.bits + extra / group

    @property
    def scale_significant_bits(self) -> int:
        """float16 has 11 significant bits; Q4_1's minimum is the scale times a zero offset of up to
        ``bits`` bits, so an asymmetric scale keeps 11 - bits of them."""
        return 11 if self.symmetric else 11 - self.bits

    def describe(self) -> str:
        g = "channel" if self.group_size == -1 else f"g{self.group_size}"
        g = f"{BLOCK_ROWS}x{self.group_size}" if self.format == "fp8_block" else g
        mse = " mse" if self.observer == "mse" else ""
        if self.is_float:
            return f"{self.format.upper()} {g}{mse}"
        if self.is_kquant:
            return f"GGUF {self.format.upper()}{mse}"
        return f"W{self.bits} {g} {'sym' if self.symmetric else 'asym'}{mse}"


@dataclass
class QuantizedWeight(State, attr="quantized"):
    """The integer form of a linear's weight, kept on the module for export (``attach``)."""

    scheme: QuantScheme
    q: torch.Tensor  # same shape as the weight: int8 integers, or float grid values (``QuantScheme.q_dtype``)
    scale: torch.Tensor  # (out, groups), in ``scheme.scale_dtype(storage dtype)`` (what the export writes)
    zero_point: torch.Tensor  # (out, groups), int8, zeros when symmetric; a k-quant's float32 minimum
    # nvfp4: the tensor's float32 global scale (``scale`` is fp8 / it); a k-quant: (out, super-blocks, 2),
    # each super-block's float16 (d, dmin) that its group scales and minimums are multiples of
    global_scale: torch.Tensor | None = None

    def dequantized(self) -> torch.Tensor:
        """The weight these integers stand for, in the scale's dtype (the storage dtype, or float32)."""
        return dequantize(self.q, self.scale, self.zero_point, self.scale.dtype, self.scheme)

    def saved(self):
        tensors = {"q": self.q, "scale": self.scale, "zero_point": self.zero_point}
        if self.global_scale is not None:
            tensors["global_scale"] = self.global_scale
        return tensors, asdict(self.scheme)

    @classmethod
    def restored(cls, tensors, meta):
        scheme = QuantScheme(**meta)
        return cls(scheme, tensors["q"], tensors["scale"], tensors["zero_point"], tensors.get("global_scale"))

    @classmethod
    def restore(cls, block, name, tensors, meta) -> None:
        attach(block.get_submodule(name), cls.restored(tensors, meta))

    def rebuilds(self, module: torch.nn.Module) -> list[str]:
        return ["weight"] if torch.equal(module.weight, self.dequantized().to(module.weight)) else []

    def stored_bits(self, module):
        n = self.q.numel()
        scale_bits = self.scheme.stored_scale_bits or 8 * self.scale.element_size()
        return self.scheme.bits_per_weight(self.q.shape[1], scale_bits) * n, n


def resolve_group_size(group_size: int | str, in_features: list[int]) -> int:
    """``auto`` -> the largest of 128/64/32 that divides every width; else checked as given."""
    if group_size == "auto":
        for g in AUTO_GROUP_SIZES:
            if all(n % g == 0 for n in in_features):
                return g
        return -1
    return int(group_size)


def global_scale_for(w: torch.Tensor, scheme: QuantScheme) -> torch.Tensor | None:
    """The scale over ``w``'s group scales that its format stores, chosen before any group's:
    NVFP4's global scale, a k-quant's super-block scales; None for the other formats."""
    if scheme.format == "nvfp4":
        return global_scale_of(w)
    if scheme.is_kquant:
        groups = w.float().reshape(w.shape[0], scheme.groups(w.shape[1]), -1)
        scale, minimum = _kquant_range(groups.amin(-1).clamp(max=0), groups.amax(-1).clamp(min=0), scheme)
        return kquant.super_scales(scale, minimum, kquant.TYPES[scheme.format])
    return None


def _kquant_range(wmin: torch.Tensor, wmax: torch.Tensor, scheme: QuantScheme):
    """A k-quant group's scale and minimum (``w = q * scale - minimum``) before they are rounded."""
    if scheme.symmetric:
        return torch.maximum(wmax, -wmin) / ((scheme.qmax - scheme.qmin) / 2), torch.zeros_like(wmax)
    return (wmax - wmin) / scheme.qmax, -wmin


def global_scale_of(w: torch.Tensor) -> torch.Tensor:
    """NVFP4's float32 global scale for ``w``: its largest group scale (max |w| / 6) maps to FP8's
    largest value, so the FP8 group scales use their whole range (compressed-tensors' convention,
    ``scale = fp8 / global``)."""
    return (FP8_MAX * FORMATS["nvfp4"][2] / w.detach().float().abs().amax().clamp(min=1e-12)).reshape(1)


def compute_qparams(w: torch.Tensor, scheme: QuantScheme, dtype: torch.dtype, global_scale=None):
    """Scale and zero-point per group of ``w`` (out, in) -> (out, groups) each, from the group's
    range: its min and max, or with ``scheme.observer == "mse"`` the shrunk range that rounds best.

    The scale is rounded to ``dtype`` (the storage dtype), or to what a float format stores, here,
    so quantizing with it gives the values that the exported checkpoint will dequantize. NVFP4's
    and the k-quants' scales sit under ``global_scale`` (default: ``global_scale_for(w)``; a sweep
    over a slice of the weight passes the whole weight's, for a k-quant those of the slice's groups).
    """
    if global_scale is None:
        global_scale = global_scale_for(w, scheme)
    out_features, in_features = w.shape
    groups = scheme.groups(in_features)
    wg = w.float().reshape(out_features, groups, -1)
    wmin = per_block(wg.amin(-1).clamp(max=0), scheme, torch.amin)
    wmax = per_block(wg.amax(-1).clamp(min=0), scheme, torch.amax)
    if scheme.observer == "minmax":
        return _range_qparams(wmin, wmax, scheme, dtype, global_scale)
    w = w.float()
    best_error = best_scale = best_zero = None
    for shrink in MSE_SHRINKS:
        scale, zero = _range_qparams(wmin * shrink, wmax * shrink, scheme, dtype, global_scale)
        rounded = dequantize(quantize(w, scale, zero, scheme), scale, zero, torch.float32, scheme)
        error = per_block((rounded - w).reshape(wg.shape).abs().pow(MSE_NORM).sum(-1), scheme, torch.sum)
        if best_error is None:
            best_error, best_scale, best_zero = error, scale, zero
            continue
        better = error < best_error
        best_error = torch.where(better, error, best_error)
        best_scale, best_zero = torch.where(better, scale, best_scale), torch.where(better, zero, best_zero)
    return best_scale, best_zero


def per_block(t: torch.Tensor, scheme: QuantScheme, reduce) -> torch.Tensor:
    """``t`` (out, groups) reduced over each fp8_block tile's rows and held on every one of them; else ``t``."""
    if scheme.format != "fp8_block":
        return t
    out_features, groups = t.shape
    tiles = reduce(t.reshape(out_features // BLOCK_ROWS, BLOCK_ROWS, groups), 1, keepdim=True)
    return tiles.expand(-1, BLOCK_ROWS, -1).reshape(out_features, groups)


def _range_qparams(wmin: torch.Tensor, wmax: torch.Tensor, scheme: QuantScheme, dtype: torch.dtype, global_scale=None):
    """Scale and zero-point that map [wmin, wmax] (wmin <= 0 <= wmax) onto the grid."""
    if scheme.is_kquant:
        return kquant.snap(*_kquant_range(wmin, wmax, scheme), kquant.TYPES[scheme.format], global_scale)
    if scheme.is_float:
        return _float_scale(torch.maximum(wmax, -wmin), scheme, dtype, global_scale), torch.zeros_like(wmax)
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


def _float_scale(amax: torch.Tensor, scheme: QuantScheme, dtype: torch.dtype, global_scale) -> torch.Tensor:
    """The scale that maps ``amax`` to the grid's largest value, as the format stores it (float32)."""
    scale = amax.float() / scheme.qmax
    if scheme.format == "nvfp4":  # an FP8 E4M3 number (2^-9 its smallest) over the global scale
        fp8 = (scale * global_scale).clamp(min=2.0**-9, max=FP8_MAX).to(torch.float8_e4m3fn)
        return fp8.float() / global_scale
    if scheme.format == "mxfp4":  # E8M0: the power of two that leaves no weight beyond the grid
        return torch.exp2(torch.ceil(torch.log2(scale.clamp(min=2.0**-126))).clamp(-126, 127))
    return scale.clamp(min=1e-8).to(dtype).float()


def to_grid(x: torch.Tensor, zero: torch.Tensor | None, scheme: QuantScheme, even_ties: bool = False) -> torch.Tensor:
    """``x`` (values over their scale, float32) rounded onto the scheme's grid: integers plus the
    zero-point, or the nearest float value (E4M3 by round-to-nearest-even). An E2M1 tie goes to the
    smaller magnitude, or with ``even_ties`` to the even code, as FP4 kernels round activations
    (for a weight either is as close; the stored code is what every reader dequantizes)."""
    if not scheme.is_float:
        return (torch.round(x) + zero).clamp(scheme.qmin, scheme.qmax)
    if scheme.bits == 8:
        return x.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()
    # E2M1's values are multiples of 0.5 up to 2, of 1 up to 4, of 2 up to 6: round on that step
    # (a power of two, so the divisions are exact); a tie rounds down, or to the even code
    magnitude = x.abs().clamp(max=FP4_VALUES[-1].item())
    step = torch.where(magnitude <= 2, 0.5, torch.where(magnitude <= 4, 1.0, 2.0))
    steps = torch.round(magnitude / step) if even_ties else torch.ceil(magnitude / step - 0.5).abs()  # not -0
    return steps * step * torch.sign(x)


def round_significand(x: torch.Tensor, bits: int) -> torch.Tensor:
    """``x`` (positive) rounded to ``bits`` significant bits within float16's normal range: a
    float16 number, whose products with integers of up to 11 - ``bits`` bits are float16 too."""
    x = x.float().clamp(min=2.0**-14, max=65504.0)
    mantissa, exponent = torch.frexp(x)  # x = mantissa * 2^exponent, 0.5 <= mantissa < 1
    return torch.ldexp(torch.round(torch.ldexp(mantissa, torch.tensor(bits))), exponent - bits).clamp(max=65504.0)


def grid_codes(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
    """``w`` rounded onto the grid of ``scale`` and ``zero`` (broadcast against it), as float32 codes."""
    if scheme.subtracts_minimum:
        return torch.round((w.float() + zero.float()) / scale.float()).clamp(scheme.qmin, scheme.qmax)
    return to_grid(w.float() / scale.float(), zero.float(), scheme)


def grid_values(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, scheme: QuantScheme | None = None):
    """The weights ``codes`` stand for, in float32, computed as every reader of the format does."""
    if scheme is not None and scheme.subtracts_minimum:
        return codes.float() * scale.float() - zero.float()
    return (codes.float() - zero.float()) * scale.float()


def quantize(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
    """Grid values (``scheme.q_dtype``: int8 integers, or float values) for ``w`` given per-group
    ``scale``/``zero`` of shape (out, groups)."""
    out_features, in_features = w.shape
    wg = w.float().reshape(out_features, scale.shape[1], -1)
    q = grid_codes(wg, scale.unsqueeze(-1), zero.unsqueeze(-1), scheme)
    return q.reshape(out_features, in_features).to(scheme.q_dtype)


def dequantize(q, scale: torch.Tensor, zero: torch.Tensor, dtype: torch.dtype, scheme: QuantScheme | None = None):
    """The weight of codes ``q`` under per-group ``scale``/``zero``; ``scheme`` only matters for the
    k-quants with a minimum (the others share ``(q - zero) * scale``)."""
    out_features, in_features = q.shape
    qg = q.reshape(out_features, scale.shape[1], -1)
    return grid_values(qg, scale.unsqueeze(-1), zero.unsqueeze(-1), scheme).reshape(out_features, in_features).to(dtype)


def quantize_weight(w: torch.Tensor, scheme: QuantScheme, dtype: torch.dtype, global_scale=None) -> QuantizedWeight:
    """Round-to-nearest with min/max qparams: the baseline every method is compared to."""
    if global_scale is None:
        global_scale = global_scale_for(w, scheme)
    scale, zero = compute_qparams(w, scheme, dtype, global_scale)
    q = quantize(w, scale, zero, scheme)
    return QuantizedWeight(scheme, q, scale.to(scheme.scale_dtype(dtype)), zero.to(scheme.zero_dtype), global_scale)


def fake_quantize(w: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
    """Round-to-nearest and back, in float32: what a search scores a candidate by."""
    qw = quantize_weight(w, scheme, torch.float32)
    return qw.dequantized().float()


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
    """How a linear's input is rounded before its matmul, as the serving kernel rounds it: integers
    or FP8 E4M3 with a dynamic scale per token (row) or per tensor; FP8 with one per-tensor scale
    calibrated beforehand (``static``); or NVFP4 / MXFP4 with a dynamic scale per 16 / 32 values,
    NVFP4's under a calibrated global scale. A calibrated scale is an ``InputScale`` beside it.
    Attached to a linear, it makes the linear see its input as the kernel would (a pre-hook)."""

    bits: int = 8
    per_token: bool = True
    format: str = "int"  # or "fp8", "nvfp4", "mxfp4"
    static: bool = False  # fp8 per tensor: the scale is calibrated, not taken from each input
    group_size: int | None = None  # values per dynamic scale along each token: nvfp4 16, mxfp4 32, fp8 128 or none

    holds_tensors: ClassVar[bool] = False

    @property
    def calibrated(self) -> bool:
        """Whether it needs an ``InputScale`` measured on calibration data."""
        return self.static or self.format == "nvfp4"

    def describe(self) -> str:
        if self.group_size is not None:
            return f"A{self.bits} {self.format.upper()} g{self.group_size} dynamic"
        kind = "FP8 " if self.format == "fp8" else ""
        how = "static" if self.static else "dynamic"
        return f"A{self.bits} {kind}{'per-token' if self.per_token else 'per-tensor'} {how}"

    def attach(self, module: torch.nn.Module) -> None:
        if ActivationScheme.of(module) is None:
            module.register_forward_pre_hook(_quantize_input)
        super().attach(module)

    def saved(self):
        return {}, asdict(self)

    @classmethod
    def restored(cls, tensors, meta):
        return cls(**meta)


class InputScale(State, attr="input_scale"):
    """A linear's input scale calibrated on the calibration data (the largest |x| seen): FP8's static
    per-tensor scale (``max|x| / 448``), or NVFP4's float32 global scale (``448 * 6 / max|x|``, as
    for weights, so that the FP8 scale of the largest group uses FP8's whole range)."""

    holds_tensors: ClassVar[bool] = False  # a scalar that the pre-hook reads as long as it stays

    def __init__(self, value: torch.Tensor):
        self.value = value.float().reshape(1)

    @classmethod
    def calibrated(cls, amax: torch.Tensor, scheme: ActivationScheme, dtype: torch.dtype) -> InputScale:
        """From the largest |x| seen; FP8's scale rounded to the storage ``dtype``, as transformers holds
        it (NVFP4's global scale stays float32 there)."""
        amax = amax.float().clamp(min=1e-12)
        if scheme.format == "nvfp4":
            return cls(FP8_MAX * FORMATS["nvfp4"][2] / amax)
        return cls((amax / FP8_MAX).to(dtype))

    def saved(self):
        return {"value": self.value}, {}

    @classmethod
    def restored(cls, tensors, meta):
        return cls(tensors["value"])


_FP4_SCHEMES = {f: QuantScheme(4, FORMATS[f][1], True, format=f) for f in ("nvfp4", "mxfp4")}


def round_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x`` rounded to E4M3 times ``scale`` (broadcast), computed in float32 as FP8 kernels quantize."""
    scale = scale.float().clamp(min=1e-12).to(x.device)
    return ((x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * scale).to(x.dtype)


def fake_quantize_activation(
    x: torch.Tensor, scheme: ActivationScheme, calibrated: InputScale | None = None
) -> torch.Tensor:
    """What the kernel's matmul sees of ``x``, in compressed-tensors' conventions (which transformers
    simulates too): integers with ``scale = max|x| / ((2^b - 1) / 2)``; FP8 with ``max|x| / 448``
    per token, per token and group, per tensor, or calibrated (static); FP4 per group of 16 / 32
    values with the weights' NVFP4 scale (an FP8 number over the calibrated global scale) or MX's
    power of two, which for activations follows the OCP rule the kernels use (the group's max
    rounded to E2M1's precision, its exponent less 2: a few values past 6 clip, unlike our weights'
    scales, which never clip)."""
    if scheme.group_size is not None:
        groups = x.unflatten(-1, (-1, scheme.group_size))
        amax = groups.float().abs().amax(-1, keepdim=True)
        if scheme.format == "fp8":
            return round_fp8(groups, amax / FP8_MAX).flatten(-2)
        fp4 = _FP4_SCHEMES[scheme.format]
        if scheme.format == "nvfp4":
            scale = _float_scale(amax, fp4, torch.float32, calibrated.value.to(x.device))
        else:
            mantissa, exponent = torch.frexp(amax)  # amax = mantissa * 2^exponent, 0.5 <= mantissa < 1
            scale = torch.exp2((exponent - 1 + (mantissa >= 0.875).int() - 2).clamp(-127, 127).float())
        return (to_grid(groups.float() / scale, None, fp4, even_ties=True) * scale).flatten(-2).to(x.dtype)
    if scheme.static:
        return round_fp8(x, calibrated.value)
    amax = (x.abs().amax(-1, keepdim=True) if scheme.per_token else x.abs().amax()).float()
    if scheme.format == "fp8":
        return round_fp8(x, amax / FP8_MAX)
    qmax = 2 ** (scheme.bits - 1) - 1
    scale = (amax / ((2**scheme.bits - 1) / 2)).clamp(min=1e-8)
    return (torch.round(x.float() / scale).clamp(-qmax - 1, qmax) * scale).to(x.dtype)


def _quantize_input(module: torch.nn.Module, args: tuple):
    return (fake_quantize_activation(args[0], ActivationScheme.of(module), InputScale.of(module)), *args[1:])


def input_quant_of(linear: torch.nn.Module) -> ActivationScheme | None:
    return ActivationScheme.of(linear)
