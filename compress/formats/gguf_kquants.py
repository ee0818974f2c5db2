"""llama.cpp's k-quant blocks (``block_q2_K`` ... ``block_q6_K`` in ggml-common.h), packed bit for
bit from a ``QuantizedWeight`` on a k-quant grid (``compress/kquant.py``): part of the GGUF format
(``gguf_file``), kept apart because each type has its own byte layout.

Every layout is the inverse of gguf-py's ``dequantize_blocks`` for the type, which the tests use to
check that the file dequantizes to the very weights we evaluated.
"""

from __future__ import annotations

import numpy as np
import torch

from .. import kquant


def _fp16(x: torch.Tensor) -> np.ndarray:
    """(blocks,) float32 holding float16 numbers -> (blocks, 2) bytes."""
    return x.to(torch.float16).numpy().reshape(-1, 1).view(np.uint8)


def _bits(u: np.ndarray, lanes: int, width: int) -> np.ndarray:
    """Pack ``lanes`` runs of ``width``-bit values into bytes: u (blocks, lanes, n) -> (blocks, n),
    lane j at bit ``j * width`` (how llama.cpp interleaves 2-, 4- and 1-bit planes)."""
    out = np.zeros(u.shape[::2], dtype=np.uint8)
    for j in range(lanes):
        out |= (u[:, j] & ((1 << width) - 1)) << (j * width)
    return out


