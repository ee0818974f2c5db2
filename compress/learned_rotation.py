"""Learned rotations (SpinQuant, Liu et al. 2024): R1 on the residual stream and an R2 per layer
on the attention values, trained so that the *quantized* model stays closest to the original.

A Hadamard rotation spreads outliers evenly but knows nothing of the quantizer, and rotations
differ: SpinQuant reports a wide spread of W4A4 accuracy between random ones. Here every step
rotates the weights (``rotate.rotated_parameters``, the math the export is made with), rounds the
linears the recipe's first quantizer targets to its schemes by round-to-nearest (the
straight-through estimator carries the gradient past the rounding), rounds their inputs as an
``int`` ``activations`` pass after it would, and differentiates the KL divergence from the
original model's next-token distribution on one calibration sample with respect to the rotations.
SpinQuant minimises the cross-entropy on the text instead; the original's whole distribution is a
target with less noise per sample than one token, and it is what our evaluation scores. The step
is a Cayley transform on the orthogonal group (Li et al. 2020, with momentum), so the rotations
stay orthogonal and the dense model computes the same whatever they become.

The model is trained whole, in a float32 copy: it is for models that fit in memory twice.
"""

from __future__ import annotations

import copy
import time

import torch
from torch.func import functional_call
from tqdm import tqdm

from .arch import decoder_layers
from .passes.rotate import down_of, rotated_parameters
from .quant import fake_quantize, fake_quantize_activation


def _straight_through(x: torch.Tensor, rounded: torch.Tensor) -> torch.Tensor:
    """``rounded`` forward, the identity backward."""
    return x + (rounded - x).detach()


class _Serving:
    """Pre-hooks that make the float32 copy compute as served while ``on``: ``down_proj``'s input
    rotated online, inputs rounded as the ``activations`` pass rounds them. Off, it is the original."""

    def __init__(self, layers, arch, r4, acts):
        self.on, self.handles = False, []
        for i, block in enumerate(layers):
            if r4 is not None:  # before any rounding; one matmul here
                self._hook(down_of(block, arch), lambda x: x @ r4)
            if acts is not None:
                for lin in acts.targets(block, f"{arch.layers}.{i}.").values():
                    self._hook(lin, lambda x: _straight_through(x, fake_quantize_activation(x.detach(), acts.scheme)))

    def _hook(self, module, change) -> None:
        def hook(module, args):
            return (change(args[0]), *args[1:]) if self.on else None

        self.handles.append(module.register_forward_pre_hook(hook))

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


@torch.no_grad()
def _cayley_step(r: torch.Tensor, momentum: torch.Tensor, lr: float, beta: float = 0.9) -> None:
    """Move ``r`` down its gradient along the orthogonal group: ``A = M rᵀ - r Mᵀ`` (skew, from the
    gradient's momentum ``M``), ``r ← (I + a/2 A)⁻¹ (I - a/2 A) r``, the step ``a`` at most ``lr``
    and at most ``1/‖A‖`` so that no step turns the rotation far."""
    momentum.mul_(beta).add_(r.grad)
    a_skew = momentum @ r.T - r @ momentum.T
    step = min(lr, 1.0 / (float(a_skew.norm()) + 1e-8))
    eye = torch.eye(r.shape[0], dtype=r.dtype, device=r.device)
    r.copy_(torch.linalg.solve(eye + step / 2 * a_skew, (eye - step / 2 * a_skew) @ r))
    r.grad = None


def _orthonormal(r: torch.Tensor) -> torch.Tensor:
    """The nearest orthogonal matrix in float64 (the polar factor, by Newton–Schulz steps, which
    converge quadratically from a matrix as near orthogonal as float32 Cayley steps leave it)."""
    x = r.detach().double()
    eye = torch.eye(x.shape[0], dtype=x.dtype, device=x.device)
    for _ in range(3):
        x = x @ (3 * eye - x.T @ x) / 2
    return x


