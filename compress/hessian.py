"""Second-order input statistics shared by GPTQ, SparseGPT and whitened SVD.

``H = 2/n · Σ x xᵀ`` over every calibration token reaching a linear, and the
upper Cholesky factor of ``H⁻¹`` that OBS-style updates read. A singular H (dead
input channels, too little data) is dampened more until the factorisation
succeeds, with a warning naming the layer; if it never does, the diagonal is
used. Never a crash, never NaN weights.

Sums and factorisations run in float64 where float64 is fast (every CPU, and the GPUs with
full-rate float64: A100, H100, H200), so that float32 rounding in sums over 10⁵ tokens does not
decide which way a weight rounds (what it changes and costs: docs/results.md, "Hessians in
float64"). What leaves this module (the factors the sweeps read) is float32.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Protocol

import torch

from . import distributed


def statistics_dtype(device: torch.device) -> torch.dtype:
    """float64 where it runs at a useful rate: CPUs, and data-centre GPUs (compute capability 8.0, 9.0)."""
    if device.type == "cuda" and torch.cuda.get_device_capability(device) not in ((8, 0), (9, 0)):
        return torch.float32  # consumer GPUs run float64 at 1/32–1/64 of float32
    return torch.float64


class Statistic(Protocol):
    """What a pass collects about one linear's inputs (``Pipeline.observe``): made for the linear,
    fed every calibration batch that reaches it (``add``), then summed over processes (``reduce``,
    a no-op with one)."""

    def add(self, x: torch.Tensor) -> None: ...

    def reduce(self) -> None: ...


class Hessian:
    """``2/n · XᵀX`` in ``statistics_dtype`` over every input ``add`` is called with.

    XᵀX is symmetric, so only its lower triangle is multiplied, in panels of ``PANEL`` rows
    (44% fewer multiply-adds than the full product for a 1536-wide input, a third less time
    on our CPU; ``H`` mirrors it).
    """

    PANEL = 192

    def __init__(self, linear: torch.nn.Linear):
        device = linear.weight.device
        self.lower = torch.zeros(linear.in_features, linear.in_features, device=device, dtype=statistics_dtype(device))
        self.n = 0
        self._H = None

    def add(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).to(self.lower.dtype)
        self.n += x.shape[0]
        width = x.shape[1]
        for start in range(0, width, self.PANEL):
            end = min(start + self.PANEL, width)
            self.lower[start:end, :end].addmm_(x[:, start:end].T, x[:, :end])
        self._H = None

    def reduce(self) -> None:
        """The sums over every rank's samples (several processes)."""
        distributed.sum_(self.lower)
        self.n = int(distributed.total(self.n)[0])
        self._H = None

    @property
    def H(self) -> torch.Tensor:
        if self._H is None:
            lower = self.lower.tril()
            self._H = (lower + lower.tril(-1).T) * (2 / max(self.n, 1))
        return self._H


class AsymmetricHessian(Hessian):
    """``H`` of the inputs ``x`` a linear receives in the compressed model, and the asymmetry
    ``2/n · Σ (x̂ - x) xᵀ``, where ``x̂`` is the dense model's input to the same linear on the same
    sample (``dense`` yields them in the order ``add`` sees the samples). GPTAQ (Li et al. 2025)
    fits the dense model's outputs from the compressed inputs with it, so that a layer corrects
    the error the layers before it left instead of passing it on."""

    def __init__(self, linear: torch.nn.Linear, dense: Iterator[torch.Tensor]):
        super().__init__(linear)
        self.dense = dense
        self.cross = torch.zeros_like(self.lower)

    def add(self, x: torch.Tensor) -> None:
        super().add(x)
        x = x.reshape(-1, x.shape[-1]).to(self.cross.dtype)
        self.cross.addmm_((next(self.dense).reshape(x.shape).to(x.device, x.dtype) - x).T, x)

    def reduce(self) -> None:
        super().reduce()
        distributed.sum_(self.cross)

    @property
    def asymmetry(self) -> torch.Tensor:
        return self.cross * (2 / max(self.n, 1))


def dead_columns(H: torch.Tensor) -> torch.Tensor:
    """Input channels that never saw a non-zero value."""
    return torch.diag(H) == 0


def dampened_cholesky(H: torch.Tensor, percdamp: float, name: str, tries: int = 6) -> torch.Tensor | None:
    """Lower Cholesky factor (float32) of ``H + λI``, ``λ = percdamp · mean(diag H)``, or None if it never factors."""
    L = _dampened_cholesky(H, percdamp, name, tries)
    return None if L is None else L.float()


def _dampened_cholesky(H: torch.Tensor, percdamp: float, name: str, tries: int = 6) -> torch.Tensor | None:
    """The factor in ``H``'s dtype. Dead channels get a unit diagonal first. If the factorisation
    fails, λ grows tenfold per try (warned, naming ``name``)."""
    H = H.clone()
    dead = dead_columns(H)
    H[dead, dead] = 1
    mean_diag = torch.mean(torch.diag(H)).item()
    damp = percdamp
    for attempt in range(tries):
        L, info = torch.linalg.cholesky_ex(H + damp * mean_diag * torch.eye(H.shape[0], device=H.device))
        if info == 0 and torch.isfinite(L).all():
            if attempt:
                warnings.warn(f"{name}: Hessian not positive definite; dampening raised to {damp:g}", stacklevel=3)
            return L
        damp = damp * 10 if damp > 0 else 1e-3
    return None


def inverse_cholesky(H: torch.Tensor, percdamp: float, name: str) -> torch.Tensor:
    """Upper Cholesky factor (float32) of ``(H + λI)⁻¹``, the matrix OBS-style updates read."""
    L = _dampened_cholesky(H, percdamp, name)
    if L is not None:
        U, info = torch.linalg.cholesky_ex(torch.cholesky_inverse(L), upper=True)
        if info == 0 and torch.isfinite(U).all():
            return U.float()
    # Last resort: keep only the diagonal. GPTQ then spreads no error: round-to-nearest for this layer.
    warnings.warn(f"{name}: Hessian could not be factorised; using its diagonal (no error feedback)", stacklevel=2)
    return torch.diag(torch.diag(H).clamp(min=1e-8).rsqrt()).float()
