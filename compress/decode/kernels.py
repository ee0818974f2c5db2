"""Weight formats for decoding: one ``Matmul`` class per kernel, registered under the format names
it runs and carrying the traits the engine reads (``takes_bf16``, ``rows_alone``,
``rows_ride_along``, ``rounds_rows``). Which format a group gets is ``choice``'s business.

A ``Matmul`` holds one linear group's weights (q/k/v or gate/up fused by rows) in one format:
fp32 (MKL), fp32 or bf16 prepacked for oneDNN (bf16 on aten where oneDNN takes none: AVX2-only
CPUs), int8 weight-only (``_weight_int8pack_mm``),
torch's packed-int4 CPU kernel (``_weight_int4pack_mm_for_cpu``, tinygemm's layout: ``u = q + 8``,
``zero = −z·scale``, so it computes exactly the weights we evaluate), our own AVX2 kernels for bf16
and W4 weights (``native``: ``bf16-avx2``, ``int4-avx2``, ``int4-a16``), or W8A8 on ``torch._int_mm``
(each row rounded to int8 with its own scale ``max|x| / 127.5``, as compressed-tensors and our
evaluation do), or FP8 weights and inputs on ``torch._scaled_mm`` (each row rounded to E4M3 with
its own scale ``max|x| / 448``, or the calibrated static one, as vLLM's FP8 kernels do). On a GPU:
the model's dtype, tinygemm's CUDA int4 kernel (``_weight_int4pack_mm``, same dequantization, its
own packing) for W4 groups, or FP8's.

The integers come from the linear's ``QuantizedWeight``: left by our passes in the same process,
or read back from an export (``formats.compressed_tensors.attach_integers``); a W8A8 export loaded
by transformers holds its scale and the weight (as int8, or unpacked to q · scale). A ``Matmul``
computes ``x @ Wᵀ + b`` for rows ``x`` in the engine's dtype.
"""

from __future__ import annotations

import functools
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from ..quant import FP8_MAX, InputScale, QuantScheme, dequantize, input_quant_of, quantize_weight, quantized_of
from . import native, onednn
from .onednn import prompt_product

INT4_GROUPS = (32, 64, 128, 256)


