"""Round-to-nearest weight quantization: min/max scales per group, no data.

The baseline every other quantizer must beat.
"""

from __future__ import annotations

from ..quant import attach, quantize_weight
from .base import WeightQuantPass


class RTN(WeightQuantPass):
    name = "rtn"
    needs_data = False

    def apply(self, block, data, prefix: str) -> None:
        for lin in self.targets(block, prefix).values():
            attach(lin, quantize_weight(lin.weight.data, self.scheme, self.dtype))
