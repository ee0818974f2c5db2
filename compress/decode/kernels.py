"""Real low-bit matmuls for decoding: W4 linears on torch's packed-int4 CPU kernel, W8A8
linears on ``torch._int_mm``.

``torch.ops.aten._weight_int4pack_mm_for_cpu`` (tinygemm's layout) multiplies activations by
4-bit weights packed two per byte, with a (scale, zero) pair per group of 32/64/128/256
inputs and ``w = (u − 8)·scale + zero`` for ``u`` in 0..15. Our integers are signed
(``w = (q − z)·scale``, ``q`` in −8..7), so ``u = q + 8`` and ``zero = −z·scale``: the kernel
computes exactly the weights we evaluate. A quantized linear reads 1/8 of the bytes of its
fp32 form, which is what decoding one token at a time on a CPU waits for.

W8A8 (SmoothQuant's export): each token's input is rounded to int8 with its own scale
``max|x| / 127.5`` (compressed-tensors' convention, as our evaluation does), multiplied by
the int8 weight in int32 by ``torch._int_mm``, and rescaled by both scales.

The integers come from the linear's ``quantized`` record: set by our passes in the same
process, or read back from an export's packed tensors by ``attach_from_export``; a W8A8
export loaded by transformers holds its scale and the weight (as int8, or unpacked to q · scale).
"""

from __future__ import annotations

import itertools
import json
import time
import weakref
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..quant import QuantizedWeight, QuantScheme, dequantize, input_quant_of, quantize_weight, quantized_of

INT4_GROUPS = (32, 64, 128, 256)


def int4_kernel_available() -> bool:
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")


class Int4Linear(nn.Module):
    """A CPU linear over packed 4-bit weights; what it computes equals the dequantized weight's."""

    def __init__(self, linear: nn.Linear, qw: QuantizedWeight):
        super().__init__()
        out_features, in_features = qw.q.shape
        self.in_features, self.out_features = in_features, out_features
        self.group_size = in_features // qw.scale.shape[1]
        unsigned = (qw.q.to(torch.int32) + 8).contiguous()
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(unsigned, 1))
        scale = qw.scale.float()
        zero = -qw.zero_point.float() * scale
        self.dtype = linear.weight.dtype  # the compute dtype; scales follow it
        self.register_buffer("scales_and_zeros", torch.stack([scale, zero], -1).transpose(0, 1).contiguous()
                             .to(self.dtype))
        self.bias = linear.bias
        self.quantized = qw

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(self.dtype)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.packed, self.group_size, self.scales_and_zeros)
        y = y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)
        return y if self.bias is None else y + self.bias


class Int8Linear(nn.Module):
    """A W8A8 linear on ``torch._int_mm``: what it computes equals fake-quantized activations
    times the dequantized int8 weight, up to float rounding."""

    def __init__(self, linear: nn.Module, q: torch.Tensor, scale: torch.Tensor):
        super().__init__()
        self.out_features, self.in_features = q.shape
        self.register_buffer("weight_t", q.t().contiguous())  # (in, out): _int_mm's right operand
        self.register_buffer("weight_scale", scale.float().reshape(1, -1))
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).float()
        scale = (flat.abs().amax(-1, keepdim=True) / 127.5).clamp(min=1e-8)
        q = torch.round(flat / scale).clamp(-128, 127).to(torch.int8)
        y = torch._int_mm(q, self.weight_t).float() * scale * self.weight_scale
        y = y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)
        return y if self.bias is None else y + self.bias