def w8a8_integers(linear: nn.Module) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(int8 weight, per-channel scale) of a W8A8 linear with per-token activations: ours
    in-process, or one transformers loaded from an ``int-quantized`` export."""
    if not isinstance(linear, nn.Linear):
        return None
    qw, act = quantized_of(linear), input_quant_of(linear)
    if qw is not None and act is not None:
        ok = qw.scheme.format == act.format == "int" and qw.scheme.bits == 8 and qw.scheme.symmetric
        ok = ok and qw.scale.shape[1] == 1 and act.bits == 8 and act.per_token
        return (qw.q, qw.scale) if ok else None
    scheme = getattr(linear, "quantization_scheme", None)
    if scheme is None or scheme.input_activations is None or not hasattr(linear, "weight_scale"):
        return None
    w, a = scheme.weights, scheme.input_activations
    ok = (
        w.type == a.type == "int"
        and w.num_bits == 8
        and w.symmetric
        and str(w.strategy).endswith("channel")
        and a.num_bits == 8
        and a.symmetric
        and a.dynamic
        and str(a.strategy).endswith("token")
    )
    if not ok:
        return None
    scale = linear.weight_scale.data
    # ``models.load_model`` unpacks exports to float (q · scale); dividing back is exact for |q| ≤ 127
    q = linear.weight.data if linear.weight.dtype == torch.int8 else torch.round(linear.weight.data / scale)
    return q.to(torch.int8), scale


def fp8_operands(linear: nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
    """(E4M3 weight, per-channel scale, static input scale or None) of a linear with FP8 weights per
    output channel and FP8 inputs per token or under one calibrated scale (compressed-tensors'
    FP8_DYNAMIC and FP8): what ``torch._scaled_mm`` takes. Ours in process, or attached from an export
    by ``formats.compressed_tensors.attach_integers``."""
    qw, act = quantized_of(linear), input_quant_of(linear)
    if qw is None or act is None or qw.scheme.format != "fp8" or qw.scheme.group_size != -1:
        return None
    if act.format != "fp8" or act.group_size is not None or not (act.per_token or act.static):
        return None
    return qw.q, qw.scale.reshape(-1), InputScale.of(linear).value if act.static else None


FORMATS = (
    "fp32",
    "fp32-onednn",
    "bf16",
    "bf16-avx2",
    "int8",
    "int4",
    "int4-avx2",
    "int4-a16",
    "int4-a8",
    "int8g-avx2",
    "w8a8",
    "fp8",
)
FLOAT_FORMATS = ("fp32", "fp32-onednn", "bf16")  # compiled, these all become the compiler's own GEMM
VERIFY_ROWS = 16  # inputs up to this many rows are speculative verify steps (longer ones: prompts)
ARGMAX = "int8-argmax"  # an lm_head whose largest logit is exact (``Int8Argmax``): for greedy decoding


KERNELS: dict[str, type[Matmul]] = {}  # format name -> the class that runs it (registered below)


class Matmul:
    """One linear group's weights in one format, and the format's traits, which the engine reads
    from the kernels it built: its stream's dtype, the KV cache's, how many rows a compiled step takes.

    A subclass runs the formats it names (``class Int8(Matmul, formats=("int8",))``) and builds
    itself from the linears (``from_linears``)."""

    fmt = ""
    dtype = torch.float32  # what the kernel takes; inputs are cast to it and outputs back
    nbytes = 0
    device = torch.device("cpu")
    # every row computed alone, as a one-row call does, whatever the number of rows (our ``native``
    # kernels: each weight row meets the rows one after another), so a compiled step can take exactly
    # as many rows as it has tokens; their extra rows cost arithmetic, not weight reads
    rows_alone: ClassVar[bool] = False
    # rounds its input rows to int8 at decode time only (``int4-a8``; W8A8's evaluation rounds them
    # too, so its engine keeps what the export scored): the engine's tokens already differ from the
    # model's by more than a bf16 KV cache changes them, and ``auto`` never picks it
    rounds_rows: ClassVar[bool] = False

    @classmethod
    def offered_to_auto(cls, device: torch.device) -> bool:
        """Whether ``auto`` may pick it on ``device`` (not a lossy kernel: those are asked for)."""
        return not cls.rounds_rows

    def __init_subclass__(cls, formats: tuple[str, ...] = (), **kwargs):
        super().__init_subclass__(**kwargs)
        for fmt in formats:
            KERNELS[fmt] = cls

    @classmethod
    def from_linears(cls, fmt: str, linears: list, device: torch.device, traceable: bool) -> Matmul:
        """The group ``linears`` fused by rows, in this class's format ``fmt``."""
        raise NotImplementedError

    @property
    def takes_bf16(self) -> bool:
        """Its kernel takes bf16 rows, so a bf16 residual stream needs no casts."""
        return self.dtype == torch.bfloat16

    @property
    def rows_ride_along(self) -> bool:
        """A few more rows cost it little beyond its weight reads (a float GEMM), so a compiled
        step can verify several tokens for the price of one; not integer kernels, which work row by row."""
        return False

    def __init__(self, bias: torch.Tensor | None):
        self.bias = None if bias is None else bias.detach().to(self.device, self.dtype)

    def __call__(self, x: torch.Tensor, whole: bool = False) -> torch.Tensor:
        """``whole``: all rows in one call, also in a verify step (a fixed-shape step, where a
        one-token step pads to the same rows and so runs the same kernel)."""
        x_in = x.to(self.dtype)
        if torch.compiler.is_compiling():
            y = self.traced(x_in)
        elif not whole and 1 < x_in.shape[0] <= VERIFY_ROWS:
            y = torch.cat([self.matmul(part) for part in x_in.split(self.exact_rows)])
        else:
            y = self.matmul(x_in)
        return (y if self.bias is None else y + self.bias).to(x.dtype)

    def traced(self, x: torch.Tensor) -> torch.Tensor:
        """The product as the compiler sees it: ops it can trace (and, with frozen weights, prepack)."""
        return self.matmul(x)

    def tensors(self) -> list[torch.Tensor]:
        """The weights ``traced`` reads, for the compiler to fold as constants."""
        return [v for v in vars(self).values() if isinstance(v, torch.Tensor) and not v.is_mkldnn]

    @functools.cached_property
    def exact_rows(self) -> int:
        """How many rows one call may take and still compute each row as a one-row call does:
        all of a verify step, or 1.

        A library picks its algorithm by the number of rows (oneDNN's bf16 kernel for a
        1536-wide input changes between 2 and 5 rows), and a different summation order can flip
        a near-tie in bf16: then a speculative verify step would not give plain greedy's tokens.
        Random rows reveal a change only where a rounding lands differently, so any change seen
        up to ``VERIFY_ROWS`` rows makes the matmul run row by row in verify steps."""
        generator = torch.Generator().manual_seed(0)
        for _ in range(8):
            x = torch.randn(VERIFY_ROWS, self.in_features, generator=generator).to(self.device, self.dtype)
            single = torch.cat([self.matmul(row) for row in x.split(1)])
            if not all(torch.equal(self.matmul(x[:rows]), single[:rows]) for rows in range(2, VERIFY_ROWS + 1)):
                return 1
        return VERIFY_ROWS


