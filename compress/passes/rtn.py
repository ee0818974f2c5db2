"""Round-to-nearest weight quantization: min/max scales per group, no data.

The baseline every other quantizer must beat.
"""

from __future__ import annotations

from .base import WeightQuantPass


class RTN(WeightQuantPass):
    name = "rtn"
    needs_data = False

    def apply(self, block, data, prefix: str) -> None:
        self.round_to_nearest(self.targets(block, prefix), prefix)
