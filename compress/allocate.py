"""Bits where they matter: each quantized linear gets the scheme it can bear, under a bits-per-weight budget.

A recipe's ``allocate: {target_bpw: 3.5}`` (or ``apply --target-bpw 3.5``) gives every linear that its
quantizing passes round one of the ``candidates`` (integer schemes ``w<bits>g<group>``, or ``w<bits>``
for one scale per channel; symmetry and observer are the passes'), so that the whole model's bits per
weight, scales and zero-points counted as the export stores them, is at most the budget and the
predicted loss is smallest.

A recipe that exports a GGUF k-quant file chooses among llama.cpp's k-quant types instead
(``q2_k`` to ``q6_k``; a linear whose input width is not whole super-blocks of 256 takes the type
llama.cpp falls back to, as in its own files), counted as the file stores them; its budget may
name a k-quant file type (``target_bpw: q4_k_m``): the bits llama.cpp's own mix of that name gives
these linears, so the file comes out the size of llama.cpp's.

Cost (``measure: fisher``): the KL to the dense model's predictions that a second-order expansion
predicts when linear ``l`` alone is rounded to candidate ``c``, with the Fisher information of the
linear's outputs standing in for the Hessian, token by token:

    cost(l, c) = ½ mean_t Σ_o g_to² (ΔW x_t)_o²,   ΔW = RTN_c(W) − W

in nats per calibration token, where x_t is the linear's input at token t and g_t the gradient at
its output of the log-likelihood of labels drawn from the model's own predictions (the Fisher of
those is the KL's Hessian; real labels' gradients share a mean that adds up over every later
position a state reaches, which overrated the early layers of Gemma-3 by tens of times). Kept
per token, not as F_o · ΔW_o H ΔW_oᵀ with F and H averaged apart: the tokens with the largest
inputs (an attention sink's, a massive activation's) are not those with the largest gradients,
and the product of averages overrated some down and value projections by over ten times. Unlike
a block's output error, it weighs every layer in the same unit, so layers are comparable; unlike
measuring the model's KL with each layer rounded in turn (layers × candidates forwards), it costs
one streamed forward and backward over a few calibration samples plus, per linear and sample, one
matmul of its inputs by every candidate's error. ΔW is round to nearest: GPTQ lowers every
candidate's error, but the ranking between layers is what counts.

Choice: an exact multiple-choice knapsack by dynamic programming over the layers' sizes in bits
(their greatest common divisor as the unit; sizes rounded up to a coarser unit when the budget
would exceed ``MAX_UNITS`` of them, which can only leave the result under the budget).

The measured costs are kept in ``$COMPRESS_CACHE/allocation/`` under the model's files, the
calibration tokens, the candidates and this code, so a second run (another budget, ``--resume``)
reads them instead of measuring again.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import time
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from . import distributed, kquant
from .arch import arch_of
from .evaluate import head_on_device, output_logits
from .formats import gguf_file
from .lazy import StreamedModel, streamed
from .models import cache_dir, cast_params, compute_dtype
from .passes import RecipeError, WeightQuantPass, gguf_scheme, gguf_schemes
from .pipeline import capture_inputs
from .quant import QuantScheme, quantize_weight

DEFAULT_CANDIDATES = ("w2g32", "w2g64", "w3g32", "w3g64", "w3g128", "w4g32", "w4g64", "w4g128", "w8")
GGUF_CANDIDATES = ("q2_k", "q3_k", "q4_k", "q5_k", "q6_k")  # the defaults of a GGUF k-quant export
CANDIDATE = re.compile(r"w(\d+)(?:g(\d+))?")
CANDIDATE_BITS = (2, 3, 4, 8)  # what compressed-tensors packs and vLLM's integer kernels run
MAX_UNITS = 1 << 18  # the knapsack's resolution: sizes in at most this many units of the budget
CACHE_FILES = 32  # measured costs kept (a few kilobytes each); the oldest beyond are removed


def parse_candidate(text: str) -> tuple[int, int]:
    """``w4g128`` -> (4, 128); ``w8`` -> (8, -1): one scale per output channel."""
    m = CANDIDATE.fullmatch(text)
    if m is None or int(m.group(1)) not in CANDIDATE_BITS or (m.group(2) is not None and int(m.group(2)) < 1):
        bits = "/".join(map(str, CANDIDATE_BITS))
        raise ValueError(
            f"candidate {text!r} is not w<bits>g<group> or w<bits> with bits {bits}, e.g. w4g128, "
            f"nor a GGUF k-quant type ({', '.join(GGUF_CANDIDATES)})"
        )
    return int(m.group(1)), int(m.group(2)) if m.group(2) else -1


def check_candidates(candidates: list[str]) -> bool:
    """True for GGUF k-quant types, False for integer schemes; ValueError for a mix of both or a bad one."""
    gguf = [c in GGUF_CANDIDATES for c in candidates]
    for text, is_gguf in zip(candidates, gguf):
        if not is_gguf:
            parse_candidate(text)
    if any(gguf) and not all(gguf):
        raise ValueError("candidates mix GGUF k-quant types and integer schemes; a recipe exports one or the other")
    return all(gguf)


def candidate_scheme(base: QuantScheme, text: str) -> QuantScheme:
    """The pass's scheme ``base`` with a candidate's bits and group size, or a GGUF type's own scheme."""
    if base.is_kquant:  # a GGUF export: k-quant types and llama.cpp's fallbacks
        return gguf_scheme(text, base.observer)
    bits, group = parse_candidate(text)
    return replace(base, bits=bits, group_size=group)