class Dense(Matmul, formats=("fp32", "dense")):
    """``F.linear`` in fp32 (MKL's GEMV for one row), in bf16 on a CPU whose oneDNN takes no bf16
    weights, or in the model's dtype on an accelerator (``dense``)."""

    @classmethod
    def from_linears(cls, fmt, linears, device, traceable):
        return cls(
            _stacked(linears, _weight), _bias(linears), linears[0].weight.dtype if fmt == "dense" else torch.float32
        )

    @property
    def rows_ride_along(self) -> bool:
        return self.device.type == "cpu" and self.dtype == torch.float32

    def __init__(self, weight: torch.Tensor, bias, dtype: torch.dtype = torch.float32):
        self.dtype = dtype
        self.fmt = {torch.float32: "fp32", torch.bfloat16: "bf16"}.get(dtype, str(dtype).removeprefix("torch."))
        self.device = weight.device
        super().__init__(bias)
        self.weight = weight.to(dtype).contiguous()
        self.nbytes, (self.out_features, self.in_features) = self.weight.nbytes, weight.shape
        # where oneDNN takes no bf16 weights, aten's bf16 product is fast for one row only
        self.one_row_kernel = self.device.type == "cpu" and dtype == torch.bfloat16

    @functools.cached_property
    def exact_rows(self) -> int:
        return 1 if self.one_row_kernel else super().exact_rows  # verify rows as one-row GEMVs

    def matmul(self, x):
        if self.one_row_kernel and x.shape[0] > VERIFY_ROWS:
            return prompt_product(x, self.weight)  # aten's bf16 GEMM is slow for many rows
        return F.linear(x, self.weight)


