"""Low-rank factors ``W (m×n) ≈ B (m×r) · A (r×n)``: the math shared by the SVD passes and LoRC.

Every variant is a truncated SVD of ``W·S`` with ``S`` undone on the right:

    W S = U Σ Vᵀ        B = U_r Σ_r^½        A = Σ_r^½ V_rᵀ S⁻¹

- ``S = I``: plain SVD, optimal for ‖W − BA‖_F.
- ``S = diag(mean|x|^α)``: ASVD (Yuan et al. 2023), input channels that carry large
  activations are kept more faithfully.
- ``S = chol(XᵀX)`` (lower): SVD-LLM (Wang et al. 2024). Then ‖(W − BA)Xᵀ‖_F = ‖(W − BA)S‖_F,
  so the dropped singular values *are* the output error: Σ_{i>r} σ_i².

A factored layer is ``nn.Sequential(Linear(n, r), Linear(r, m))`` (class ``Factored``), so
its exported tensors (``<name>.0.weight``, ``<name>.1.weight``) load into plain PyTorch
modules; ``config.json`` lists each factored layer's rank under ``compress_lowrank``.
"""

from __future__ import annotations

import math

import torch

from .state import State

CONFIG_KEY = "compress_lowrank"


class Factored(torch.nn.Sequential):
    """``x -> B(A x)``: ``[0]`` is A (n -> r, no bias), ``[1]`` is B (r -> m, the original bias)."""

    @classmethod
    def empty(cls, in_features: int, out_features: int, rank: int, bias: bool, dtype=None, device=None):
        return cls(
            torch.nn.Linear(in_features, rank, bias=False, dtype=dtype, device=device),
            torch.nn.Linear(rank, out_features, bias=bias, dtype=dtype, device=device),
        )

    @property
    def rank(self) -> int:
        return self[0].out_features


class FactorPair(State, attr="factored"):
    """The state of a layer that *is* a ``Factored`` pair: its shape, so that a resume checkpoint
    can put an empty pair in the linear's place before the pair's tensors are loaded."""

    structural = True
    holds_tensors = False  # the pair's own parameters are freed as any module's

    def __init__(self, in_features: int, out_features: int, rank: int, bias: bool):
        self.shape = [in_features, out_features, rank, bias]

    @classmethod
    def of(cls, module):
        if not isinstance(module, Factored):
            return None
        return cls(module[0].in_features, module[1].out_features, module.rank, module[1].bias is not None)

    def attach(self, module):
        raise TypeError("a factored layer is a module of its own; replace the linear with Factored.empty")

    def saved(self):
        return {}, {"shape": self.shape}

    @classmethod
    def restore(cls, block, name, tensors, meta) -> None:
        parent, _, leaf = name.rpartition(".")
        dtype = next(block.parameters()).dtype
        setattr(block.get_submodule(parent) if parent else block, leaf, Factored.empty(*meta["shape"], dtype))


def rank_for_ratio(out_features: int, in_features: int, ratio: float) -> int:
    """The rank whose two factors hold ``ratio`` of the layer's parameters: r(m + n) ≤ ratio·m·n."""
    return max(1, math.floor(ratio * out_features * in_features / (out_features + in_features)))


def break_even_rank(out_features: int, in_features: int) -> int:
    """Below this rank the factors are smaller than the dense weight."""
    return rank_for_ratio(out_features, in_features, 1.0)


def whitened_svd(W: torch.Tensor, S: torch.Tensor | None, S_is_diagonal: bool = False):
    """``U, Σ, Vᵀ`` of ``W·S`` in float32 (``S`` None: plain SVD; a vector when diagonal)."""
    W = W.float()
    WS = W if S is None else (W * S if S_is_diagonal else W @ S)
    return torch.linalg.svd(WS, full_matrices=False)


def factors(U, sigma, Vh, rank: int, S: torch.Tensor | None, S_is_diagonal: bool = False):
    """``B, A`` (float32) keeping the top ``rank`` singular values, with ``S`` undone."""
    root = sigma[:rank].sqrt()
    B = U[:, :rank] * root
    A = root[:, None] * Vh[:rank]
    if S is not None:
        A = A / S if S_is_diagonal else torch.linalg.solve_triangular(S, A, upper=False, left=False)
    return B, A


def allocate_ranks(spectra: dict[str, tuple[torch.Tensor, int, int]], budget: int) -> dict[str, int]:
    """Sensitivity-based ranks under a parameter budget.

    ``spectra[name] = (σ, m, n)``. Each singular value is worth its share of the layer's
    energy, ``σ_i² / Σσ²`` (its relative output error when whitened), per parameter it costs,
    ``m + n``; the most valuable are kept until ``budget`` parameters are spent.
    """
    candidates = []
    for name, (sigma, m, n) in spectra.items():
        energy = sigma.double().pow(2)
        value = (energy / energy.sum().clamp(min=1e-30) / (m + n)).tolist()
        candidates += [(v, name, m + n) for v in value[: break_even_rank(m, n)]]
    ranks = dict.fromkeys(spectra, 0)
    for _, name, cost in sorted(candidates, key=lambda c: -c[0]):
        if cost <= budget:
            ranks[name] += 1
            budget -= cost
    return {name: max(1, r) for name, r in ranks.items()}


def install(model: torch.nn.Module, ranks: dict[str, int]) -> None:
    """Replace each named linear of ``model`` by an empty ``Factored`` of that rank (for loading)."""
    for name, rank in ranks.items():
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        linear = getattr(parent, leaf)
        setattr(
            parent,
            leaf,
            Factored.empty(
                linear.in_features,
                linear.out_features,
                rank,
                linear.bias is not None,
                linear.weight.dtype,
                linear.weight.device,
            ),
        )


def factored_ranks(model: torch.nn.Module) -> dict[str, int]:
    return {name: m.rank for name, m in model.named_modules() if isinstance(m, Factored)}