@dataclass
class Allocation:
    """One scheme per linear, and what was predicted and paid for it."""

    target_bpw: float | str  # bits per weight, or the GGUF file type whose size it is
    budget_bpw: float  # the budget in bits per weight
    choice: dict[str, str]  # linear -> candidate (a GGUF export: the type written, fallbacks included)
    bits_per_weight: float  # of the choice, as stored
    predicted_kl: float  # the summed costs: the predicted KL to the dense model, nats per token
    measure_s: float  # seconds spent measuring the costs (0 when read from the cache)
    counts: dict[str, int] = field(default_factory=dict)  # candidate -> linears given it

    def describe(self) -> str:
        mix = ", ".join(f"{c} ×{n}" for c, n in sorted(self.counts.items(), key=lambda kv: _order(kv[0])))
        return (
            f"{self.bits_per_weight:.3f} bits per weight for a budget of {self._budget()}: {mix}; "
            f"predicted KL to the dense model {self.predicted_kl:.4f} nats/token"
        )

    def _budget(self) -> str:
        if isinstance(self.target_bpw, str):
            return f"{self.budget_bpw:.3f} (llama.cpp's {self.target_bpw.upper()} mix)"
        return str(self.target_bpw)

    def as_dict(self) -> dict:
        return {
            "target_bpw": self.target_bpw,
            "budget_bpw": self.budget_bpw,
            "bits_per_weight": self.bits_per_weight,
            "predicted_kl": self.predicted_kl,
            "measure_s": self.measure_s,
            "counts": self.counts,
            "choice": self.choice,
        }


def _order(candidate: str) -> tuple[float, int]:
    if candidate in kquant.TYPES or candidate in gguf_file.LEGACY:
        return stored_bits(gguf_scheme(candidate, "minmax"), (1, kquant.SUPER), 16), 0
    bits, group = parse_candidate(candidate)
    return bits, -(group if group > 0 else 1 << 30)