class OneDNN(Matmul, formats=("fp32-onednn", "bf16")):
    """oneDNN's matmul over a weight reordered once into its blocked layout (fp32 or bf16).
    ``traceable`` keeps the plain weight too: the compiler cannot read a reordered one, and
    prepacks its own copy of the plain one (so a compiled engine holds these weights twice).
    bf16 where oneDNN takes no bf16 weights (AVX2-only CPUs): ``Dense`` in bf16."""

    rows_ride_along = True

    @classmethod
    def from_linears(cls, fmt, linears, device, traceable):
        weight, bias = _stacked(linears, _weight), _bias(linears)
        if fmt == "bf16" and not onednn.onednn_bf16_available():
            return Dense(weight, bias, torch.bfloat16)
        return cls(weight, bias, torch.float32 if fmt == "fp32-onednn" else torch.bfloat16, traceable)

    def __init__(self, weight: torch.Tensor, bias, dtype: torch.dtype, traceable: bool = False):
        self.dtype, self.fmt = dtype, "fp32-onednn" if dtype == torch.float32 else "bf16"
        super().__init__(bias)
        w = weight.to(dtype).contiguous()
        self.packed, self.nbytes = torch.ops.mkldnn._reorder_linear_weight(w), w.nbytes
        self.weight = w if traceable else None
        self.out_features, self.in_features = w.shape

    def matmul(self, x):
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")

    def traced(self, x):
        if self.weight is None:
            raise RuntimeError("this oneDNN matmul was built without its plain weight (traceable=False)")
        return F.linear(x, self.weight)


class Int4(Matmul, formats=("int4",)):
    """torch's packed-int4 CPU kernel (tinygemm layout, ``u = q + 8``, ``zero = −z·scale``), fed
    bf16 rows: its fp32 path is an order of magnitude slower on every CPU we measured. On a GPU:
    ``Int4CUDA``."""

    fmt, dtype = "int4", torch.bfloat16

    @classmethod
    def from_linears(cls, fmt, linears, device, traceable):
        q, scale, zero = _integers(fmt, linears)
        if device.type == "cuda":
            return Int4CUDA(q, scale, zero, _bias(linears), device)
        return cls(q, scale, zero, _bias(linears))

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bias):
        super().__init__(bias)
        self.group_size = q.shape[1] // scale.shape[1]
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu((q.to(torch.int32) + 8).contiguous(), 1)
        scale = scale.float()
        self.scales_and_zeros = (
            torch.stack([scale, -zero.float() * scale], -1).transpose(0, 1).contiguous().to(self.dtype)
        )
        self.nbytes = q.numel() // 2 + self.scales_and_zeros.nbytes
        self.out_features, self.in_features = q.shape

    def matmul(self, x):
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, self.group_size, self.scales_and_zeros)


class NativeBF16(Matmul, formats=("bf16-avx2",)):
    """bf16 weights on our AVX2 one-row product (``native``), fed fp32 rows; prompts (more than
    ``VERIFY_ROWS`` rows) run a library GEMM (``prompt_product``), as ``Dense`` does."""

    fmt, rows_alone = "bf16-avx2", True

    @classmethod
    def from_linears(cls, fmt, linears, device, traceable):
        return cls(_stacked(linears, _weight), _bias(linears))

    def __init__(self, weight: torch.Tensor, bias):
        super().__init__(bias)
        self.weight = weight.to(torch.bfloat16).contiguous()
        self.nbytes, (self.out_features, self.in_features) = self.weight.nbytes, weight.shape

    def matmul(self, x):
        if x.shape[0] > VERIFY_ROWS:
            return prompt_product(x, self.weight)
        return torch.ops.compress.bf16_matmul(x.contiguous(), self.weight)