def _objective(student, rotate, quantizer, serving: _Serving, R1, R2, r4, device):
    """The training loss as a function of one sample: the KL from the original (``student`` with
    nothing overridden) of the model rotated by ``R1``/``R2``/``r4`` and rounded as served."""
    arch, head_dim = rotate.arch, rotate.head_dim
    layers = decoder_layers(student)
    base_name = arch.layers.rsplit(".", 1)[0]  # the decoder under the head ("model")
    base = student.get_submodule(base_name)
    final_norm = student.get_submodule(arch.norm).weight
    head = student.get_output_embeddings().weight
    embedding = student.get_input_embeddings()

    def objective(x: torch.Tensor) -> torch.Tensor:
        """KL from the original of the rotated, rounded model on one sample, differentiable in the rotations."""
        overrides = {}
        for i, block in enumerate(layers):
            prefix = f"{arch.layers}.{i}."
            rotated = rotated_parameters(block, arch, head_dim, R1, None if R2 is None else R2[i], r4)
            for name, lin in quantizer.targets(block, prefix).items():
                w = rotated.get(f"{name}.weight", lin.weight)
                rounded = fake_quantize(w.detach(), quantizer.scheme_for(prefix + name))
                rotated[f"{name}.weight"] = _straight_through(w, rounded)
            overrides.update({prefix + name: t for name, t in rotated.items()})
        x = x[None].to(device)
        with torch.no_grad():  # what the original predicts
            target = torch.log_softmax(student(x, use_cache=False).logits[0].float(), -1)
        serving.on = True
        if R1 is not None:  # the stream is rotated: embed, run the decoder with its final norm's weight 1, head
            overrides[f"{arch.norm}.weight"] = torch.ones_like(final_norm)
            inner = {k[len(base_name) + 1 :]: v for k, v in overrides.items()}
            kwargs = dict(inputs_embeds=embedding(x) @ R1, use_cache=False)
            hidden = functional_call(base, inner, args=(), kwargs=kwargs).last_hidden_state
            logits = ((hidden @ R1.T) * final_norm) @ head.T
        else:
            logits = functional_call(student, overrides, args=(x,), kwargs=dict(use_cache=False)).logits
        serving.on = False
        logp = torch.log_softmax(logits[0].float(), -1)
        return torch.nn.functional.kl_div(logp, target, log_target=True, reduction="batchmean")

    return objective


def learn(
    model: torch.nn.Module,
    ids: torch.Tensor,
    rotate,
    later: list,
    r1: torch.Tensor | None,
    r2: list[torch.Tensor] | None,
    device: torch.device,
    steps: int,
    lr: float,
    seed: int,
) -> tuple[torch.Tensor | None, list[torch.Tensor] | None, dict]:
    """Train ``r1`` and the per-layer ``r2`` (starting values, float64) of the ``rotate`` pass on the
    calibration ``ids`` (samples × seqlen), against the quantizer among ``later`` (the passes after
    it). Returns them, orthonormal in float64, and a training log whose losses are the KL on one
    calibration sample held out of training, before and after it (``loss_first``, ``loss_last``)."""
    quantizer = next(p for p in later if p.rounding is not None and hasattr(p, "scheme_for"))
    acts = next((p for p in later if p.name == "activations" and p.scheme.format == "int"), None)
    student = copy.deepcopy(model).float().to(device).eval()
    student.requires_grad_(False)
    r4 = None if rotate.r4 is None else rotate.r4.to(device, torch.float32)
    R1 = None if r1 is None else r1.to(device, torch.float32).requires_grad_()
    R2 = [r.to(device, torch.float32).requires_grad_() for r in r2] if r2 is not None else None
    trained = ([R1] if R1 is not None else []) + (R2 or [])
    momenta = [torch.zeros_like(r) for r in trained]
    serving = _Serving(decoder_layers(student), rotate.arch, r4, acts)
    objective = _objective(student, rotate, quantizer, serving, R1, R2, r4, device)
    order = torch.randperm(len(ids), generator=torch.Generator().manual_seed(seed)).tolist()
    held_out, train = ids[order[-1]], [ids[i] for i in (order[:-1] or order)]  # one sample judges the rotations
    start = time.perf_counter()
    try:
        with torch.no_grad():
            before = objective(held_out).item()
        for step in (bar := tqdm(range(steps), desc="learning rotations", unit="step")):
            loss = objective(train[step % len(train)])
            loss.backward()
            for r, m in zip(trained, momenta):  # the step decays linearly to nothing
                _cayley_step(r, m, lr * (1 - step / steps))
            bar.set_postfix(kl=f"{loss.item():.4g}")
        with torch.no_grad():
            after = objective(held_out).item()
    finally:
        serving.remove()
    log = {"steps": steps, "loss_first": before, "loss_last": after, "seconds": time.perf_counter() - start}
    return (
        None if R1 is None else _orthonormal(R1),
        None if R2 is None else [_orthonormal(r) for r in R2],
        log,
    )
