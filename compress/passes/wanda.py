"""Wanda (Sun et al. 2023): prune by ``|W_ij| · ‖X_j‖₂``, compared within each output row.

One forward over the calibration data gives every input channel's norm; there is no
weight update, so Wanda costs about one block forward per block.
"""

from __future__ import annotations

import torch

from .. import distributed
from ..sparsity import apply_mask, select_mask
from .base import PrunePass


class _SquaredNorm:
    """``Σ x_j²`` over every calibration token, per input channel."""

    def __init__(self, linear: torch.nn.Linear):
        self.sq = torch.zeros(linear.in_features, device=linear.weight.device, dtype=torch.float64)

    def add(self, x: torch.Tensor) -> None:  # float64: the order of the sums (one process or several) does not show
        self.sq += x.reshape(-1, x.shape[-1]).double().pow(2).sum(0)

    def reduce(self) -> None:
        distributed.sum_(self.sq)


class Wanda(PrunePass):
    name = "wanda"

    def apply(self, block, data, prefix: str) -> None:
        targets = self.targets(block, prefix)
        norms = data.observe(self.target_groups(targets), _SquaredNorm)
        for name, lin in targets.items():
            score = lin.weight.data.float().abs() * norms[name].sq.sqrt().float()
            apply_mask(lin, select_mask(score, self.pattern, per_row=True))
