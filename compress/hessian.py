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
    on our CPU; ``H`` mirrors it). One matrix of that size is all it ever holds.
    """

    PANEL = 192

    def __init__(self, linear: torch.nn.Linear):
        device = linear.weight.device
        self.sums = torch.zeros(linear.in_features, linear.in_features, device=device, dtype=statistics_dtype(device))
        self.n = 0
        self._full = False

    def add(self, x: torch.Tensor) -> None:
        if self._full:
            raise RuntimeError("inputs added to a Hessian after it was read")
        x = x.reshape(-1, x.shape[-1]).to(self.sums.dtype)
        self.n += x.shape[0]
        width = x.shape[1]
        for start in range(0, width, self.PANEL):
            end = min(start + self.PANEL, width)
            self.sums[start:end, :end].addmm_(x[:, start:end].T, x[:, :end])

    def reduce(self) -> None:
        """The sums over every rank's samples (several processes)."""
        distributed.sum_(self.sums)
        self.n = int(distributed.total(self.n)[0])

    @property
    def H(self) -> torch.Tensor:
        """The full matrix, made from the sums in place the first time it is read (a second copy of
        a 28672-wide float64 Hessian would be 6.6 GB); no inputs can be added after that."""
        if self.sums is None:
            raise RuntimeError("this Hessian was handed to a factorisation (take) and no longer exists")
        if not self._full:
            width = self.sums.shape[0]
            for start in range(0, width, self.PANEL):  # add() filled each panel's diagonal block whole
                end = min(start + self.PANEL, width)
                self.sums[start:end, end:] = self.sums[end:, start:end].T
            self.sums *= 2 / max(self.n, 1)
            self._full = True
        return self.sums

    def take(self) -> torch.Tensor:
        """``H``, for its last reader to factorise in place (``inverse_cholesky(..., overwrite=True)``)."""
        H, self.sums = self.H, None
        return H


class AsymmetricHessian(Hessian):
    """``H`` of the inputs ``x`` a linear receives in the compressed model, and the asymmetry
    ``2/n · Σ (x̂ - x) xᵀ``, where ``x̂`` is the dense model's input to the same linear on the same
    sample (``dense`` yields them in the order ``add`` sees the samples). GPTAQ (Li et al. 2025)
    fits the dense model's outputs from the compressed inputs with it, so that a layer corrects
    the error the layers before it left instead of passing it on."""

    def __init__(self, linear: torch.nn.Linear, dense: Iterator[torch.Tensor]):
        super().__init__(linear)
        self.dense = dense
        self.cross = torch.zeros_like(self.sums)

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


def dampened_cholesky(H: torch.Tensor, percdamp: float, name: str) -> torch.Tensor | None:
    """Lower Cholesky factor (float32) of ``H + λI``, ``λ = percdamp · mean(diag H)``, or None if it never factors."""
    work = H.clone()
    return work.T.float() if _factor_(work, H, dead_columns(H), None, percdamp, name, upper=False) else None


def inverse_cholesky(
    H: torch.Tensor, percdamp: float, name: str, order: torch.Tensor | None = None, overwrite: bool = False
) -> torch.Tensor:
    """Upper Cholesky factor (float32) of ``(H + λI)⁻¹`` with rows and columns in ``order`` (GPTQ's
    act-order; default: as they are), the matrix OBS-style updates read.

    With ``J`` the reversal, ``J H J = Rᵀ R`` (torch's upper factor) gives ``H = V Vᵀ`` with
    ``V = J Rᵀ J`` upper triangular, and ``H⁻¹ = Uᵀ U`` with ``U = V⁻¹``: one factorisation and
    one triangular inverse, half the work of the usual factor, invert, factor again. Every step
    runs in place in one matrix, the float32 result included, so with ``overwrite`` (``H`` is
    the caller's to destroy; ``Hessian.take``) nothing the size of ``H`` is allocated at all. A
    float64 ``H`` then gets no second try with more dampening (that would need a copy): dampened,
    it only fails to factor with NaN or inf in it, and the diagonal is used, as after the last try.
    """
    width = H.shape[0]
    order = torch.arange(width, device=H.device) if order is None else order.to(H.device)
    diagonal, dead = torch.diagonal(H).clone(), dead_columns(H)
    # float32 statistics fail more often: they keep their retries
    overwrite = overwrite and H.dtype == torch.float64 and H.is_contiguous()
    work = H if overwrite else H.clone(memory_format=torch.contiguous_format)
    if not _factor_(work, None if overwrite else H, dead, order.flip(0), percdamp, name, upper=True):
        # Last resort: keep only the diagonal. GPTQ then spreads no error: round-to-nearest for this layer.
        warnings.warn(f"{name}: Hessian could not be factorised; using its diagonal (no error feedback)", stacklevel=2)
        return torch.diag(diagonal[order].clamp(min=1e-8).rsqrt()).float()
    _reverse_(work)  # Rᵀ → V
    _invert_upper_(work)  # V → U
    return _as_float32_(work)


