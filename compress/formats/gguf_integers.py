"""The integers of a GGUF file read back onto a model's linears, so that our decoder's integer
kernels can run an export whose quantized linears only its GGUF file holds (k-quants, Q5_0,
Q4_1 with a float minimum): the export folder keeps those linears as dense float weights.

Each block type is unpacked into the ``QuantizedWeight`` our passes left (``gguf_kquants.unpack``
for the types with block scales, here for Q4_0, Q5_0 and Q8_0), and attached only where it
dequantizes to the linear's weight as loaded (bit for bit, in the weight's dtype): a file that
is not this model's changes nothing.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from .. import kquant
from ..quant import QuantizedWeight, QuantScheme, quantized_of
from . import gguf_kquants
from .gguf_file import ARCHES, GROUP, LEGACY, PERMUTED, unpermute_rows

SYMMETRIC = {t: b.bits for t, b in LEGACY.items() if b.symmetric}  # q4_0, q5_0, q8_0: w = d * q


def unpack_symmetric(data: np.ndarray, cols: int, gguf_type: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, bytes per row) blocks of Q4_0, Q5_0 or Q8_0 -> (signed q, float32 scale per 32)."""
    rows = data.shape[0]
    b = np.ascontiguousarray(data).reshape(rows * cols // GROUP, -1)
    d = b[:, :2].copy().view(np.float16).astype(np.float32).reshape(rows, -1)
    if gguf_type == "q8_0":
        q = b[:, 2:].view(np.int8).astype(np.int16)
    else:
        nibbles = b[:, -16:]
        q = np.concatenate([nibbles & 0xF, nibbles >> 4], axis=1).astype(np.int16)
        if gguf_type == "q5_0":  # bit j of a little-endian uint32: weight j's fifth bit
            high = b[:, 2:6].copy().view("<u4").astype(np.int64)
            q |= (((high >> np.arange(GROUP)) & 1) << 4).astype(np.int16)
        q -= 2 ** (SYMMETRIC[gguf_type] - 1)
    return torch.from_numpy(q.reshape(rows, cols)).to(torch.int8), torch.from_numpy(d)


def quantized_weight(data: np.ndarray, cols: int, gguf_type: str) -> QuantizedWeight:
    """A GGUF tensor's blocks as the ``QuantizedWeight`` of the grid they hold."""
    if gguf_type in SYMMETRIC:
        q, scale = unpack_symmetric(data, cols, gguf_type)
        scheme = QuantScheme(SYMMETRIC[gguf_type], GROUP, True, fp16_scales=True)
        return QuantizedWeight(scheme, q, scale, torch.zeros(scale.shape, dtype=torch.int8))
    t = kquant.TYPES[gguf_type]
    q, scale, zero, supers = gguf_kquants.unpack(data, cols, gguf_type)
    scheme = QuantScheme(t.bits, t.group, t.symmetric, format=gguf_type)
    return QuantizedWeight(scheme, q, scale, zero.to(scheme.zero_dtype), supers)


def attach_export_integers(model: torch.nn.Module, folder: str | Path) -> None:
    """All of an export's integers, for the decoder's integer kernels: its compressed-tensors
    linears', then those only its GGUF file holds (k-quants, Q5_0, ...)."""
    from .compressed_tensors import attach_integers

    attach_integers(model, folder)
    attach(model, folder)


def attach(model: torch.nn.Module, folder: str | Path) -> int:
    """Attach to each linear of ``model`` (loaded from the export ``folder``) that holds no integers
    the ones the export's ``model-*.gguf`` stores for it; returns how many linears got one."""
    import gguf

    files = sorted(Path(folder).glob("model-*.gguf"))
    config = model.config
    if len(files) != 1 or config.model_type not in ARCHES:
        return 0
    arch = ARCHES[config.model_type]
    names = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, arch.upper()), config.num_hidden_layers)
    tensors = {t.name: t for t in gguf.GGUFReader(files[0]).tensors}
    attached = 0
    for name, linear in model.named_modules():
        if not isinstance(linear, torch.nn.Linear) or quantized_of(linear) is not None:
            continue
        found = tensors.get(names.get_name(f"{name}.weight", try_suffixes=(".weight",)) or "")
        kind = found.tensor_type.name.lower() if found is not None else ""
        if kind not in SYMMETRIC and kind not in kquant.TYPES:
            continue
        qw = quantized_weight(np.asarray(found.data), linear.in_features, kind)
        if arch in PERMUTED and found.name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = config.num_attention_heads if "attn_q" in found.name else config.num_key_value_heads
            parts = [unpermute_rows(t, heads) for t in (qw.q, qw.scale, qw.zero_point)]
            supers = qw.global_scale if qw.global_scale is None else unpermute_rows(qw.global_scale, heads)
            qw = QuantizedWeight(qw.scheme, *parts, supers)
        if torch.equal(qw.dequantized().to(linear.weight.dtype), linear.weight.detach()):
            qw.attach(linear)
            attached += 1
    return attached