class NativeInt4(Matmul, formats=("int4-avx2",)):
    """W4 groups on our AVX2 one-row product (``native``): ``w = scale·u + offset`` with ``u`` in
    0..15 (``q + 8`` for signed codes, ``affine_codes``), fed fp32 rows; so also GGUF's Q4_0,
    Q4_1 and Q4_K. Prompts dequantize for a library GEMM (``prompt_product``: faster on a prompt
    than any int4 kernel we measured, docs/results.md)."""

    fmt, rows_alone = "int4-avx2", True

    @classmethod
    def from_linears(cls, fmt, linears, device, traceable):
        return cls(*_affine_integers(fmt, linears, unsigned=True), _bias(linears))

    def __init__(self, u: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, bias):
        super().__init__(bias)
        self.group_size = u.shape[1] // scale.shape[1]
        self.packed = native.pack_int4(u.to(torch.int32))
        self.scale, self.offset = scale.contiguous(), offset.contiguous()
        self.nbytes = self.packed.nbytes + self.scale.nbytes + self.offset.nbytes
        self.out_features, self.in_features = u.shape

    def matmul(self, x):
        if x.shape[0] > VERIFY_ROWS:
            # in bf16 where the GEMM will be (``prompt_product``): an fp32 copy would be converted again
            weight = torch.ops.compress.int4_dequantize(
                self.packed, self.scale, self.offset, self.group_size, onednn.bf16_arithmetic()
            )
            return prompt_product(x, weight)
        return torch.ops.compress.int4_matmul(x.contiguous(), self.packed, self.scale, self.offset, self.group_size)


class NativeInt4A16(NativeInt4, formats=("int4-a16",)):
    """``NativeInt4``'s weights times one-to-few rows rounded to 16 bits per block of 64 (each value
    within 2^-16 of its block's largest: finer than bf16 rounds a row for torch's int4 kernel),
    multiplied as two int8 parts on integer dot products (VNNI where the CPU has it): faster than
    ``int4-avx2`` where VNNI is, close to ``int4-a8``. Groups of 64k weights; prompts
    dequantize for a float GEMM as ``NativeInt4`` does."""

    fmt, op = "int4-a16", "int4_matmul_a16"

    def matmul(self, x):
        if x.shape[0] > VERIFY_ROWS:
            return super().matmul(x)
        return getattr(torch.ops.compress, self.op)(
            x.contiguous(), self.packed, self.scale, self.offset, self.group_size
        )


class NativeInt4A8(NativeInt4A16, formats=("int4-a8",)):
    """``NativeInt4A16`` with rows rounded to int8 per block of 64 (W4A8, as llama.cpp's Q4 × Q8
    products): one integer product a block instead of two, so the product streams its weights near
    the memory's rate (the fastest lm_head kernel in docs/decoder.md). Lossy in the activations
    (about 1% of a product's size), so used only when asked for by name."""

    fmt, op, rounds_rows = "int4-a8", "int4_matmul_a8", True


class NativeInt8Groups(Matmul, formats=("int8g-avx2",)):
    """Integers of up to 8 bits with a scale and an offset per group of 16k weights on our AVX2
    one-row product (``native``): ``w = scale·c + offset``, one byte a weight. Every GGUF block
    type unpacks to this (Q5_0, Q5_K, Q6_K, Q8_0, Q3_K, ...: ``formats.gguf_integers``), and so do
    our W3/W8 groups. Prompts dequantize for a library GEMM, as ``NativeInt4``."""

    fmt, rows_alone = "int8g-avx2", True

    @classmethod
    def from_linears(cls, fmt, linears, device, traceable):
        return cls(*_affine_integers(fmt, linears), _bias(linears))

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, bias):
        super().__init__(bias)
        self.group_size = codes.shape[1] // scale.shape[1]
        self.codes = codes.to(torch.int8).contiguous()
        self.scale, self.offset = scale.contiguous(), offset.contiguous()
        self.nbytes = self.codes.nbytes + self.scale.nbytes + self.offset.nbytes
        self.out_features, self.in_features = codes.shape

    def matmul(self, x):
        if x.shape[0] > VERIFY_ROWS:
            groups = self.codes.float().unflatten(1, (-1, self.group_size))
            weight = (groups * self.scale[..., None] + self.offset[..., None]).flatten(1)
            return prompt_product(x, weight.to(torch.bfloat16) if onednn.bf16_arithmetic() else weight)
        return torch.ops.compress.int8_matmul(x.contiguous(), self.codes, self.scale, self.offset, self.group_size)