def _w8a8_integers(linear: nn.Module) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(int8 weight, per-channel scale) of a W8A8 linear with per-token activations: ours
    in-process, or one transformers loaded from an ``int-quantized`` export."""
    if not isinstance(linear, nn.Linear):
        return None
    qw, act = quantized_of(linear), input_quant_of(linear)
    if qw is not None and act is not None:
        ok = qw.scheme.bits == 8 and qw.scheme.symmetric and qw.scale.shape[1] == 1 and act.bits == 8 and act.per_token
        return (qw.q, qw.scale) if ok else None
    scheme = getattr(linear, "quantization_scheme", None)
    if scheme is None or scheme.input_activations is None or not hasattr(linear, "weight_scale"):
        return None
    w, a = scheme.weights, scheme.input_activations
    ok = (w.num_bits == 8 and w.symmetric and str(w.strategy).endswith("channel") and a.num_bits == 8
          and a.symmetric and a.dynamic and str(a.strategy).endswith("token"))
    if not ok:
        return None
    scale = linear.weight_scale.data
    # ``models.load_model`` unpacks exports to float (q · scale); dividing back is exact for |q| ≤ 127
    q = linear.weight.data if linear.weight.dtype == torch.int8 else torch.round(linear.weight.data / scale)
    return q.to(torch.int8), scale


def use_int8_kernel(model: nn.Module) -> int:
    """Swap every W8A8 linear (per-channel weights, per-token activations) for an ``Int8Linear``."""
    swaps = [(name, m, found) for name, m in model.named_modules() if (found := _w8a8_integers(m)) is not None]
    for name, linear, (q, scale) in swaps:
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent), leaf, Int8Linear(linear, q, scale))
    return len(swaps)


class OneDNNLinear(nn.Module):
    """An fp32 CPU linear whose multi-row products run on oneDNN with the weight reordered once
    into its blocked layout; single rows stay on MKL's matrix-vector product.

    Measured on the 2-core AMD EPYC (AVX2) this project runs on: MKL's fp32 GEMM costs 5× its
    GEMV on 8 rows of a 576→1536 linear, oneDNN's prepacked one 2×; for single rows oneDNN's
    per-call overhead loses on small linears and wins on the 49152-row lm_head. Verifying 8
    speculated tokens then costs 1.4× one token instead of 2.1×, which is what speculation on
    a CPU lives on. ``keep_dense`` False drops the MKL copy (the lm_head: always oneDNN).
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


def use_onednn(model: nn.Module) -> int:
    """Swap every plain fp32 CPU linear for a ``OneDNNLinear`` (in place); returns how many.
    Decoding only: the swapped linears do not train."""
    if not onednn_available():
        return 0
    output = model.get_output_embeddings()
    swaps = [(name, m) for name, m in model.named_modules()
             if type(m) is nn.Linear and m.weight.dtype == torch.float32 and m.weight.device.type == "cpu"]
    for name, linear in swaps:
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent), leaf, OneDNNLinear(linear, keep_dense=linear is not output))
    return len(swaps)


def probe(model: nn.Module, kind: str, repeats: int = 10) -> tuple[float, float] | None:
    """(kernel ms, current ms) for one decode-shaped call (one row) of the first linear the
    ``int4`` or ``int8`` kernel applies to; None if none does. Whether a kernel pays depends on
    the CPU: on this project's AVX2 EPYC (no AVX-512, no VNNI) torch's int4 CPU kernel took
    3.3 ms and ``_int_mm`` 0.9 ms where the fp32 linear took 0.14 ms, so ``--kernel auto``
    measures before it swaps."""
    import time

    if kind == "int4":
        found = next(((m, Int4Linear(m, quantized_of(m))) for m in model.modules() if supports_int4(m)), None) \
            if int4_kernel_available() else None
    else:
        found = next(((m, Int8Linear(m, *ints)) for m in model.modules() if (ints := _w8a8_integers(m))), None)
    if found is None:
        return None
    current, kernel = found
    x = torch.randn(1, kernel.in_features, dtype=next(current.parameters()).dtype if current.weight.is_floating_point()
                    else torch.float32)
    times = []
    with torch.no_grad():
        for module in (kernel, current):
            module(x)
            start = time.perf_counter()
            for _ in range(repeats):
                module(x)
            times.append((time.perf_counter() - start) / repeats * 1e3)
    return times[0], times[1]


def supports_int4(linear: nn.Module) -> bool:
    qw = quantized_of(linear)
    return (isinstance(linear, nn.Linear) and qw is not None and qw.scheme.bits == 4
            and linear.weight.device.type == "cpu" and qw.q.shape[1] // qw.scale.shape[1] in INT4_GROUPS
            and qw.q.shape[0] % 16 == 0)


def use_int4_kernel(model: nn.Module) -> int:
    """Swap every supported W4 linear for an ``Int4Linear`` (in place); returns how many.

    Call it on the model in its compute dtype and device (``models.for_compute``).
    """
    if not int4_kernel_available():
        return 0
    swaps = [(name, m) for name, m in model.named_modules() if supports_int4(m)]
    for name, linear in swaps:
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent), leaf, Int4Linear(linear, quantized_of(linear)))
    return len(swaps)


