"""SparseGPT (Frantar & Alistarh 2023): choose the mask inside the OBS column sweep from
``w² / [H⁻¹]²_cc`` and reconstruct the surviving weights from the pruned ones' error.

Unstructured masks are chosen per block of ``blocksize`` columns (adaptive mask selection),
N:M masks per group of M columns. With ``quantize:`` the survivors are rounded in the same
sweep (GPTQ-style), so "2:4 + W4" is one pass over the data. The sweep is ``compress/column_sweep.py``.
"""

from __future__ import annotations

import warnings
from dataclasses import replace

from .. import kquant
from ..column_sweep import hessian_stages, obs_sweep, usable
from ..quant import attach
from ..sparsity import apply_mask, prune_by_magnitude, prune_mask_of
from .base import PruneOptions, PrunePass, QuantSpec, RecipeError, resolve_scheme


class SparseGPTOptions(PruneOptions):
    quantize: QuantSpec | None = None  # e.g. {bits: 4, group_size: auto}: prune and round jointly
    percdamp: float = 0.01
    blocksize: int = 128
    true_sequential: bool = True


class SparseGPT(PrunePass):
    name = "sparsegpt"
    Options = SparseGPTOptions
    uses_hessian = True
    leaves = frozenset({"prune_mask", "quantized"})
    scheme = None

    @property
    def holds_block_statistics(self) -> bool:
        return not self.options.true_sequential

    @property
    def weight_bits(self) -> int | None:
        return self.options.quantize.bits if self.options.quantize is not None else None

    @property
    def rounding(self):
        return self.options.quantize

    def check(self, model) -> None:
        super().check(model)
        o = self.options
        if self.pattern.structured and o.blocksize % self.pattern.m:
            raise RecipeError(f"{self.where}.blocksize: {o.blocksize} must be a multiple of M={self.pattern.m}")
        if o.quantize is not None:
            if o.quantize.format in kquant.TYPES:  # a GGUF grid: a minimum has no exact zero, mixes vary per layer
                raise RecipeError(
                    f"{self.where}.quantize.format: {o.quantize.format} is not rounded jointly with pruning; "
                    "quantize in a gptq pass after this one"
                )
            scheme = resolve_scheme(o.quantize, self.widths, f"{self.where}.quantize")
            self.scheme = replace(scheme, fp16_scales=self.fp16_scales)
            gs = self.scheme.group_size
            if gs != -1 and o.blocksize % gs:
                raise RecipeError(f"{self.where}.blocksize: {o.blocksize} must be a multiple of the group size {gs}")

    def apply(self, block, data, prefix: str) -> None:
        o = self.options
        targets = self.targets(block, prefix)
        for group, H in hessian_stages(data, self.target_groups(targets), o.true_sequential):
            for name in group:  # masks are chosen per linear; the group's last factorises H in place
                self._sweep(targets[name], H, prefix + name, last=name == group[-1])

    def _sweep(self, lin, H, name: str, last: bool) -> None:
        o = self.options
        if not usable(H):
            warnings.warn(f"{name}: no usable calibration input; falling back to magnitude pruning", stacklevel=3)
            prune_by_magnitude(lin, self.pattern)
            return
        result = obs_sweep(
            lin.weight.data,
            H.take() if last else H.H,
            name,
            scheme=self.scheme,
            dtype=self.dtype,
            prune=self.pattern,
            mask=prune_mask_of(lin),
            percdamp=o.percdamp,
            blocksize=o.blocksize,
            overwrite=last,
        )
        if result.quantized is not None:
            attach(lin, result.quantized)
        else:
            lin.weight.data = result.weight.to(self.dtype).to(lin.weight.dtype)
        apply_mask(lin, result.mask)

    def summary(self) -> str:
        return super().summary() + (f" + {self.scheme.describe()}" if self.scheme is not None else "")
