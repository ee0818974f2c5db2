"""AWQ (Lin et al. 2023): protect salient input channels by scaling them up before
rounding, and fold the inverse scale into the op that produces them.

Per mapping (norm -> q/k/v, v -> o when shapes allow, norm -> gate/up, up -> down):
``s = mean|x|^α``, α on a grid, chosen to minimise the error of the inspected module's output
(attention, MLP, or the linear); ``W·diag(s)`` and ``prev / s`` leave the float block unchanged.
Then a per-group clipping search, then rounding (RTN, or leave it to a following
``gptq`` pass with ``quantize: false``). All scales are searched on the float
block, from one observation of its inputs, as in the reference implementation.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from pydantic import Field

from .. import distributed
from ..arch import fold, foldable_scalings
from ..quant import QuantScheme, compute_qparams, dequantize, fake_quantize, quantize
from .base import RecipeError, WeightQuantOptions, WeightQuantPass


class AWQOptions(WeightQuantOptions):
    grid: int = Field(20, gt=0)  # α values tried in [0, 1)
    clip: bool = True  # search a per-group clipping range after scaling
    clip_grid: int = Field(20, gt=0)
    max_shrink: float = Field(0.5, gt=0, lt=1)  # clipping tries ranges down to (1 - max_shrink) of the max
    search_tokens: int = Field(4096, gt=0)  # calibration tokens used by the searches (statistics use all)
    quantize: bool = True  # false: only scale and clip; a later pass (gptq) rounds


class _Inputs:
    """Mean |x| per channel over all tokens, and whole samples up to ``limit`` tokens for searches."""

    def __init__(self, limit: int):
        self.limit, self.abs_sum, self.n, self.samples = limit, None, 0, []

    def add(self, x: torch.Tensor) -> None:
        s = x.reshape(-1, x.shape[-1]).double().abs().sum(0)  # float64: the order of the sums does not show
        self.abs_sum = s if self.abs_sum is None else self.abs_sum + s
        if sum(t[0].numel() for t in self.samples) // x.shape[-1] < self.limit:
            self.samples.append(x)
        self.n += x.numel() // x.shape[-1]

    def reduce(self) -> None:
        """Several processes: sums over every rank's samples, and the search samples a single
        process would keep (the first ``limit`` tokens of the whole calibration set, in rank order)."""
        if distributed.size() == 1:
            return
        distributed.sum_(self.abs_sum)
        self.n = int(distributed.total(self.n)[0])
        counts = [0] * distributed.size()
        counts[distributed.rank()] = len(self.samples)
        counts = [int(c) for c in distributed.total(*counts)]
        kept, tokens = [], 0
        for r, count in enumerate(counts):
            for j in range(count):
                if tokens >= self.limit:
                    break
                mine = r == distributed.rank()  # every rank's samples have one shape (the calibration seqlen)
                t = self.samples[j].contiguous() if mine else torch.empty_like(self.samples[0])
                distributed.broadcast_(t, r)
                kept.append(t)
                tokens += t[0].numel() // t.shape[-1]
        self.samples = kept

    @property
    def mean_abs(self) -> torch.Tensor:
        return (self.abs_sum / self.n).float()

    @property
    def x(self) -> torch.Tensor:
        """The search tokens as one (tokens, channels) float32 matrix."""
        return torch.cat([t.reshape(-1, t.shape[-1]) for t in self.samples]).float()

    def rescale(self, s: torch.Tensor) -> None:
        """After folding, the linears see x / s."""
        self.samples = [(t.float() / s).to(t.dtype) for t in self.samples]
        self.abs_sum = self.abs_sum / s


@torch.no_grad()
def search_scale(
    inputs: _Inputs, linears: list[torch.nn.Linear], forward, scheme: QuantScheme, grid: int
) -> torch.Tensor:
    """The α-grid search: the scale whose quantized ``forward`` outputs are closest to the float ones.

    ``forward(x)`` runs the inspected module (attention, MLP or the linear) on one sample.
    """
    originals = [lin.weight.data.clone() for lin in linears]
    reference = [forward(x) for x in inputs.samples]
    x_mean = inputs.mean_abs

    def scale(i: int) -> torch.Tensor:
        s = x_mean.pow(i / grid).clamp(min=1e-4)  # α = 0 is plain rounding: never worse than RTN here
        return s / (s.max() * s.min()).sqrt()

    def error(i: int) -> float:
        s = scale(i)
        for lin, w in zip(linears, originals):
            lin.weight.data = (fake_quantize(w.float() * s, scheme) / s).to(w.dtype)
        return sum((forward(x).float() - r.float()).pow(2).mean().item() for x, r in zip(inputs.samples, reference))

    try:
        errors = distributed.pick(grid, error)  # several processes: grid points split
    finally:
        for lin, w in zip(linears, originals):
            lin.weight.data = w
    best, best_err = None, float("inf")
    for i, err in enumerate(errors):
        if err < best_err:
            best, best_err = i, err
    return torch.ones_like(x_mean) if best is None else scale(best)


@torch.no_grad()
def search_clip(
    w: torch.Tensor,
    x: torch.Tensor,
    scheme: QuantScheme,
    grid: int,
    max_shrink: float,
    tokens: int = 512,
    chunk: int = 1 << 24,
) -> torch.Tensor:
    """Per (row, group) clipping of the weight range that minimises that group's output error.

    Each try holds a (tokens, rows, groups) output: 7.5 GB for a 70B-wide ``gate_proj`` at once, so
    rows, which never interact, are searched a band at a time of about ``chunk`` such floats."""
    rows, cols = w.shape
    gs = cols if scheme.group_size == -1 else scheme.group_size
    pick = torch.linspace(0, x.shape[0] - 1, min(tokens, x.shape[0])).long()
    xs = x[pick.to(x.device)].to(w.device, torch.float32).reshape(-1, cols // gs, gs)
    band = max(1, chunk // (xs.shape[0] * (cols // gs)))
    group_scheme = replace(scheme, group_size=gs)
    return torch.cat(
        [_clip_rows(w[r : r + band].float(), xs, group_scheme, grid, max_shrink) for r in range(0, rows, band)]
    )


def _clip_rows(w: torch.Tensor, xs: torch.Tensor, scheme: QuantScheme, grid: int, max_shrink: float) -> torch.Tensor:
    """``search_clip`` on a band of float32 rows, ``scheme`` with its group size resolved."""
    rows, cols = w.shape
    gs = scheme.group_size
    W = w.reshape(rows, cols // gs, gs)
    reference = torch.einsum("ngk,rgk->nrg", xs, W)
    wmax, wmin = W.amax(-1, keepdim=True), W.amin(-1, keepdim=True)
    if scheme.symmetric:
        wmax = torch.maximum(wmax, -wmin)
        wmin = -wmax
    best_err = torch.full((rows, cols // gs), float("inf"), device=W.device)
    best_ratio = torch.ones(rows, cols // gs, device=W.device)
    for i in range(int(max_shrink * grid)):
        ratio = 1 - i / grid
        clipped = W.clamp(wmin * ratio, wmax * ratio).reshape(rows, cols)
        scale, zero = compute_qparams(clipped, scheme, torch.float32)
        deq = dequantize(quantize(clipped, scale, zero, scheme), scale, zero, torch.float32, scheme)
        err = (torch.einsum("ngk,rgk->nrg", xs, deq.reshape(rows, cols // gs, gs)) - reference).pow(2).mean(0)
        better = err < best_err
        best_err[better], best_ratio[better] = err[better], ratio
    r = best_ratio.unsqueeze(-1)
    return W.clamp(wmin * r, wmax * r).reshape(rows, cols)


class AWQ(WeightQuantPass):
    name = "awq"
    Options = AWQOptions

    @property
    def rounds(self) -> bool:
        return self.options.quantize

    def check(self, model) -> None:
        super().check(model)
        self.mappings = foldable_scalings(model)
        if not self.mappings:
            raise RecipeError(
                f"{self.where}: model_type {self.arch.name!r} has no scaling mapping (a norm or linear whose output "
                "feeds linears that a folded scale leaves exact); AWQ would do nothing: use gptq or rtn"
            )

    def apply(self, block, data, prefix: str) -> None:
        o = self.options
        targets = self.targets(block, prefix)
        if not targets:
            return
        inputs = data.observe(self.target_groups(targets), lambda lin: _Inputs(o.search_tokens))
        for m in self.mappings:
            names = [n for n in m.linears if n in targets]
            if not names:
                continue
            module = block.get_submodule(m.inspect)

            def forward(x, module=module, attention=m.attention):
                out = module(x, **data.kwargs) if attention else module(x)
                return out[0] if isinstance(out, tuple) else out

            stat = inputs[names[0]]
            # linears of one input may round differently (a GGUF mix, ``allocate``): the scale is searched
            # for the coarsest of them, whose error it matters most for
            scheme = min((self.scheme_for(prefix + n) for n in names), key=lambda sc: sc.bits)
            s = search_scale(stat, [targets[n] for n in names], forward, scheme, o.grid)
            fold(block, m, s, self.arch.norm_plus_one)
            stat.rescale(s)  # the clip search sees the scaled block's inputs
        for name, lin in targets.items():
            if o.clip and not name.endswith(("q_proj", "k_proj")):  # q/k errors are amplified by softmax
                w, x, scheme = lin.weight.data, inputs[name].x, self.scheme_for(prefix + name)
                (clipped,) = distributed.by_rows(  # rows never interact: several processes split them
                    lambda r, w=w, x=x, s=scheme: [search_clip(w[r.start : r.stop], x, s, o.clip_grid, o.max_shrink)],
                    w.shape[0],
                )
                lin.weight.data = clipped.to(lin.weight.dtype)
        if o.quantize:
            self.round_to_nearest(targets, prefix)

    def summary(self) -> str:
        return f"awq {self.scheme.describe()}" if self.options.quantize else "awq scales"