def _factor_(
    work: torch.Tensor,
    start: torch.Tensor | None,
    dead: torch.Tensor,
    order: torch.Tensor | None,
    percdamp: float,
    name: str,
    upper: bool,
) -> bool:
    """``work`` (which holds ``start``) ← ``Cᵀ``, ``C`` torch's Cholesky factor (``upper`` or lower)
    of ``start`` with rows and columns in ``order``, dead channels given a unit diagonal and
    ``λ`` added to it. If that fails, ``work`` starts again from ``start`` with λ ten times larger
    (warned, naming ``name``); without ``start`` there is no second try. False if it never succeeds."""
    damp = percdamp
    for attempt in range(6 if start is not None else 1):
        if attempt:
            work.copy_(start)
        if order is not None:
            _permute_symmetric_(work, order)
        d = torch.diagonal(work)
        d.masked_fill_(dead if order is None else dead[order], 1)
        d += damp * d.mean()
        # work is symmetric, so its transpose is the same matrix laid out as LAPACK wants it: the
        # factor is written into it in place (work becomes Cᵀ, the other triangle zeroed)
        columns, info = work.mT, torch.empty((), dtype=torch.int32, device=work.device)
        torch.linalg.cholesky_ex(columns, upper=upper, out=(columns, info))
        # a NaN or inf anywhere in the factor reaches its diagonal
        if info == 0 and torch.isfinite(torch.diagonal(work)).all():
            if attempt:
                warnings.warn(f"{name}: Hessian not positive definite; dampening raised to {damp:g}", stacklevel=3)
            return True
        damp = damp * 10 if damp > 0 else 1e-3
    return False


_BLOCK = 512  # rows and columns per step of the in-place matrix operations
_CHUNK = 1 << 20  # elements per step of the in-place element-wise ones


def _permute_symmetric_(S: torch.Tensor, order: torch.Tensor) -> None:
    """``S ← S[order][:, order]`` for a symmetric ``S``, in place: the reversal reverses the storage;
    any other order moves rows along the permutation's cycles, transposes (``(P S)ᵀ = S Pᵀ``)
    and moves the rows once more."""
    width = len(order)
    if torch.equal(order, torch.arange(width, device=order.device)):
        return
    if torch.equal(order, torch.arange(width - 1, -1, -1, device=order.device)):
        _reverse_(S)
        return
    _permute_rows_(S, order.tolist())
    _transpose_(S)
    _permute_rows_(S, order.tolist())


def _reverse_(S: torch.Tensor) -> None:
    """``S ← J S J`` (both orders reversed): the storage read backwards, swapped a chunk from each end at a time."""
    flat, total, step = S.view(-1), S.numel(), _CHUNK
    for a in range(0, total // 2, step):
        b = min(a + step, total // 2)
        head = flat[a:b].clone()
        flat[a:b] = flat[total - b : total - a].flip(0)
        flat[total - b : total - a] = head.flip(0)
    # with an odd number of elements the middle one stays where it is


def _permute_rows_(S: torch.Tensor, order: list[int]) -> None:
    done = [False] * len(order)
    for start in range(len(order)):
        if done[start] or order[start] == start:
            continue
        first, i = S[start].clone(), start
        while order[i] != start:  # row i takes row order[i], which moves next
            done[i] = True
            S[i] = S[order[i]]
            i = order[i]
        done[i] = True
        S[i] = first


def _transpose_(S: torch.Tensor) -> None:
    """A square matrix transposed in place, a pair of blocks at a time."""
    width = S.shape[0]
    for r in range(0, width, _BLOCK):
        r2 = min(r + _BLOCK, width)
        S[r:r2, r:r2] = S[r:r2, r:r2].T.clone()
        for c in range(r2, width, _BLOCK):
            c2 = min(c + _BLOCK, width)
            upper = S[r:r2, c:c2].clone()
            S[r:r2, c:c2] = S[c:c2, r:r2].T
            S[c:c2, r:r2] = upper.T


def _invert_upper_(T: torch.Tensor) -> None:
    """An upper triangular matrix (zeros below the diagonal) replaced by its inverse, in place, a
    block column at a time (LAPACK's trtri): with the leading block already inverted,
    ``T⁻¹[:j, j:k] = -T[:j, :j]⁻¹ T[:j, j:k] T[j:k, j:k]⁻¹``."""
    width = T.shape[0]
    for j in range(0, width, _BLOCK):
        k = min(j + _BLOCK, width)
        D = T[j:k, j:k]
        if j:
            above = T[:j, :j] @ T[:j, j:k]
            T[:j, j:k] = -torch.linalg.solve_triangular(D, above, upper=True, left=False)
        D.copy_(torch.linalg.solve_triangular(D, torch.eye(k - j, dtype=T.dtype, device=T.device), upper=True))


def _as_float32_(S: torch.Tensor) -> torch.Tensor:
    """``S`` in float32, written over the first half of its own float64 storage (front to back,
    a chunk at a time: a chunk's float32 values only cover float64 values already read)."""
    if S.dtype == torch.float32:
        return S
    wide = S.view(-1)
    narrow = wide.view(torch.float32)  # twice as many elements over the same bytes
    for a in range(0, wide.numel(), _CHUNK):
        b = min(a + _CHUNK, wide.numel())
        narrow[a:b] = wide[a:b].float()
    return narrow[: wide.numel()].view(S.shape)