class Int8Argmax(Matmul, formats=(ARGMAX,)):
    """An lm_head for greedy decoding: logits whose largest (its position and value) is exactly
    ``NativeBF16``'s, at about half its reads. An int8 copy of the bf16 weight (one scale a row)
    scores every row against the row rounded to 16 bits per block; each score's error has a proven
    bound (the row's largest weight rounding times ``|x|_1``, plus the activations' rounding), and
    only the rows whose score could still reach the largest are recomputed from the bf16 weight,
    as ``NativeBF16`` computes them (about 5 rows on average on SmolLM2 and Gemma-3). A bound using int4
    weights left nearly every row (the worst case is ~40x the typical error at width 576), and
    int8 activations let the outlier channels widen it as far. The other logits are int8's: lossy
    for sampling, so only greedy decoding asks for it (``lm_head="argmax"``)."""

    fmt, rows_alone = ARGMAX, True

    @classmethod
    def from_linears(cls, fmt, linears, device, traceable):
        return cls(_stacked(linears, _weight), _bias(linears))

    def __init__(self, weight: torch.Tensor, bias):
        super().__init__(bias)
        if bias is not None:
            raise ValueError("int8-argmax takes an lm_head without a bias")
        self.weight = weight.to(torch.bfloat16).contiguous()
        w = self.weight.float()
        self.scale = (w.abs().amax(1) / 127).clamp(min=torch.finfo(torch.float32).tiny).contiguous()
        self.codes = torch.round(w / self.scale[:, None]).clamp(-127, 127).to(torch.int8).contiguous()
        self.error = (w - self.codes.float() * self.scale[:, None]).abs().amax(1).contiguous()
        # per token it streams the codes and two floats a row; the bf16 rows it recomputes are a few
        self.nbytes = self.codes.nbytes + self.scale.nbytes + self.error.nbytes
        self.out_features, self.in_features = weight.shape

    def matmul(self, x):
        if x.shape[0] > VERIFY_ROWS:
            return prompt_product(x, self.weight)
        return torch.ops.compress.int8_argmax_logits(x.contiguous(), self.codes, self.scale, self.error, self.weight)


class Int4CUDA(Matmul):
    """tinygemm's int4 kernel on a GPU (``_weight_int4pack_mm``): the same dequantization as the
    CPU kernel (``(u − 8)·scale + zero``), another packing (two codes a byte, then tiled)."""

    fmt, dtype = "int4", torch.bfloat16

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bias, device: torch.device):
        self.device = device
        super().__init__(bias)
        self.group_size = q.shape[1] // scale.shape[1]
        u = (q.to(torch.int32) + 8).to(device)
        inner_k_tiles = next(t for t in (8, 4, 2) if q.shape[1] % (16 * t) == 0)
        self.packed = torch.ops.aten._convert_weight_to_int4pack(
            (u[:, ::2] << 4 | u[:, 1::2]).to(torch.uint8), inner_k_tiles
        )
        scale = scale.float()
        self.scales_and_zeros = (
            torch.stack([scale, -zero.float() * scale], -1).transpose(0, 1).contiguous().to(device, self.dtype)
        )
        self.nbytes = q.numel() // 2 + self.scales_and_zeros.nbytes
        self.out_features, self.in_features = q.shape

    def matmul(self, x):
        return torch.ops.aten._weight_int4pack_mm(x, self.packed, self.group_size, self.scales_and_zeros)


class Int8(Matmul, formats=("int8",)):
    """Weight-only int8 with one scale per output row (``_weight_int8pack_mm``), fed bf16 rows."""

    fmt, dtype = "int8", torch.bfloat16

    @classmethod
    def from_linears(cls, fmt, linears, device, traceable):
        q, scale, _ = _integers(fmt, linears)
        return cls(q, scale, _bias(linears))

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, bias):
        super().__init__(bias)
        self.q, self.scale = q.to(torch.int8).contiguous(), scale.reshape(-1).to(self.dtype)
        self.nbytes, (self.out_features, self.in_features) = self.q.nbytes + self.scale.nbytes, q.shape

    def matmul(self, x):
        return torch.ops.aten._weight_int8pack_mm(x, self.q, self.scale)