def attach_from_export(model: nn.Module, folder: str | Path) -> int:
    """Record on each linear of ``model`` (loaded from ``folder``) the integers its export stores
    in the compressed-tensors ``pack-quantized`` layout; returns how many linears got one."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from safetensors import safe_open

    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text()).get("quantization_config") or {}
    if config.get("format") != "pack-quantized":
        return 0
    bits = {g["weights"]["num_bits"] for g in config.get("config_groups", {}).values()}
    symmetric = {g["weights"]["symmetric"] for g in config.get("config_groups", {}).values()}
    if len(bits) != 1 or len(symmetric) != 1:
        return 0  # mixed schemes: not worth the bookkeeping here
    (bits,), (symmetric,) = bits, symmetric
    count = 0
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                if not key.endswith(".weight_packed"):
                    continue
                name = key.removesuffix(".weight_packed")
                shape = torch.Size(f.get_tensor(f"{name}.weight_shape").tolist())
                q = unpack_from_int32(f.get_tensor(key), bits, shape)
                scale = f.get_tensor(f"{name}.weight_scale")
                zero = (unpack_from_int32(f.get_tensor(f"{name}.weight_zero_point"), bits, scale.shape, packed_dim=0)
                        if not symmetric else torch.zeros(scale.shape, dtype=torch.int8))
                group = shape[1] // scale.shape[1]
                scheme = QuantScheme(bits, -1 if scale.shape[1] == 1 else group, symmetric)
                model.get_submodule(name).quantized = QuantizedWeight(scheme, q.to(torch.int8), scale, zero)
                count += 1
    return count


# --- Weight formats for the decode engine -------------------------------------------------
#
# A ``Matmul`` holds one linear group's weights (q/k/v or gate/up fused by rows) in one format
# and computes ``x @ Wᵀ + b`` for rows ``x`` in the engine's dtype. Which format is fastest for
# a one-row product depends on the CPU (see ``choose``); which formats are allowed depends on
# what the weights are: a format is offered only where it holds them exactly, unless a lossy
# one is asked for (a W4 draft, a quantized lm_head).

FORMATS = ("fp32", "fp32-onednn", "bf16", "int8", "int4", "w8a8")


class Matmul:
    fmt = ""
    dtype = torch.float32  # what the kernel takes; inputs are cast to it and outputs back
    nbytes = 0

    def __init__(self, bias: torch.Tensor | None):
        self.bias = None if bias is None else bias.detach().to(self.dtype)
        self.handle = next(_HANDLES)
        _MATMULS[self.handle] = self

    @property
    def out_shape(self) -> torch.Tensor:
        if not hasattr(self, "_out_shape"):
            self._out_shape = torch.empty(self.out_features, dtype=torch.float32 if self.fmt == "w8a8" else self.dtype)
        return self._out_shape

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x_in = x.to(self.dtype)
        y = _matmul_op(x_in, self.handle, self.out_shape) if torch.compiler.is_compiling() else self.matmul(x_in)
        return (y if self.bias is None else y + self.bias).to(x.dtype)


# Under torch.compile each matmul is one opaque call (the compiler cannot lower prepacked or
# packed-integer weights), found by handle; everything between matmuls is compiled and fused.
_MATMULS: weakref.WeakValueDictionary[int, Matmul] = weakref.WeakValueDictionary()
_HANDLES = itertools.count()


@torch.library.custom_op("compress::matmul", mutates_args=())
def _matmul_op(x: torch.Tensor, handle: int, out_shape: torch.Tensor) -> torch.Tensor:
    return _MATMULS[handle].matmul(x)


@_matmul_op.register_fake
def _(x: torch.Tensor, handle: int, out_shape: torch.Tensor) -> torch.Tensor:
    """``out_shape``: an empty (out_features,) tensor of the output's dtype, so the compiler
    knows the result without reading the handle (symbolic under dynamic shapes)."""
    return x.new_empty((x.shape[0], out_shape.shape[0]), dtype=out_shape.dtype)


class Dense(Matmul):
    """``F.linear`` in fp32 (MKL's GEMV for one row), or in the model's dtype on an accelerator."""

    def __init__(self, weight: torch.Tensor, bias, dtype: torch.dtype = torch.float32):
        self.dtype, self.fmt = dtype, "fp32" if dtype == torch.float32 else str(dtype).removeprefix("torch.")
        super().__init__(bias)
        self.weight = weight.to(dtype).contiguous()
        self.nbytes, self.out_features = self.weight.nbytes, weight.shape[0]

    def matmul(self, x):
        return F.linear(x, self.weight)


class OneDNN(Matmul):
    """oneDNN's matmul over a weight reordered once into its blocked layout (fp32 or bf16)."""

    def __init__(self, weight: torch.Tensor, bias, dtype: torch.dtype):
        self.dtype, self.fmt = dtype, "fp32-onednn" if dtype == torch.float32 else "bf16"
        super().__init__(bias)
        w = weight.to(dtype).contiguous()
        self.packed, self.nbytes = torch.ops.mkldnn._reorder_linear_weight(w), w.nbytes
        self.out_features = w.shape[0]

    def matmul(self, x):
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")


class Int4(Matmul):
    """torch's packed-int4 CPU kernel (tinygemm layout, ``u = q + 8``, ``zero = −z·scale``), fed
    bf16 rows: its fp32 path is 20–30× slower on every CPU measured here."""

    fmt, dtype = "int4", torch.bfloat16

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bias):
        super().__init__(bias)
        self.group_size = q.shape[1] // scale.shape[1]
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu((q.to(torch.int32) + 8).contiguous(), 1)
        scale = scale.float()
        self.scales_and_zeros = torch.stack([scale, -zero.float() * scale], -1).transpose(0, 1).contiguous() \
            .to(self.dtype)
        self.nbytes = q.numel() // 2 + self.scales_and_zeros.nbytes
        self.out_features = q.shape[0]

    def matmul(self, x):
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, self.group_size, self.scales_and_zeros)