def choose(costs: list[list[float]], sizes: list[list[int]], capacity: int) -> list[int] | None:
    """The multiple-choice knapsack: one option per item (its index), the summed ``costs`` smallest
    with the summed ``sizes`` at most ``capacity``; None when even the smallest options exceed it.
    Exact in integer sizes up to ``MAX_UNITS`` units of the capacity, conservative beyond."""
    unit = 0
    for row in sizes:
        for s in row:
            unit = math.gcd(unit, int(s))
    unit = max(unit, 1, math.ceil(capacity / MAX_UNITS))
    cap = capacity // unit
    best = np.full(cap + 1, np.inf)
    best[0] = 0.0
    picks = []
    for item_costs, item_sizes in zip(costs, sizes):
        new = np.full(cap + 1, np.inf)
        pick = np.full(cap + 1, -1, dtype=np.int16)
        for c, (cost, size) in enumerate(zip(item_costs, item_sizes)):
            s = -(-int(size) // unit)  # rounded up: never over the budget
            if s > cap:
                continue
            tried = best[: cap + 1 - s] + cost
            better = tried < new[s:]
            new[s:][better] = tried[better]
            pick[s:][better] = c
        best = new
        picks.append(pick)
    if not np.isfinite(best).any():
        return None
    at = int(np.argmin(best))  # the cheapest total at any size within the budget
    out = []
    for item_sizes, pick in zip(reversed(sizes), reversed(picks)):
        c = int(pick[at])
        out.append(c)
        at -= -(-int(item_sizes[c]) // unit)
    return out[::-1]


def stored_bits(scheme: QuantScheme, shape: tuple[int, int], scale_bits: int) -> int:
    """Bits linear of (out, in) ``shape`` takes as the export stores it under ``scheme``."""
    out_features, in_features = shape
    scale_bits = scheme.stored_scale_bits or scale_bits
    return round(scheme.bits_per_weight(in_features, scale_bits) * out_features * in_features)


class Planner:
    """The allocation for a recipe's quantizing passes on one model: which candidates fit which
    linears, the budget's bounds, and the choice once the costs are known."""

    def __init__(self, spec, passes, storage: torch.dtype, config=None):
        self.spec = spec
        self.passes = [p for p in passes if isinstance(p, WeightQuantPass)]  # AWQ's search included
        rounding = [p for p in self.passes if p.rounds]
        if not rounding:
            raise RecipeError("allocate: no pass of this recipe rounds weights to integers; add one (e.g. gptq)")
        exported = rounding[-1]  # the last rounding is the one exported
        base = exported.scheme
        gguf = base.is_kquant
        if not gguf and (base.format != "int" or base.fp16_scales):
            raise RecipeError(
                f"allocate: {exported.where} rounds to {base.describe()}; allocate chooses among integer schemes "
                "(a compressed-tensors export) or GGUF k-quant types (a k-quant GGUF export)"
            )
        self.candidates = list(spec.candidates or (GGUF_CANDIDATES if gguf else DEFAULT_CANDIDATES))
        try:
            if check_candidates(self.candidates) != gguf:
                kind = "GGUF k-quant types" if gguf else "integer schemes (w<bits>g<group>)"
                raise ValueError(f"{exported.where} rounds to {base.describe()}: its candidates are {kind}")
        except ValueError as e:
            raise RecipeError(f"allocate.candidates: {e}") from None
        self.scale_bits = torch.finfo(storage).bits
        self.shapes = {n: (o, i) for n, (i, o) in exported.widths.items()}
        self.options: dict[str, dict[str, QuantScheme]] = {}
        for text in self.candidates:
            for name, (_, i) in self.shapes.items():
                if gguf:  # a row not whole super-blocks takes llama.cpp's fallback type: one option per type
                    label = text if i % kquant.SUPER == 0 else kquant.FALLBACK[text]
                    self.options.setdefault(name, {}).setdefault(label, candidate_scheme(base, label))
                elif (scheme := candidate_scheme(base, text)).group_size == -1 or i % scheme.group_size == 0:
                    self.options.setdefault(name, {})[text] = scheme
        if bare := [n for n in self.shapes if n not in self.options]:
            raise RecipeError(
                f"allocate.candidates: none fits {bare[0]} (in_features {self.shapes[bare[0]][1]}); "
                "add a candidate whose group size divides it, or w<bits> (per channel)"
            )
        self.weights = sum(o * i for o, i in self.shapes.values())
        low = sum(min(self.sizes(n).values()) for n in self.shapes)
        high = sum(max(self.sizes(n).values()) for n in self.shapes)
        mix = isinstance(spec.target_bpw, str)
        if mix:  # a GGUF file type: the bits llama.cpp's mix of it gives
            kind = candidate_scheme(base, gguf_file.MIX_BASE[spec.target_bpw])
            with warnings.catch_warnings():  # the fallback warning: the passes' check gave it already
                warnings.simplefilter("ignore")
                others = gguf_schemes(kind, spec.target_bpw, exported.widths, exported.where, config)
            own = {n: others.get(n, kind) for n in self.shapes}
            self.capacity = sum(stored_bits(own[n], self.shapes[n], self.scale_bits) for n in self.shapes)
        else:
            self.capacity = math.floor(spec.target_bpw * self.weights)  # the budget in bits
        self.budget_bpw = self.capacity / self.weights
        if not low <= self.capacity <= high:
            side = "below the smallest" if self.capacity < low else "above the largest"
            budget = f"{spec.target_bpw} ({self.budget_bpw:.3f} bits per weight)" if mix else spec.target_bpw
            raise RecipeError(
                f"allocate.target_bpw: {budget} is {side} these candidates give on this model "
                f"({low / self.weights:.3f} to {high / self.weights:.3f} bits per weight, scales included); "
                "choose a budget in that range"
            )

    def sizes(self, name: str) -> dict[str, int]:
        return {c: stored_bits(s, self.shapes[name], self.scale_bits) for c, s in self.options[name].items()}

    def choose(self, costs: dict[str, dict[str, float]], measure_s: float) -> Allocation:
        names = list(self.shapes)
        labels = [list(self.options[n]) for n in names]
        sizes = [[self.sizes(n)[c] for c in cs] for n, cs in zip(names, labels)]
        picked = choose([[costs[n][c] for c in cs] for n, cs in zip(names, labels)], sizes, self.capacity)
        if picked is None:  # only where sizes rounded up to a coarse unit no longer fit: the smallest do
            picked = [min(range(len(row)), key=row.__getitem__) for row in sizes]
        choice = {n: cs[i] for n, cs, i in zip(names, labels, picked)}
        bits = sum(self.sizes(n)[c] for n, c in choice.items())
        counts: dict[str, int] = {}
        for c in choice.values():
            counts[c] = counts.get(c, 0) + 1
        predicted = sum(costs[n][c] for n, c in choice.items())
        return Allocation(
            self.spec.target_bpw, self.budget_bpw, choice, bits / self.weights, predicted, measure_s, counts
        )

    def run(self, model: StreamedModel, ids: torch.Tensor, device: torch.device) -> Allocation:
        """Measure the costs on the first ``samples`` calibration samples (or read them back), choose,
        and set every quantizing pass's per-linear schemes; printed."""
        model, ids = streamed(model), ids[: self.spec.samples]
        key = _key(model, ids, self.options, device)
        path = cache_dir() / "allocation" / f"{key}.json" if key else None
        start = time.perf_counter()
        costs = _read(path, self.options)
        if costs is not None:
            measure_s, say = 0.0, f"layer costs read from {path}"
        else:
            costs = measure(model, ids, self.options, device)
            measure_s = time.perf_counter() - start
            say = f"layer costs measured on {len(ids)} samples in {measure_s:.0f} s"
            if path is not None and distributed.is_main():
                _save(path, costs)
        allocation = self.choose(costs, measure_s)
        self.apply(allocation)
        if distributed.is_main():
            print(f"[compress] allocation: {say}; {allocation.describe()}", flush=True)
        return allocation

    def apply(self, allocation: Allocation) -> None:
        """Every quantizing pass rounds each linear to its allocated scheme."""
        for p in self.passes:
            for name in p.widths:
                if name in allocation.choice:
                    p.schemes[name] = candidate_scheme(p.scheme, allocation.choice[name])


def _first(out):
    return out[0] if isinstance(out, tuple) else out


def _backward(block, errors: dict, inputs: list, grads: list, call: tuple, costs: dict) -> list:
    """The block run forward and back on each sample, adding to ``costs[linear][candidate]``
    ½ Σ_t Σ_o g_to² (ΔW x_t)_o² for each linear's input rows x_t, output gradients g_t and each
    candidate's rounding error ΔW (``errors``: linear -> (module, candidates, their errors stacked
    as rows)); returns the gradients at the block's inputs, for the block before."""
    args, kwargs = call

    def hook(name):
        module, labels, stacked = errors[name]

        def fn(_module, module_args, out):
            x = module_args[0].detach().reshape(-1, module.in_features).float()

            def on_grad(g):  # returns None: the gradient flows on unchanged
                g2 = g.detach().reshape(-1, module.out_features).float().pow(2)
                dy2 = (x @ stacked.T).pow_(2).reshape(x.shape[0], len(labels), module.out_features)
                for c, total in zip(labels, (dy2 * g2[:, None]).sum((0, 2)).tolist()):
                    costs[name][c] += 0.5 * total

            out.register_hook(on_grad)

        return fn

    handles = [errors[n][0].register_forward_hook(hook(n)) for n in errors]
    before = []
    try:
        with torch.enable_grad():
            for x, g in zip(inputs, grads):
                x = x.detach().requires_grad_()
                before.append(torch.autograd.grad(_first(block(x, *args, **kwargs)), x, g)[0])
    finally:
        for h in handles:
            h.remove()
    return before


@torch.no_grad()
def _errors(weight: torch.Tensor, schemes: dict[str, QuantScheme], storage) -> torch.Tensor:
    """Each candidate's round-to-nearest error of ``weight``, stacked as rows (candidates × out, in)."""
    w = weight.float()
    return torch.cat([quantize_weight(w, s, storage).dequantized().float() - w for s in schemes.values()])


def measure(
    model: StreamedModel, ids: torch.Tensor, options: dict[str, dict[str, QuantScheme]], device: torch.device
) -> dict[str, dict[str, float]]:
    """``cost(l, c)`` (module docstring) for every linear ``l`` in ``options`` and each of its
    candidates, from one forward and one backward over ``ids``, a block at a time. Holds every
    block's inputs on the samples (layers × samples × seqlen × hidden floats)."""
    model = streamed(model)
    storage, compute = model.dtype, compute_dtype(device, model.dtype)
    show = distributed.is_main()
    hidden, calls = capture_inputs(model.model, ids, device, compute)
    inputs = []
    with torch.no_grad():
        for i in tqdm(range(len(model)), desc="allocation: forward", unit="block", disable=not show):
            inputs.append(hidden)
            with model.block(i) as block:
                home = next(block.parameters()).device
                cast_params(block, device, compute)
                args, kwargs = calls[i]
                hidden = [_first(block(h, *args, **kwargs)) for h in hidden]
                cast_params(block, home, storage)
    arch = arch_of(model.model)
    norm = model.model.get_submodule(arch.norm)
    logits_of = output_logits(model.model)[0]
    tokens = ids.shape[0] * (ids.shape[1] - 1)
    grads, draw = [], torch.Generator(device=device).manual_seed(0)
    norm_home = next(norm.parameters()).device
    cast_params(norm, device, compute)
    try:
        with head_on_device(model.model, device), torch.enable_grad():
            for h in hidden:
                h = h.detach().requires_grad_()
                logits = logits_of(norm(h))[0, :-1].float()
                # labels drawn from the model itself: its Fisher is the KL's Hessian (module docstring)
                labels = torch.multinomial(logits.detach().softmax(-1), 1, generator=draw)[:, 0]
                loss = torch.nn.functional.cross_entropy(logits, labels, reduction="sum")
                grads.append(torch.autograd.grad(loss, h)[0])
    finally:
        cast_params(norm, norm_home, storage)
    costs: dict[str, dict[str, float]] = {}
    blocks = tqdm(range(len(model) - 1, -1, -1), desc="allocation: backward", unit="block", disable=not show)
    for i in blocks:
        prefix = f"{model.prefix}{i}."
        with model.block(i) as block:
            home = next(block.parameters()).device
            cast_params(block, device, compute)
            mine = {n: block.get_submodule(n[len(prefix) :]) for n in options if n.startswith(prefix)}
            errors = {n: (lin, list(options[n]), _errors(lin.weight, options[n], storage)) for n, lin in mine.items()}
            summed = {n: dict.fromkeys(options[n], 0.0) for n in mine}
            grads = _backward(block, errors, inputs[i], grads, calls[i], summed)
            costs |= {n: {c: total / tokens for c, total in summed[n].items()} for n in summed}
            cast_params(block, home, storage)
        inputs[i] = None
    return costs


def _key(model: StreamedModel, ids: torch.Tensor, options: dict, device: torch.device) -> str | None:
    """What the costs depend on: the model's files, the tokens, the candidates' schemes and this code;
    None for a model held only in memory."""
    model = streamed(model)
    if model.checkpoint is None:
        return None
    h = hashlib.sha256(model.checkpoint.fingerprint().encode())
    h.update(ids.cpu().numpy().tobytes())
    h.update(repr(sorted((n, sorted((c, repr(s)) for c, s in o.items())) for n, o in options.items())).encode())
    h.update(f"{device.type}:{model.dtype}:{torch.__version__}".encode())
    h.update(Path(__file__).read_bytes())
    return h.hexdigest()[:32]


def _read(path: Path | None, options: dict) -> dict | None:
    """The costs kept in ``path``, None when absent or not whole (then they are measured again)."""
    try:
        costs = json.loads(path.read_text()) if path is not None and path.is_file() else None
    except (OSError, ValueError):
        return None
    whole = isinstance(costs, dict) and all(
        isinstance(costs.get(n), dict) and all(isinstance(costs[n].get(c), float) for c in o)
        for n, o in options.items()
    )
    return costs if whole else None


def _save(path: Path, costs: dict) -> None:
    """Atomically; a cache that cannot be written costs only a second measurement."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
        partial.write_text(json.dumps(costs))
        os.replace(partial, path)
        for old in sorted(path.parent.glob("*.json"), key=lambda f: f.stat().st_mtime)[:-CACHE_FILES]:
            old.unlink(missing_ok=True)
    except OSError:
        pass
