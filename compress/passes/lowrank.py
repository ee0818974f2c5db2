"""Low-rank factorisation of each targeted linear: plain SVD, ASVD or SVD-LLM (``method``).

``ratio`` is the share of the targeted parameters kept. ``allocation: uniform`` gives every
layer that ratio; ``sensitivity`` spends the same budget per block on the singular values
worth most (``compress/factored.py``, ``allocate_ranks``). With ``merge: true`` the product
``BA`` is written back as a dense weight (loads everywhere, saves nothing); otherwise the
layer becomes a ``Factored`` pair and exports as two tensors. The math is in
``compress/factored.py``.
"""

from __future__ import annotations

import warnings
from typing import Literal

import torch
from pydantic import Field

from .. import distributed
from ..factored import Factored, allocate_ranks, factors, rank_for_ratio, whitened_svd
from ..hessian import Hessian, dampened_cholesky
from .base import LinearOptions, LinearPass


class LowRankOptions(LinearOptions):
    method: Literal["svd", "asvd", "svdllm"] = "svdllm"
    ratio: float = Field(0.8, gt=0, lt=1)  # share of each targeted layer's parameters kept
    allocation: Literal["uniform", "sensitivity"] = "uniform"
    alpha: float = Field(0.5, ge=0)  # ASVD: S = mean|x|^alpha
    percdamp: float = Field(0.01, ge=0)  # SVD-LLM: dampening of XᵀX before its Cholesky factor
    merge: bool = False  # export the dense product instead of the two factors


class _MeanAbs:
    def __init__(self, linear: torch.nn.Linear):
        self.sum, self.n = torch.zeros(linear.in_features, device=linear.weight.device, dtype=torch.float64), 0

    def add(self, x: torch.Tensor) -> None:  # float64: the order of the sums (one process or several) does not show
        x = x.reshape(-1, x.shape[-1]).double()
        self.sum += x.abs().sum(0)
        self.n += x.shape[0]

    def reduce(self) -> None:
        distributed.sum_(self.sum)
        self.n = int(distributed.total(self.n)[0])


class LowRank(LinearPass):
    name = "lowrank"
    leaves = frozenset({"factored"})
    Options = LowRankOptions
    uses_hessian = True
    holds_block_statistics = True

    def __init__(self, options, where):
        super().__init__(options, where)
        self.needs_data = options.method != "svd"

    def order_problem(self, before, after):
        """Factored layers are dense pairs that nothing after can transform, and they export in our
        own layout, which cannot carry quantized tensors: factoring comes last and alone."""
        others = [q for q in before + after if not (isinstance(q, LowRank) and q.options.merge)]
        if others and not self.options.merge:
            return (
                f"factored layers cannot be combined with other passes ({others[0].where}); "
                "set merge: true to export dense weights"
            )
        return None

    def _whitening(self, name: str, stat) -> tuple[torch.Tensor | None, bool]:
        """``S`` for this layer and whether it is diagonal."""
        o = self.options
        if o.method == "svd":
            return None, False
        if o.method == "asvd":
            return (stat.sum / max(stat.n, 1)).float().clamp(min=1e-6).pow(o.alpha), True
        L = dampened_cholesky(stat.H, o.percdamp, name)
        if L is None:
            warnings.warn(f"{name}: XᵀX could not be factorised; whitening by its diagonal instead", stacklevel=3)
            return torch.diag(stat.H).clamp(min=1e-8).sqrt().float(), True
        return L, False

    def apply(self, block, data, prefix: str) -> None:
        o = self.options
        targets = self.targets(block, prefix)
        stat = {"asvd": _MeanAbs, "svdllm": Hessian}.get(o.method)
        stats = data.observe(self.target_groups(targets), stat) if stat else {}
        decomposed = {}
        for name, lin in targets.items():
            S, diagonal = self._whitening(prefix + name, stats.get(name))
            decomposed[name] = (whitened_svd(lin.weight.data, S, diagonal), S, diagonal)
        if o.allocation == "uniform":
            ranks = {n: rank_for_ratio(lin.out_features, lin.in_features, o.ratio) for n, lin in targets.items()}
        else:
            budget = int(o.ratio * sum(lin.weight.numel() for lin in targets.values()))
            ranks = allocate_ranks(
                {n: (decomposed[n][0][1], lin.out_features, lin.in_features) for n, lin in targets.items()}, budget
            )
        for name, lin in targets.items():
            (U, sigma, Vh), S, diagonal = decomposed[name]
            B, A = factors(U, sigma, Vh, ranks[name], S, diagonal)
            self._replace(block, name, lin, B, A)
        # every rank factored the same statistics; rank 0's result is kept so blocks cannot drift apart
        distributed.same_as_main([p for name in targets for p in block.get_submodule(name).parameters()])

    def _replace(self, block, name: str, lin: torch.nn.Linear, B: torch.Tensor, A: torch.Tensor) -> None:
        store = lambda t: t.to(self.dtype).to(lin.weight.dtype).contiguous()  # noqa: E731  (as it will be stored)
        if self.options.merge:
            lin.weight.data = store(store(B) @ store(A))
            return
        factored = Factored.empty(
            lin.in_features, lin.out_features, A.shape[0], lin.bias is not None, lin.weight.dtype, lin.weight.device
        )
        factored[0].weight.data, factored[1].weight.data = store(A), store(B)
        if lin.bias is not None:
            factored[1].bias.data = lin.bias.data.clone()
        parent, _, leaf = name.rpartition(".")
        setattr(block.get_submodule(parent) if parent else block, leaf, factored)

    def summary(self) -> str:
        o = self.options
        return f"{o.method} {o.ratio:.0%} params ({o.allocation})" + (" merged" if o.merge else "")