class Int8(Matmul):
    """Weight-only int8 with one scale per output row (``_weight_int8pack_mm``), fed bf16 rows."""

    fmt, dtype = "int8", torch.bfloat16

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, bias):
        super().__init__(bias)
        self.q, self.scale = q.to(torch.int8).contiguous(), scale.reshape(-1).to(self.dtype)
        self.nbytes, self.out_features = self.q.nbytes + self.scale.nbytes, q.shape[0]

    def matmul(self, x):
        return torch.ops.aten._weight_int8pack_mm(x, self.q, self.scale)


class W8A8(Matmul):
    """Int8 weights and per-token int8 activations on ``torch._int_mm`` (SmoothQuant's exports)."""

    fmt = "w8a8"

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, bias):
        super().__init__(bias)
        self.weight_t, self.scale = q.t().contiguous(), scale.float().reshape(1, -1)
        self.nbytes, self.out_features = self.weight_t.nbytes + self.scale.nbytes, q.shape[0]

    def matmul(self, x):
        scale = (x.abs().amax(-1, keepdim=True) / 127.5).clamp(min=1e-8)
        q = torch.round(x / scale).clamp(-128, 127).to(torch.int8)
        return torch._int_mm(q, self.weight_t).float() * scale * self.scale


def takes_bf16(fmt: str) -> bool:
    """Whether the format's kernel takes bf16 rows (so a bf16 residual stream needs no casts)."""
    return fmt in ("bf16", "int8", "int4")


def _stacked(linears: list, part) -> torch.Tensor:
    return torch.cat([part(lin) for lin in linears])


def _bias(linears: list) -> torch.Tensor | None:
    if all(lin.bias is None for lin in linears):
        return None
    return torch.cat([lin.bias.detach() if lin.bias is not None else torch.zeros(lin.out_features) for lin in linears])


def exact_formats(linears: list, device: torch.device) -> list[str]:
    """The formats that hold every linear of the group exactly, on ``device``."""
    if device.type != "cpu":
        return ["dense"]
    if all(_w8a8_integers(lin) is not None for lin in linears):
        return ["w8a8"]  # its activations are int8 by design: the float formats would not be W8A8
    found = ["fp32"] + (["fp32-onednn"] if onednn_available() else [])
    weights = [lin.weight.detach() for lin in linears]
    if all(torch.equal(w.to(torch.bfloat16).to(w.dtype), w) for w in weights):
        found.append("bf16")
    schemes = [quantized_of(lin) and quantized_of(lin).scheme for lin in linears]
    if all(s is not None and s.bits == 8 and s.symmetric and s.group_size == -1 for s in schemes):
        found.append("int8")
    if int4_kernel_available() and all(s is not None and s.bits == 4 for s in schemes) and \
            len({quantized_of(lin).scale.shape[1] for lin in linears}) == 1 and \
            linears[0].in_features // quantized_of(linears[0]).scale.shape[1] in INT4_GROUPS and \
            sum(lin.out_features for lin in linears) % 16 == 0:
        found.append("int4")
    return found