class W8A8(Matmul, formats=("w8a8",)):
    """Int8 weights and per-token int8 activations on ``torch._int_mm`` (SmoothQuant's exports)."""

    fmt = "w8a8"
    CUDA_ROWS = 32  # cuBLAS's int8 GEMM behind ``_int_mm`` takes more than 16 rows: fewer are padded

    @classmethod
    def from_linears(cls, fmt, linears, device, traceable):
        q, scale = zip(*(w8a8_integers(lin) for lin in linears))
        return cls(torch.cat(q), torch.cat(scale), _bias(linears), device)

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, bias, device: torch.device = torch.device("cpu")):
        self.device = device
        super().__init__(bias)
        self.weight_t, self.scale = q.t().contiguous().to(device), scale.float().reshape(1, -1).to(device)
        self.nbytes, (self.out_features, self.in_features) = self.weight_t.nbytes + self.scale.nbytes, q.shape

    def matmul(self, x):
        scale = (x.abs().amax(-1, keepdim=True) / 127.5).clamp(min=1e-8)
        q = torch.round(x / scale).clamp(-128, 127).to(torch.int8)
        rows = q.shape[0]
        if q.is_cuda and rows < self.CUDA_ROWS:  # integer products: a padded row changes no other row
            q = F.pad(q, (0, 0, 0, self.CUDA_ROWS - rows))
        return torch._int_mm(q, self.weight_t)[:rows].float() * scale * self.scale


class FP8(Matmul, formats=("fp8",)):
    """FP8 E4M3 weights and inputs on ``torch._scaled_mm``: each input row rounded to E4M3 under its
    own scale (``max|x| / 448``) or the calibrated static one, products summed in float32, then
    both scales applied, as compressed-tensors' FP8 exports run on Hopper in vLLM. torch's CPU
    ``_scaled_mm`` is a plain loop, tens of times slower than bf16 there, so ``auto`` takes it only on
    a GPU; on a CPU ``--kernel fp8`` asks for it, to decode as a server computes."""

    fmt = "fp8"  # float32 rows: rounded to E4M3 from the stream's values, as the evaluation rounds them

    @classmethod
    def offered_to_auto(cls, device):
        return device.type == "cuda"

    @classmethod
    def from_linears(cls, fmt, linears, device, traceable):
        q, scale, static = zip(*(fp8_operands(lin) for lin in linears))
        return cls(torch.cat(q), torch.cat(scale), static[0], _bias(linears), device)

    def __init__(self, q, scale, input_scale, bias, device: torch.device = torch.device("cpu")):
        self.device = device
        super().__init__(bias)
        # (in, out) column-major, as ``_scaled_mm`` takes its second operand
        self.weight_t, self.scale = q.to(device).t(), scale.float().reshape(1, -1).to(device)
        self.input_scale = None if input_scale is None else input_scale.float().reshape(1, 1).to(device)
        # row-wise scaled products come out in float32 on a CPU and on Hopper's cuBLAS only; bf16 elsewhere
        self.out_dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
        self.nbytes, (self.out_features, self.in_features) = q.nbytes + self.scale.nbytes, q.shape

    def matmul(self, x):
        if self.input_scale is None:  # the evaluation's rounding (``quant.round_fp8``)
            scale = (x.abs().amax(-1, keepdim=True).float() / FP8_MAX).clamp(min=1e-12)
        else:
            scale = self.input_scale.expand(x.shape[0], 1).contiguous()  # row-wise, as ``scale_b`` is
        q = (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return torch._scaled_mm(q, self.weight_t, scale_a=scale, scale_b=self.scale, out_dtype=self.out_dtype)


def _stacked(linears: list, part) -> torch.Tensor:
    return torch.cat([part(lin) for lin in linears])


def _weight(linear) -> torch.Tensor:
    return linear.weight.detach()


def _integers(fmt: str, linears: list) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, scale, zero) of the group fused by rows: the integers recorded on each linear, or, for a
    lossy format asked for, its weights rounded to nearest as ``fmt`` holds them."""
    qws = [_quantized(fmt, lin) for lin in linears]
    return tuple(torch.cat([getattr(qw, part) for qw in qws]) for part in ("q", "scale", "zero_point"))


def _quantized(fmt: str, linear):
    """The integers recorded on ``linear``, or, for a lossy format asked for, its weight rounded to
    nearest as ``fmt`` holds it."""
    return quantized_of(linear) or quantize_weight(linear.weight.detach().float(), _LOSSY[fmt](linear), torch.bfloat16)


def affine_codes(qw) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(c, scale, offset) of a ``QuantizedWeight`` on an integer grid: ``w = scale·c + offset`` per
    group, ``c`` its stored integers (signed, or a k-quant's unsigned codes under a minimum)."""
    scale = qw.scale.float()
    if qw.scheme.subtracts_minimum:
        return qw.q, scale, -qw.zero_point.float()
    return qw.q, scale, -qw.zero_point.float() * scale


