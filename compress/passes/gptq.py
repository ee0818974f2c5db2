"""GPTQ (Frantar et al. 2022): quantize one column at a time, push its rounding
error onto the not-yet-quantized columns through the inverse Hessian.

Notation as in the paper: ``H = 2XᵀX``, ``U = chol(H⁻¹)ᵀ`` (upper), lazy updates
in blocks of ``blocksize`` columns. With ``actorder`` columns go in order of
decreasing ``diag(H)`` while group scales stay tied to the original column
positions ("static groups"), so the export needs no permutation (no ``g_idx``).
"""

from __future__ import annotations

import warnings

import torch

from ..hessian import Hessian, dead_columns, inverse_cholesky
from ..quant import QuantizedWeight, QuantScheme, attach, compute_qparams, quantize_weight
from .base import RecipeError, WeightQuantOptions, WeightQuantPass


class GPTQOptions(WeightQuantOptions):
    percdamp: float = 0.01
    blocksize: int = 128
    actorder: bool = False
    true_sequential: bool = True


@torch.no_grad()
def gptq_quantize(weight: torch.Tensor, H: torch.Tensor, scheme: QuantScheme, dtype: torch.dtype,
                  percdamp: float = 0.01, blocksize: int = 128, actorder: bool = False,
                  name: str = "layer") -> QuantizedWeight:
    W = weight.float().clone()
    rows, cols = W.shape
    W[:, dead_columns(H)] = 0
    gs = cols if scheme.group_size == -1 else scheme.group_size
    column_scheme = QuantScheme(scheme.bits, -1, scheme.symmetric)
    static = actorder or scheme.group_size == -1
    if static:  # every group's scale from the weights before any update
        scale, zero = compute_qparams(W, scheme, dtype)
    else:  # each group's scale from its weights as updated so far (the paper's default)
        scale = torch.empty(rows, cols // gs, device=W.device)
        zero = torch.empty_like(scale)

    perm = torch.argsort(torch.diag(H), descending=True) if actorder else torch.arange(cols, device=W.device)
    W, H = W[:, perm], H[perm][:, perm]
    U = inverse_cholesky(H, percdamp, name)
    group = (perm // gs).tolist()
    Q = torch.empty(rows, cols, dtype=torch.int8, device=W.device)

    for i1 in range(0, cols, blocksize):
        i2 = min(i1 + blocksize, cols)
        W1, U1 = W[:, i1:i2].clone(), U[i1:i2, i1:i2]
        Err1 = torch.zeros_like(W1)
        for i in range(i2 - i1):
            c, g = i1 + i, group[i1 + i]
            if not static and c % gs == 0:
                s, z = compute_qparams(W1[:, i : i + gs], column_scheme, dtype)
                scale[:, g], zero[:, g] = s[:, 0], z[:, 0]
            w = W1[:, i]
            q = torch.clamp(torch.round(w / scale[:, g]) + zero[:, g], scheme.qmin, scheme.qmax)
            Q[:, c] = q.to(torch.int8)
            err = (w - (q - zero[:, g]) * scale[:, g]) / U1[i, i]
            W1[:, i:] -= err.unsqueeze(1) @ U1[i, i:].unsqueeze(0)
            Err1[:, i] = err
        W[:, i2:] -= Err1 @ U[i1:i2, i2:]

    Q = Q[:, torch.argsort(perm)]
    return QuantizedWeight(scheme, Q, scale.to(dtype), zero.to(torch.int8))


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
        if not targets:
            return
        groups = self.target_groups(targets)
        # true_sequential: each group sees the inputs produced by the already-quantized groups before it
        stages = [[g] for g in groups] if o.true_sequential else [groups]
        for stage in stages:
            stats = data.observe(stage, Hessian)
            for name in (n for g in stage for n in g):
                lin, H = targets[name], stats[name]
                if H.n == 0 or not torch.isfinite(H.H).all():
                    warnings.warn(f"{prefix}{name}: no usable calibration input; falling back to RTN", stacklevel=2)
                    attach(lin, quantize_weight(lin.weight.data, self.scheme, self.dtype))
                    continue
                attach(lin, gptq_quantize(lin.weight.data, H.H, self.scheme, self.dtype, o.percdamp,
                                          o.blocksize, o.actorder, prefix + name))

    def summary(self) -> str:
        return f"gptq {self.scheme.describe()}" + (" actorder" if self.options.actorder else "")
