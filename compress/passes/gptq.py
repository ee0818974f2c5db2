"""GPTQ (Frantar et al. 2022): quantize one column at a time, push its rounding
error onto the not-yet-quantized columns through the inverse Hessian.

The column sweep itself (``H = 2XᵀX``, ``U = chol(H⁻¹)ᵀ``, lazy block updates,
act-order with static groups) lives in ``compress/obs.py``, shared with SparseGPT.
Weights pruned by an earlier pass stay exactly zero.
"""

from __future__ import annotations

import warnings

from ..obs import hessian_stages, obs_sweep, usable
from ..quant import attach, quantize_weight
from ..sparsity import prune_mask_of
from .base import RecipeError, WeightQuantOptions, WeightQuantPass


class GPTQOptions(WeightQuantOptions):
    percdamp: float = 0.01
    blocksize: int = 128
    actorder: bool = False
    true_sequential: bool = True


class GPTQ(WeightQuantPass):
    name = "gptq"
    Options = GPTQOptions

    def check(self, model) -> None:
        super().check(model)
        gs = self.scheme.group_size
        if gs != -1 and self.options.blocksize % gs:
            raise RecipeError(f"{self.where}.blocksize: {self.options.blocksize} must be a multiple of the group "
                              f"size {gs}")

    def apply(self, block, data, prefix: str) -> None:
        o = self.options
        targets = self.targets(block, prefix)
        for name, H in hessian_stages(data, self.target_groups(targets), o.true_sequential):
            lin, mask = targets[name], prune_mask_of(targets[name])
            if not usable(H):
                warnings.warn(f"{prefix}{name}: no usable calibration input; falling back to RTN", stacklevel=2)
                w = lin.weight.data if mask is None else lin.weight.data.masked_fill(mask, 0)
                attach(lin, quantize_weight(w, self.scheme, self.dtype))
                continue
            result = obs_sweep(lin.weight.data, H.H, prefix + name, scheme=self.scheme, dtype=self.dtype, mask=mask,
                               percdamp=o.percdamp, blocksize=o.blocksize, actorder=o.actorder)
            attach(lin, result.quantized)

    def summary(self) -> str:
        return f"gptq {self.scheme.describe()}" + (" actorder" if self.options.actorder else "")