def build(fmt: str, linears: list, device: torch.device) -> Matmul:
    """One ``Matmul`` over ``linears`` fused by rows, in ``fmt``; lossy formats round first."""
    bias = _bias(linears)
    weight = lambda: _stacked(linears, lambda lin: lin.weight.detach())  # noqa: E731
    if fmt == "dense":
        return Dense(weight(), bias, linears[0].weight.dtype)
    if fmt == "fp32":
        return Dense(weight(), bias)
    if fmt in ("fp32-onednn", "bf16"):
        return OneDNN(weight(), bias, torch.float32 if fmt == "fp32-onednn" else torch.bfloat16)
    if fmt == "w8a8":
        q, scale = zip(*(_w8a8_integers(lin) for lin in linears))
        return W8A8(torch.cat(q), torch.cat(scale), bias)
    qws = [quantized_of(lin) or quantize_weight(lin.weight.detach().float(), _LOSSY[fmt](lin), torch.bfloat16)
           for lin in linears]
    if fmt == "int8":
        return Int8(torch.cat([qw.q for qw in qws]), torch.cat([qw.scale for qw in qws]), bias)
    if fmt == "int4":
        return Int4(torch.cat([qw.q for qw in qws]), torch.cat([qw.scale for qw in qws]),
                    torch.cat([qw.zero_point for qw in qws]), bias)
    raise ValueError(f"unknown format {fmt!r} (known: {', '.join(FORMATS)})")


def _int4_group(lin) -> int:
    return next(g for g in (128, 64, 32) if lin.in_features % g == 0)


_LOSSY = {"int8": lambda lin: QuantScheme(8, -1, True),
          "int4": lambda lin: QuantScheme(4, _int4_group(lin), True)}


def rtn_w4(linear: nn.Linear) -> nn.Linear:
    """A copy of ``linear`` rounded to 4 bits (round-to-nearest, symmetric, largest group of
    128/64/32 that divides its width) with its integers recorded, for an in-memory W4 draft."""
    out = nn.Linear(linear.in_features, linear.out_features, bias=linear.bias is not None,
                    device="meta")
    out.bias = linear.bias
    qw = quantize_weight(linear.weight.detach().float(), _LOSSY["int4"](linear), torch.bfloat16)
    out.weight = nn.Parameter(dequantize(qw.q, qw.scale, qw.zero_point, torch.bfloat16).to(linear.weight.dtype),
                              requires_grad=False)
    out.quantized = qw
    return out


def _time_one_row(matmuls: list[Matmul], width: int, dtype: torch.dtype, device: torch.device,
                  repeats: int = 5) -> float:
    """Median ms to push one row through every matmul in turn (the weights stream as in decoding)."""
    x = torch.randn(1, width, dtype=dtype, device=device)
    for m in matmuls:
        m(x)  # warm-up: first calls allocate
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for m in matmuls:
            m(x)
        times.append(time.perf_counter() - start)
    return sorted(times)[repeats // 2] * 1e3


def choose(groups: dict[str, list[list]], kernel: str, device: torch.device,
           lossy: dict[str, str] | None = None) -> tuple[dict[str, str], dict[str, dict[str, float]]]:
    """The format of each linear group (name -> per-layer lists of linears), and what each
    timed candidate took for one token (ms over all layers).

    ``auto`` times every exact format and keeps the fastest; ``dense`` keeps plain matmuls;
    a format name is used where it is exact, else the group stays dense. ``lossy`` names a
    format per group to use whatever the weights are.
    """
    formats, timings = {}, {}
    for name, layers in groups.items():
        if lossy and name in lossy:
            formats[name] = lossy[name]
            continue
        exact = [f for f in exact_formats(layers[0], device)
                 if all(f in exact_formats(lins, device) for lins in layers[1:])] or ["fp32"]
        if kernel == "dense" or len(exact) == 1 or kernel not in ("auto",) + FORMATS:
            formats[name] = "w8a8" if exact == ["w8a8"] else ("dense" if device.type != "cpu" else "fp32")
        elif kernel != "auto":
            formats[name] = kernel if kernel in exact else "fp32"
        else:
            width = layers[0][0].in_features
            timings[name] = {}
            for fmt in exact:
                built = [build(fmt, lins, device) for lins in layers]
                timings[name][fmt] = _time_one_row(built, width, torch.float32, device)
                del built
            formats[name] = min(timings[name], key=timings[name].get)
    return formats, timings
