"""llama.cpp's k-quant grids (Q2_K to Q6_K): integers under sub-block scales that are themselves
integers under a float16 scale per super-block of 256 weights, as GGUF stores them.

Per super-block a type stores ``d`` (and, with a minimum, ``dmin``) as float16, per sub-block a
scale code ``k`` (and a minimum code ``m``), per weight a code ``u``; llama.cpp and gguf-py
dequantize in float32 as

    w = (d * k) * u - dmin * m      (Q2_K, Q4_K, Q5_K: unsigned u, a minimum)
    w = (d * k) * q                 (Q3_K, Q6_K: signed q, symmetric)

``d * k`` and ``dmin * m`` are exact in float32 (11 significant bits times at most 8), so our
``QuantizedWeight`` holds them as its per-group ``scale`` and (for the types with a minimum) its
float32 ``zero_point``, and the per-super-block ``(d, dmin)`` as its ``global_scale``, shape
(rows, super-blocks, 2). The super-block scales are chosen first, from the weights' ranges, and every
sub-block scale is then rounded onto their grid before a weight is rounded with it, so GPTQ's
sweep sees the values the file dequantizes to.

Q3_K's and Q6_K's scale codes are signed (6 and 8 bits). As llama.cpp does, we store a negative
``d`` and negative codes, so that the largest sub-block scale uses the code -32 (-128): one level
more than the positive side has.

Q4_1 and Q5_1 (``w = d * u + m``, float16 ``d`` and ``m`` per 32 weights) are the degenerate case:
a super-block of one group whose scale and minimum codes are 1, so ``d`` and ``-m`` are the group's
own scale and minimum rounded up to float16. Unlike our integer zero-points (``w = (q - z) * s``),
the minimum is then any float16 number, as llama.cpp's own Q4_1 stores it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SUPER = 256  # weights per k-quant super-block (llama.cpp's QK_K)

# Where a row is not whole super-blocks, llama.cpp writes another type (``llama-quant.cpp``)
FALLBACK = {"q2_k": "q4_0", "q3_k": "q4_0", "q4_k": "q5_0", "q5_k": "q5_1", "q6_k": "q8_0"}


@dataclass(frozen=True)
class KType:
    bits: int
    group: int  # weights per sub-block: one scale (and minimum) each
    scale_levels: int  # a sub-block's scale is d times 1..scale_levels
    min_levels: int  # its minimum dmin times 0..min_levels; 0: symmetric, no minimum
    block_bytes: int  # bytes per super-block in the file
    super: int = SUPER  # weights per super-block

    @property
    def symmetric(self) -> bool:
        return self.min_levels == 0

    @property
    def bits_per_weight(self) -> float:
        return self.block_bytes * 8 / self.super


TYPES = {
    "q2_k": KType(2, 16, 15, 15, 84),
    "q3_k": KType(3, 16, 32, 0, 110),
    "q4_k": KType(4, 32, 63, 63, 144),
    "q5_k": KType(5, 32, 63, 63, 176),
    "q6_k": KType(6, 16, 128, 0, 210),
    "q4_1": KType(4, 32, 1, 1, 20, super=32),
    "q5_1": KType(5, 32, 1, 1, 24, super=32),
}


def fp16_ceil(x: torch.Tensor) -> torch.Tensor:
    """The smallest float16 number >= ``x`` (positive), as float32: a super-block scale that leaves
    every sub-block scale within the codes."""
    x = x.float().clamp(min=2.0**-24, max=65504.0)
    half = x.to(torch.float16)
    up = (half.view(torch.int16) + 1).view(torch.float16)
    return torch.where(half.float() < x, up.float(), half.float())


def per_group(super_scales: torch.Tensor, groups: int) -> torch.Tensor:
    """(rows, supers, 2) super-block scales -> (rows, groups, 2), one per sub-block (as given when
    already one per group, as a sweep passes a single group's)."""
    if super_scales.shape[1] == groups:
        return super_scales
    return super_scales.repeat_interleave(groups // super_scales.shape[1], dim=1)


def super_scales(scale: torch.Tensor, minimum: torch.Tensor, ktype: KType) -> torch.Tensor:
    """(rows, supers, 2) float16 ``(d, dmin)`` from sub-block scales and minimums (rows, groups):
    the largest of each super-block maps to the top code."""
    rows, groups = scale.shape
    per = ktype.super // ktype.group
    d = fp16_ceil(scale.float().reshape(rows, groups // per, per).amax(-1) / ktype.scale_levels)
    if ktype.symmetric:
        dmin = torch.zeros_like(d)
    else:
        dmin = fp16_ceil(minimum.float().reshape(rows, groups // per, per).amax(-1) / ktype.min_levels)
    return torch.stack([d, dmin], dim=-1)


def snap(scale: torch.Tensor, minimum: torch.Tensor, ktype: KType, supers: torch.Tensor):
    """Sub-block scales and minimums (rows, groups) rounded onto the grid of their super-block's
    ``(d, dmin)`` (``supers``, per group or per super-block): the values the file stores."""
    s = per_group(supers, scale.shape[1])
    d, dmin = s[..., 0], s[..., 1]
    k = torch.round(scale.float() / d).clamp(1, ktype.scale_levels)
    if ktype.symmetric:
        return d * k, torch.zeros_like(d)
    m = torch.round(minimum.float() / dmin).clamp(0, ktype.min_levels)  # dmin >= 2^-24 (``fp16_ceil``)
    return d * k, dmin * m


def codes(scale: torch.Tensor, minimum: torch.Tensor, supers: torch.Tensor, ktype: KType):
    """The sub-block codes ``(k, m)`` (rows, groups) of snapped scales and minimums: exact quotients."""
    s = per_group(supers, scale.shape[1])
    k = torch.round(scale.float() / s[..., 0])
    m = torch.zeros_like(k) if ktype.symmetric else torch.round(minimum.float() / s[..., 1])
    if not (torch.equal(k * s[..., 0], scale.float()) and torch.equal(m * s[..., 1], minimum.float())):
        raise ValueError("scales are not on their super-block's grid")
    return k.to(torch.int16), m.to(torch.int16)
