"""GPTQ (Frantar et al. 2022): quantize one column at a time, push its rounding
error onto the not-yet-quantized columns through the inverse Hessian.

The column sweep itself (``H = 2XᵀX``, ``U = chol(H⁻¹)ᵀ``, lazy block updates,
act-order with static groups) lives in ``compress/column_sweep.py``, shared with SparseGPT.
Weights pruned by an earlier pass stay exactly zero.

``gptaq: true`` (GPTAQ, Li et al. 2025, "GPTQ v2"): each linear fits the dense model's output
instead of its own output on the inputs it now receives, which carry the rounding error of every
layer before it. The dense side is the block as the earlier passes left it (AWQ's scales folded
in), run on the dense model's inputs to the block, which the pipeline carries alongside.
"""

from __future__ import annotations

import copy
import warnings

import torch
from pydantic import Field

from .. import moe
from ..arch import decoder_layers
from ..column_sweep import hessian_stages, obs_sweep, usable
from ..hessian import AsymmetricHessian, Hessian
from ..quant import QuantizedWeight, attach, quantize_weight
from ..sparsity import prune_mask_of
from .base import RecipeError, WeightQuantOptions, WeightQuantPass


class GPTQOptions(WeightQuantOptions):
    percdamp: float = Field(0.01, gt=0, le=1)  # damping added to the Hessian's diagonal, as a share of its mean
    blocksize: int = Field(128, gt=0)
    actorder: bool = False
    true_sequential: bool = True
    gptaq: bool = False
    gptaq_alpha: float = Field(0.25, gt=0, le=1)


class GPTQ(WeightQuantPass):
    name = "gptq"
    Options = GPTQOptions
    uses_hessian = True

    @property
    def holds_block_statistics(self) -> bool:
        return not self.options.true_sequential

    def check(self, model) -> None:
        super().check(model)
        gs = self.scheme.group_size
        if gs != -1 and self.options.blocksize % gs:
            raise RecipeError(
                f"{self.where}.blocksize: {self.options.blocksize} must be a multiple of the group size {gs}"
            )
        if self.options.gptaq and any(moe.experts_of(block) for block in decoder_layers(model)):
            raise RecipeError(
                f"{self.where}.gptaq: not for mixture-of-experts models (the dense and the compressed model "
                "route tokens to different experts, so their inputs do not pair up); remove it"
            )

    @property
    def needs_dense_inputs(self) -> bool:
        return self.options.gptaq

    @staticmethod
    def _asymmetric(block, data):
        """GPTAQ's statistic for a linear of ``block``, its dense side from a copy of the block
        taken now, before this pass rounds anything."""
        dense = copy.deepcopy(block)
        names = {module: name for name, module in block.named_modules()}
        return lambda linear: AsymmetricHessian(linear, data.dense_inputs_to(dense, names[linear]))

    def apply(self, block, data, prefix: str) -> None:
        o = self.options
        targets = self.targets(block, prefix)
        make_stat = self._asymmetric(block, data) if o.gptaq else Hessian
        for group, H in hessian_stages(data, self.target_groups(targets), o.true_sequential, make_stat):
            if not usable(H):
                warnings.warn(
                    f"{prefix}{'/'.join(group)}: no usable calibration input; falling back to RTN", stacklevel=2
                )
                for name in group:
                    lin, mask = targets[name], prune_mask_of(targets[name])
                    w = lin.weight.data if mask is None else lin.weight.data.masked_fill(mask, 0)
                    attach(lin, quantize_weight(w, self.scheme_for(prefix + name), self.dtype))
                continue
            schemes = {name: self.scheme_for(prefix + name) for name in group}  # a GGUF mix may differ within a group
            distinct = list(dict.fromkeys(schemes.values()))
            for scheme in distinct:
                names = [name for name in group if schemes[name] == scheme]
                last = scheme == distinct[-1]
                self._sweep([targets[name] for name in names], H, scheme, prefix + "/".join(names), last)

    def _sweep(self, linears: list, H, scheme, name: str, last: bool) -> None:
        """Round ``linears``, which read one input, with ``scheme``. Rows never interact in the sweep,
        so they go through it as one stacked matrix: one factorisation, one pass over the columns.
        ``last``: no other sweep reads ``H``, which is then factorised in place."""
        o = self.options
        weight = torch.cat([lin.weight.data for lin in linears]) if len(linears) > 1 else linears[0].weight.data
        masks = [prune_mask_of(lin) for lin in linears]
        mask = torch.cat(
            [m if m is not None else torch.zeros_like(lin.weight, dtype=torch.bool) for lin, m in zip(linears, masks)]
        )  # no prune mask: nothing pruned
        asymmetry = H.asymmetry if o.gptaq else None
        q = obs_sweep(
            weight,
            H.take() if last else H.H,
            name,
            scheme=scheme,
            dtype=self.dtype,
            mask=mask,
            percdamp=o.percdamp,
            blocksize=o.blocksize,
            actorder=o.actorder,
            asymmetry=asymmetry,
            alpha=o.gptaq_alpha,
            overwrite=last,
        ).quantized
        rows = [lin.out_features for lin in linears]
        # NVFP4's global scale is shared by the stacked linears, a k-quant's super-block scales are per row
        tops = q.global_scale.split(rows) if q.scheme.is_kquant else [q.global_scale] * len(linears)
        parts = zip(linears, q.q.split(rows), q.scale.split(rows), q.zero_point.split(rows), tops)
        for lin, ints, scale, zero, top in parts:
            top = None if top is None else top.clone()  # each linear its own storage
            attach(lin, QuantizedWeight(q.scheme, ints.clone(), scale.clone(), zero.clone(), top))

    def summary(self) -> str:
        o = self.options
        return f"gptq {self.scheme.describe()}" + (" actorder" if o.actorder else "") + (" gptaq" if o.gptaq else "")
