"""Real low-bit matmuls for decoding: W4 linears on torch's packed-int4 CPU kernel.

``torch.ops.aten._weight_int4pack_mm_for_cpu`` (tinygemm's layout) multiplies activations by
4-bit weights packed two per byte, with a (scale, zero) pair per group of 32/64/128/256
inputs and ``w = (u − 8)·scale + zero`` for ``u`` in 0..15. Our integers are signed
(``w = (q − z)·scale``, ``q`` in −8..7), so ``u = q + 8`` and ``zero = −z·scale``: the kernel
computes exactly the weights we evaluate. A quantized linear reads 1/8 of the bytes of its
fp32 form, which is what decoding one token at a time on a CPU waits for.

The integers come from the linear's ``quantized`` record: set by our passes in the same
process, or read back from an export's packed tensors by ``attach_from_export``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from .quant import QuantizedWeight, QuantScheme, quantized_of

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