def integer_grid(qw, max_bits: int) -> bool:
    """Whether ``qw`` holds integers of at most ``max_bits`` bits (not a float grid)."""
    return qw is not None and not qw.scheme.is_float and qw.scheme.bits <= max_bits


def _affine_integers(fmt: str, linears: list, unsigned: bool = False):
    """``affine_codes`` of the group fused by rows, in float32; ``unsigned``: codes 0..15, signed
    ones shifted by 8 (``w = scale·(c + 8) + offset − 8·scale``)."""
    parts = []
    for lin in linears:
        qw = _quantized(fmt, lin)
        c, scale, offset = affine_codes(qw)
        if unsigned and qw.scheme.qmin < 0:
            c, offset = c.to(torch.int16) + 8, offset - 8 * scale
        parts.append((c, scale, offset))
    return tuple(torch.cat(part) for part in zip(*parts))


def _bias(linears: list) -> torch.Tensor | None:
    if all(lin.bias is None for lin in linears):
        return None
    return torch.cat([lin.bias.detach() if lin.bias is not None else torch.zeros(lin.out_features) for lin in linears])


def build(fmt: str, linears: list, device: torch.device, traceable: bool = False) -> Matmul:
    """One ``Matmul`` over ``linears`` fused by rows, in ``fmt``; lossy formats round first.
    ``traceable``: for an engine that will be compiled (see ``OneDNN``)."""
    if fmt not in KERNELS:
        raise ValueError(f"unknown format {fmt!r} (known: {', '.join(FORMATS)})")
    return KERNELS[fmt].from_linears(fmt, linears, device, traceable)


def _int4_group(lin) -> int:
    return next(g for g in (128, 64, 32) if lin.in_features % g == 0)


_LOSSY = {
    "int8": lambda lin: QuantScheme(8, -1, True),
    "int4": lambda lin: QuantScheme(4, _int4_group(lin), True),
}
_LOSSY["int4-avx2"] = _LOSSY["int4-a16"] = _LOSSY["int4-a8"] = _LOSSY["int4"]  # the same integers, our layout


def rtn_w4(linear: nn.Linear) -> nn.Linear:
    """A copy of ``linear`` rounded to 4 bits (round-to-nearest, symmetric, largest group of
    128/64/32 that divides its width) with its integers recorded, for an in-memory W4 draft."""
    out = nn.Linear(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta")
    out.bias = linear.bias
    qw = quantize_weight(linear.weight.detach().float(), _LOSSY["int4"](linear), torch.bfloat16)
    out.weight = nn.Parameter(
        dequantize(qw.q, qw.scale, qw.zero_point, torch.bfloat16).to(linear.weight.dtype), requires_grad=False
    )
    qw.attach(out)
    return out
