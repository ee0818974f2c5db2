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

import json
from pathlib import Path

import torch
from torch import nn

from ..quant import QuantizedWeight, QuantScheme, input_quant_of, quantized_of

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
