"""The Optimal Brain Surgeon column sweep shared by GPTQ and SparseGPT.

Columns of ``W`` are visited left to right. Each is pruned (where the mask says so)
and/or rounded to the grid, and its error is pushed onto the columns not visited yet
through ``U``, the upper Cholesky factor of ``H⁻¹`` (``H = 2XᵀX``):

    err = (w - q) / U[i, i]        W[:, i:] -= err ⊗ U[i, i:]

with lazy updates in blocks of ``blocksize`` columns (GPTQ §3). GPTAQ (Li et al. 2025, "GPTQ
v2") targets the dense model's output ``W X̂`` from the compressed inputs ``X``: with the
asymmetry ``A = 2(X̂ - X)Xᵀ/n``, ``P = α · triu₁(A Uᵀ) U`` and each column also moves the later
ones by ``w ⊗ P[i, i:]`` (its value before rounding; ``α`` 0.25 as in the paper's code, whose
lazy update reads the rounded values instead). SparseGPT chooses the
mask inside the sweep from ``w² / U[i, i]²``: per block of columns for unstructured
sparsity (its "adaptive mask selection"), per group of M columns for N:M. A mask given
by an earlier pruning pass is kept: those weights round to exactly zero.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import distributed, kquant, moe
from .hessian import Hessian, dead_columns, inverse_cholesky
from .quant import QuantizedWeight, QuantScheme, compute_qparams, global_scale_for, grid_codes, grid_values
from .sparsity import Pattern, nm_mask, select_mask


@dataclass
class SweepResult:
    weight: torch.Tensor  # float32, the final (pruned and/or dequantized) weight
    mask: torch.Tensor  # True where pruned
    quantized: QuantizedWeight | None  # the integers, when a scheme was given


def obs_sweep(
    weight: torch.Tensor,
    H: torch.Tensor,
    name: str,
    *,
    scheme: QuantScheme | None = None,
    prune: Pattern | None = None,
    mask: torch.Tensor | None = None,
    **options,
) -> SweepResult:
    """Round (``scheme``) and/or prune (``prune``, or a fixed ``mask``) ``weight`` column by column.

    Options: ``dtype``, the storage dtype scales are rounded to; ``percdamp``; ``blocksize``;
    ``asymmetry`` (``AsymmetricHessian.asymmetry``) and ``alpha``: GPTAQ's correction;
    ``actorder``: columns go in order of decreasing ``diag(H)`` while group scales stay tied to
    the original column positions ("static groups"), so the export needs no permutation (no
    ``g_idx``); ``overwrite``: ``H`` is factorised in place, for its last reader
    (``Hessian.take``). With several processes each rank sweeps a share of the rows (they never
    interact, except through an unstructured mask, chosen across rows: that sweep runs whole).
    """

    if scheme is not None and scheme.subtracts_minimum and (prune is not None or (mask is not None and mask.any())):
        raise ValueError(f"{name}: {scheme.describe()} has no code for an exact zero, so it cannot hold pruned weights")
    # NVFP4's global scale is the whole weight's (all of a fused group's rows), whichever rows a rank
    # sweeps; a k-quant's super-block scales are per row, chosen from the weights before the sweep
    global_scale = None if scheme is None else global_scale_for(weight, scheme)

    def rows(r: range):
        part = slice(r.start, r.stop)
        m = None if mask is None else mask[part]
        supers = global_scale[part] if scheme is not None and scheme.is_kquant else global_scale
        out = _sweep(weight[part], H, name, scheme, prune, m, global_scale=supers, **options)
        q = out.quantized
        return (out.weight, out.mask) + (() if q is None else (q.q, q.scale, q.zero_point))

    split = prune is None or prune.structured
    w, m, *q = distributed.by_rows(rows, weight.shape[0], split)
    return SweepResult(w, m, QuantizedWeight(scheme, *q, global_scale) if q else None)


@torch.no_grad()
def _asymmetry_update(asymmetry, dead, perm, U, alpha: float) -> torch.Tensor:
    """GPTAQ's pull of each column towards the dense model's output, in the sweep's column order:
    ``alpha · triu(A Uᵀ, 1) U``, strictly upper triangular, so a column never moves itself."""
    A = asymmetry.masked_fill(dead, 0)[perm][:, perm]
    Ud = U.to(A.dtype)
    return (alpha * (A @ Ud.T).triu_(1) @ Ud).float()


def _sweep(
    weight: torch.Tensor,
    H: torch.Tensor,
    name: str,
    scheme: QuantScheme | None,
    prune: Pattern | None,
    mask: torch.Tensor | None,
    dtype: torch.dtype = torch.float32,
    percdamp: float = 0.01,
    blocksize: int = 128,
    actorder: bool = False,
    asymmetry: torch.Tensor | None = None,
    alpha: float = 0.25,
    global_scale: torch.Tensor | None = None,
    overwrite: bool = False,
) -> SweepResult:
    W, dead = weight.to(torch.float32, copy=True), dead_columns(H)
    rows, cols = W.shape
    W[:, dead] = 0
    mask = torch.zeros_like(W, dtype=torch.bool) if mask is None else mask.clone()
    if scheme is not None:
        gs = cols if scheme.group_size == -1 else scheme.group_size
        static = actorder or scheme.group_size == -1
        if static:  # every group's scale from the weights before any update
            scale, zero = compute_qparams(W.masked_fill(mask, 0), scheme, dtype, global_scale)
        else:  # each group's scale from its weights as updated so far (the paper's default)
            scale = torch.empty(rows, cols // gs, device=W.device)
            zero = torch.empty_like(scale)
        Q = torch.empty(rows, cols, dtype=scheme.q_dtype, device=W.device)
    perm = torch.argsort(torch.diag(H), descending=True) if actorder else torch.arange(cols, device=W.device)
    if actorder:  # copies of the weight: only when the order changes
        W, mask = W[:, perm], mask[:, perm]
    U = inverse_cholesky(H, percdamp, name, perm, overwrite)
    group = (perm // gs).tolist() if scheme is not None else None
    P = None if asymmetry is None else _asymmetry_update(asymmetry, dead, perm, U, alpha)

    for i1 in range(0, cols, blocksize):
        i2 = min(i1 + blocksize, cols)
        W1, U1, M1 = W[:, i1:i2].clone(), U[i1:i2, i1:i2], mask[:, i1:i2]
        d = torch.diag(U1)
        Err1 = torch.zeros_like(W1)
        Before1 = torch.zeros_like(W1) if P is not None else None  # each column's value before rounding
        if prune is not None and not prune.structured:
            M1 |= select_mask((W1 / d).pow(2).masked_fill(M1, -1), prune, per_row=False)
        for i in range(i2 - i1):
            c = i1 + i
            if prune is not None and prune.structured and i % prune.m == 0:
                score = (W1[:, i : i + prune.m] / d[i : i + prune.m]).pow(2).masked_fill(M1[:, i : i + prune.m], -1)
                M1[:, i : i + prune.m] |= nm_mask(score, prune.n, prune.m)
            w = W1[:, i]
            q = w.masked_fill(M1[:, i], 0)
            if scheme is not None:
                g = group[c]
                if not static and c % gs == 0:
                    block = W1[:, i : i + gs].masked_fill(M1[:, i : i + gs], 0)
                    top = kquant.per_group(global_scale, cols // gs)[:, g : g + 1] if scheme.is_kquant else global_scale
                    s, z = compute_qparams(block, scheme, dtype, top)  # one group: gs columns, its super-block's
                    scale[:, g], zero[:, g] = s[:, 0], z[:, 0]
                qi = grid_codes(q, scale[:, g], zero[:, g], scheme)
                qi = torch.where(M1[:, i], zero[:, g], qi)  # pruned: the zero-point, which dequantizes to 0
                Q[:, c] = qi.to(scheme.q_dtype)
                q = grid_values(qi, scale[:, g], zero[:, g], scheme)
            err = (w - q) / U1[i, i]
            if P is not None:
                Before1[:, i] = w
                W1[:, i:] += w.unsqueeze(1) @ P[c, i1 + i : i2].unsqueeze(0)
            W1[:, i:] -= err.unsqueeze(1) @ U1[i, i:].unsqueeze(0)
            W1[:, i] = q
            Err1[:, i] = err
        W[:, i1:i2] = W1
        W[:, i2:] -= Err1 @ U[i1:i2, i2:]
        if P is not None:
            W[:, i2:] += Before1 @ P[i1:i2, i2:]
    if actorder:  # back to the original column order
        inverse = torch.argsort(perm)
        W, mask, Q = W[:, inverse], mask[:, inverse], (None if scheme is None else Q[:, inverse])
    if scheme is None:
        return SweepResult(W, mask, None)
    scale, zero = scale.to(scheme.scale_dtype(dtype)), zero.to(scheme.zero_dtype)
    return SweepResult(W, mask, QuantizedWeight(scheme, Q, scale, zero, global_scale))


def hessian_stages(data, groups: list[tuple[str, ...]], true_sequential: bool, make_stat=Hessian):
    """Yield ``(group, Hessian)`` (``make_stat(first_linear)``) for every group of linears that read
    the same input.

    With ``true_sequential`` each group (q/k/v, then o, then gate/up, then down) is observed
    only after the caller has transformed the groups before it, so it sees their compressed
    outputs; without, one forward observes every group of the block.
    """
    for stage in moe.sequential_stages(data.block, groups) if true_sequential else [groups]:
        # Later stages change only later linears, so o_proj's and down_proj's inputs stay valid:
        # the next stages (and the block's final forward) rebuild attention and MLP outputs from them.
        stats = data.observe(stage, make_stat, replay_after=true_sequential)
        for group in stage:
            yield group, stats[group[0]]
        data.settle()  # the caller has transformed this stage's linears: keep their outputs


def usable(H: Hessian) -> bool:
    # a band of rows at a time: isfinite over the whole matrix would allocate 1.4 times its size
    return H.n > 0 and all(bool(torch.isfinite(rows).all()) for rows in H.H.split(256))
