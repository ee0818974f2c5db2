"""Sparsity patterns and masks shared by every pruning pass (magnitude, Wanda, SparseGPT).

A pattern is ``unstructured`` (a target ratio) or ``N:M`` (at most N non-zeros in every M
consecutive inputs of a row: ``2:4`` is what sparse tensor cores run). A mask is a bool
tensor shaped like the weight, True where the weight is pruned. Pruned weights are exactly
zero and stay so: the mask is kept on the module (``PruneMask``) so that a later
GPTQ pass rounds them to zero too, and quantized integers of a pruned weight equal the
zero-point, so the exported checkpoint dequantizes them to exact zeros.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from .quant import QuantizedWeight, attach, quantized_of
from .state import State


@dataclass(frozen=True)
class Pattern:
    sparsity: float  # share of weights pruned
    n: int = 0  # N:M: keep at most n of every m; 0 for unstructured
    m: int = 0

    @property
    def structured(self) -> bool:
        return self.m > 0

    def describe(self) -> str:
        return f"{self.n}:{self.m}" if self.structured else f"{self.sparsity:.0%} unstructured"


def parse_pattern(pattern: str, sparsity: float | None) -> Pattern:
    """``"unstructured"`` with a ratio, or ``"N:M"`` (its ratio is 1 - N/M)."""
    if pattern == "unstructured":
        ratio = 0.5 if sparsity is None else sparsity
        if not 0 < ratio < 1:
            raise ValueError(f"sparsity must be between 0 and 1 (exclusive), got {ratio}")
        return Pattern(ratio)
    match = re.fullmatch(r"(\d+):(\d+)", pattern)
    if not match or not 0 < int(match[1]) < int(match[2]):
        raise ValueError(f"pattern must be 'unstructured' or 'N:M' with 0 < N < M (e.g. 2:4), got {pattern!r}")
    n, m = int(match[1]), int(match[2])
    if sparsity is not None and abs(sparsity - (1 - n / m)) > 1e-9:
        raise ValueError(f"pattern {pattern} fixes the sparsity at {1 - n / m:g}; drop 'sparsity' or set it to that")
    return Pattern(1 - n / m, n, m)


def nm_mask(score: torch.Tensor, n: int, m: int) -> torch.Tensor:
    """In every group of ``m`` consecutive columns, prune the ``m - n`` lowest scores of each row."""
    rows, cols = score.shape
    grouped = score.reshape(rows, cols // m, m)
    lowest = torch.topk(grouped, m - n, dim=-1, largest=False).indices
    return torch.zeros_like(grouped, dtype=torch.bool).scatter_(-1, lowest, True).reshape(rows, cols)


def select_mask(score: torch.Tensor, pattern: Pattern, per_row: bool) -> torch.Tensor:
    """Prune the lowest scores: per N:M group, per output row (Wanda), or over the whole layer."""
    if pattern.structured:
        return nm_mask(score, pattern.n, pattern.m)
    if per_row:
        k = round(score.shape[1] * pattern.sparsity)
        lowest = torch.topk(score, k, dim=1, largest=False).indices
        return torch.zeros_like(score, dtype=torch.bool).scatter_(1, lowest, True)
    k = round(score.numel() * pattern.sparsity)
    lowest = torch.topk(score.flatten(), k, largest=False).indices
    return torch.zeros(score.numel(), dtype=torch.bool, device=score.device).scatter_(0, lowest, True).view_as(score)


class PruneMask(State, attr="prune_mask"):
    """Which weights of a linear are pruned (True): they stay zero through later passes and training."""

    def __init__(self, mask: torch.Tensor):
        self.mask = mask

    def saved(self):
        return {"mask": self.mask}, {}

    @classmethod
    def restored(cls, tensors, meta):
        return cls(tensors["mask"])


def apply_mask(linear: torch.nn.Linear, mask: torch.Tensor) -> None:
    """Zero the pruned weights (and their integers, if already quantized) and remember the mask."""
    linear.weight.data = linear.weight.data.masked_fill(mask, 0)
    qw = quantized_of(linear)
    if qw is not None:
        zero = qw.zero_point.repeat_interleave(qw.q.shape[1] // qw.zero_point.shape[1], dim=1)
        q = torch.where(mask, zero.float(), qw.q.float()).to(qw.q.dtype)
        attach(linear, QuantizedWeight(qw.scheme, q, qw.scale, qw.zero_point, qw.global_scale))
    previous = prune_mask_of(linear)
    PruneMask(mask if previous is None else previous | mask).attach(linear)


def prune_by_magnitude(linear: torch.nn.Linear, pattern: Pattern) -> None:
    """Drop the weights of smallest |w| (over the layer, or within each group for N:M): the data-free baseline."""
    apply_mask(linear, select_mask(linear.weight.data.float().abs(), pattern, per_row=False))


def prune_mask_of(linear: torch.nn.Module) -> torch.Tensor | None:
    state = PruneMask.of(linear)
    return None if state is None else state.mask
