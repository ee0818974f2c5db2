"""Magnitude pruning: drop the weights of smallest |w| in each layer. No data.

The baseline Wanda and SparseGPT are measured against (as in both papers, the ranking
is over the whole layer for unstructured sparsity, within each group for N:M).
"""

from __future__ import annotations

from ..sparsity import prune_by_magnitude
from .base import PrunePass


class Magnitude(PrunePass):
    name = "magnitude"
    needs_data = False

    def apply(self, block, data, prefix: str) -> None:
        for lin in self.targets(block, prefix).values():
            prune_by_magnitude(lin, self.pattern)