def _scales_k4(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Q4_K's and Q5_K's 12 bytes of eight 6-bit scales and minimums (``get_scale_min_k4``)."""
    low = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    mid = m[:, :4] | ((m[:, 4:] >> 4) << 6)
    high = (sc[:, 4:] & 0xF) | ((m[:, 4:] & 0xF) << 4)
    return np.concatenate([low, mid, high], axis=1)


def pack(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, supers: torch.Tensor, gguf_type: str) -> np.ndarray:
    """(rows, cols) codes with per-group ``scale``/``zero`` under ``supers`` (rows, super-blocks, 2)
    -> (rows, bytes per row) uint8 in the type's block layout."""
    ktype = kquant.TYPES[gguf_type]
    rows, cols = q.shape
    if cols % ktype.super:
        raise ValueError(f"{gguf_type} packs rows of whole blocks of {ktype.super}; got {cols} columns")
    k, m = kquant.codes(scale, zero, supers, ktype)
    blocks = rows * cols // ktype.super
    k = k.numpy().reshape(blocks, -1)
    m = m.numpy().reshape(blocks, -1).astype(np.uint8)
    d, dmin = supers[..., 0].reshape(-1), supers[..., 1].reshape(-1)
    if ktype.symmetric:  # signed scale codes, as llama.cpp stores them: negative d and codes
        d, k = -d, -k
        u = (q.to(torch.int16) + 2 ** (ktype.bits - 1)).numpy().astype(np.uint8).reshape(blocks, ktype.super)
    else:
        u = q.numpy().astype(np.uint8).reshape(blocks, ktype.super)
    if gguf_type in ("q4_1", "q5_1"):  # w = d * u + m: m is minus our minimum
        parts = [_fp16(scale.reshape(-1)), _fp16(-zero.reshape(-1))]  # its codes are 1 (and 0 or 1): d and dmin
        if gguf_type == "q5_1":  # bit i of byte b: the fifth bit of weight 8b + i
            parts.append(_bits((u >> 4).reshape(blocks, 4, 8).transpose(0, 2, 1), 8, 1))
        parts.append((u[:, :16] & 0xF) | ((u[:, 16:] & 0xF) << 4))
    elif gguf_type == "q2_k":
        scales = k.astype(np.uint8) | (m << 4)
        qs = _bits(u.reshape(blocks, 2, 4, 32).transpose(0, 2, 1, 3).reshape(blocks, 4, 64), 4, 2)
        parts = [scales, qs, _fp16(d), _fp16(dmin)]
    elif gguf_type == "q3_k":
        code = (k + 32).astype(np.uint8)  # -32..31 stored as 0..63
        hmask = _bits((u >> 2).reshape(blocks, 8, 32), 8, 1)
        qs = _bits((u & 3).reshape(blocks, 2, 4, 32).transpose(0, 2, 1, 3).reshape(blocks, 4, 64), 4, 2)
        low = (code[:, :8] & 0xF) | ((code[:, 8:] & 0xF) << 4)
        high = _bits((code >> 4).reshape(blocks, 4, 4), 4, 2)
        parts = [hmask, qs, low, high, _fp16(d)]
    elif gguf_type in ("q4_k", "q5_k"):
        scales = _scales_k4(k.astype(np.uint8), m)
        nibbles = _bits((u & 0xF).reshape(blocks, 4, 2, 32).transpose(0, 2, 1, 3).reshape(blocks, 2, 128), 2, 4)
        parts = [_fp16(d), _fp16(dmin), scales]
        if gguf_type == "q5_k":
            parts.append(_bits((u >> 4).reshape(blocks, 8, 32), 8, 1))
        parts.append(nibbles)
    else:  # q6_k
        lo = (u & 0xF).reshape(blocks, 2, 2, 64).transpose(0, 2, 1, 3).reshape(blocks, 2, 128)
        hi = (u >> 4).reshape(blocks, 2, 4, 32).transpose(0, 2, 1, 3).reshape(blocks, 4, 64)
        parts = [_bits(lo, 2, 4), _bits(hi, 4, 2), k.astype(np.int8).view(np.uint8), _fp16(d)]
    packed = np.concatenate(parts, axis=1)
    assert packed.shape[1] == ktype.block_bytes
    return packed.reshape(rows, -1)


def _f16(b: np.ndarray, at: int) -> torch.Tensor:
    """The float16 at byte ``at`` of every block, as float32 (blocks,)."""
    return torch.from_numpy(np.ascontiguousarray(b[:, at : at + 2]).view(np.float16).astype(np.float32).reshape(-1))


def _unbits(x: np.ndarray, lanes: int, width: int) -> np.ndarray:
    """``_bits`` undone: (blocks, n) bytes -> (blocks, lanes, n) values."""
    return np.stack([(x >> (j * width)) & ((1 << width) - 1) for j in range(lanes)], axis=1)


def unpack(data: np.ndarray, cols: int, gguf_type: str) -> tuple[torch.Tensor, ...]:
    """``pack`` undone: (rows, bytes per row) uint8 blocks -> (q, scale, zero, supers) as a
    ``QuantizedWeight`` on the type's grid holds them (exact: every scale is a float16 times a code)."""
    ktype = kquant.TYPES[gguf_type]
    rows = data.shape[0]
    blocks = rows * cols // ktype.super
    b = np.ascontiguousarray(data).reshape(blocks, ktype.block_bytes)
    m = np.zeros((blocks, ktype.super // ktype.group), dtype=np.int16)
    if gguf_type in ("q4_1", "q5_1"):
        d, dmin = _f16(b, 0), -_f16(b, 2)
        k, m = np.ones((blocks, 1), dtype=np.int16), np.ones((blocks, 1), dtype=np.int16)
        nibbles = b[:, -16:]
        u = np.concatenate([nibbles & 0xF, nibbles >> 4], axis=1)
        if gguf_type == "q5_1":
            u |= _unbits(b[:, 4:8], 8, 1).transpose(0, 2, 1).reshape(blocks, 32) << 4
    elif gguf_type == "q2_k":
        k, m = (b[:, :16] & 0xF).astype(np.int16), (b[:, :16] >> 4).astype(np.int16)
        u = _unbits(b[:, 16:80], 4, 2).reshape(blocks, 4, 2, 32).transpose(0, 2, 1, 3).reshape(blocks, 256)
        d, dmin = _f16(b, 80), _f16(b, 82)
    elif gguf_type == "q3_k":
        u = _unbits(b[:, 32:96], 4, 2).reshape(blocks, 4, 2, 32).transpose(0, 2, 1, 3).reshape(blocks, 256)
        u |= _unbits(b[:, :32], 8, 1).reshape(blocks, 256) << 2
        low, high = b[:, 96:104], _unbits(b[:, 104:108], 4, 2).reshape(blocks, 16)
        code = np.concatenate([low & 0xF, low >> 4], axis=1) | (high << 4)
        k, d, dmin = -(code.astype(np.int16) - 32), -_f16(b, 108), None  # stored negated (``pack``)
    elif gguf_type in ("q4_k", "q5_k"):
        low, mid, high = b[:, 4:8], b[:, 8:12], b[:, 12:16]
        k = np.concatenate([low & 63, (high & 0xF) | ((low >> 6) << 4)], axis=1).astype(np.int16)
        m = np.concatenate([mid & 63, (high >> 4) | ((mid >> 6) << 4)], axis=1).astype(np.int16)
        nibbles = _unbits(b[:, -128:], 2, 4).reshape(blocks, 2, 4, 32).transpose(0, 2, 1, 3).reshape(blocks, 256)
        u = nibbles | (_unbits(b[:, 16:48], 8, 1).reshape(blocks, 256) << 4 if gguf_type == "q5_k" else 0)
        d, dmin = _f16(b, 0), _f16(b, 2)
    else:  # q6_k
        u = _unbits(b[:, :128], 2, 4).reshape(blocks, 2, 2, 64).transpose(0, 2, 1, 3).reshape(blocks, 256)
        hi = _unbits(b[:, 128:192], 4, 2).reshape(blocks, 4, 2, 32).transpose(0, 2, 1, 3).reshape(blocks, 256)
        u |= hi << 4
        k, d, dmin = -b[:, 192:208].view(np.int8).astype(np.int16), -_f16(b, 208), None
    if dmin is None:
        dmin = torch.zeros_like(d)
    q = torch.from_numpy(u.astype(np.int16)).reshape(rows, cols)
    if ktype.symmetric:
        q = q - 2 ** (ktype.bits - 1)
    per = ktype.super // ktype.group
    scale = (d[:, None] * torch.from_numpy(k.astype(np.float32))).reshape(rows, -1)
    zero = (dmin[:, None] * torch.from_numpy(m.astype(np.float32))).reshape(rows, -1)
    supers = torch.stack([d, dmin], dim=-1).reshape(rows, cols // ktype.super, 2)
    assert scale.shape[1] == cols // ktype.super * per
    return q.to(torch.int8), scale, zero, supers
