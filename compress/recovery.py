"""What recovery training shares: which tensors train, and the loop that trains them.

Blockwise reconstruction, distillation and QLoRA differ only in their loss. What trains
is attached to the model as parametrizations (``torch.nn.utils.parametrize``), so the
model keeps its ordinary forward and the compressed structure cannot drift:

- ``scales``: each quantized linear's per-group scales, as a multiplier that starts at 1;
  integers and zero-points stay, so the export layout is unchanged.
- ``norms``: the RMSNorm weights.
- ``weights``: the weights of linears that are not quantized; pruned entries stay exactly zero.
- ``lora``: a rank-r product ``B·A`` added to each quantized linear (our integers, or bitsandbytes'
  4-bit codes) on a frozen base (``B`` starts at zero); it exports as a PEFT adapter
  (``state.LoRA``), like LoRC.

Trainable tensors are float32 whatever the compute dtype (Adam on bf16 parameters loses
small updates); the forward sees them in the compute dtype. ``Trainables.finish`` writes
the result back as the rest of the code expects it: scales rounded to the storage dtype
and re-attached, weights rounded to the storage dtype, LoRA kept on the linear.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Literal

import torch
from torch import nn
from torch.nn.utils import parametrize
from tqdm import tqdm

from .formats.bitsandbytes import Rounded4bit
from .quant import QuantizedWeight, attach, quantized_of
from .sparsity import prune_mask_of
from .state import LoRA

Trainable = Literal["scales", "norms", "weights", "lora"]


class _ScaleGrid(nn.Module):
    """``w = (q − zero) · scale · factor`` per group; ``factor`` trains."""

    def __init__(self, qw: QuantizedWeight, device: torch.device, dtype: torch.dtype):
        super().__init__()
        out_features, in_features = qw.q.shape
        groups = qw.scale.shape[1]
        grid = qw.q.float().reshape(out_features, groups, -1) - qw.zero_point.float().unsqueeze(-1)
        self.register_buffer("grid", grid.to(device))
        self.register_buffer("scale", qw.scale.float().to(device))
        self.factor = nn.Parameter(torch.ones_like(self.scale))
        self.dtype = dtype

    def forward(self, _weight):
        w = self.grid * (self.scale * self.factor).unsqueeze(-1)
        return w.reshape(self.grid.shape[0], -1).to(self.dtype)


class _Float(nn.Module):
    """A float32 master copy seen in the compute dtype; pruned entries (``keep`` = 0) stay zero."""

    def __init__(self, dtype: torch.dtype, keep: torch.Tensor | None = None):
        super().__init__()
        self.dtype = dtype
        self.register_buffer("keep", keep)

    def forward(self, weight):
        return (weight if self.keep is None else weight * self.keep).to(self.dtype)


class _LoRA(nn.Module):
    """Adds ``B·A``; ``A`` is drawn as in peft (Kaiming uniform), ``B`` starts at zero."""

    def __init__(
        self, out_features: int, in_features: int, rank: int, generator: torch.Generator, device: torch.device
    ):
        super().__init__()
        bound = 1 / math.sqrt(in_features)
        self.A = nn.Parameter((torch.rand(rank, in_features, generator=generator) * 2 - 1).mul_(bound).to(device))
        self.B = nn.Parameter(torch.zeros(out_features, rank, device=device))

    def forward(self, weight):
        return weight + (self.B @ self.A).to(weight.dtype)


def _is_norm(module: nn.Module) -> bool:
    return "Norm" in type(module).__name__ and isinstance(getattr(module, "weight", None), nn.Parameter)


class Trainables:
    """The chosen tensors of ``linears`` (name -> linear) and of the norms inside ``root``."""

    def __init__(
        self,
        root: nn.Module,
        linears: dict[str, nn.Linear],
        train: list[str],
        storage: torch.dtype,
        rank: int = 16,
        seed: int = 0,
    ):
        self.storage = storage
        self.touched: list[tuple[nn.Module, torch.dtype]] = []
        self.groups: dict[str, list[nn.Parameter]] = {"scales": [], "norms": [], "weights": [], "lora": []}
        for p in root.parameters():
            p.requires_grad_(False)
        generator = torch.Generator().manual_seed(seed)
        for lin in linears.values():
            qw, dtype, device = quantized_of(lin), lin.weight.dtype, lin.weight.device
            if qw is not None and "scales" in train:
                self._register(lin, _ScaleGrid(qw, device, dtype), dtype)
                self.groups["scales"].append(lin.parametrizations.weight[-1].factor)
            if qw is None and "weights" in train:
                mask = prune_mask_of(lin)
                keep = None if mask is None else (~mask).to(device, torch.float32)
                lin.weight = nn.Parameter(lin.weight.detach().float())
                self._register(lin, _Float(dtype, keep), dtype)
                lin.parametrizations.weight.original.requires_grad_(True)
                self.groups["weights"].append(lin.parametrizations.weight.original)
            if (qw is not None or Rounded4bit.of(lin) is not None) and "lora" in train:
                lora = _LoRA(lin.out_features, lin.in_features, rank, generator, device)
                self._register(lin, lora, dtype)
                self.groups["lora"] += [lora.A, lora.B]
        if "norms" in train:
            for norm in [m for m in root.modules() if _is_norm(m)]:
                dtype = norm.weight.dtype
                norm.weight = nn.Parameter(norm.weight.detach().float())
                self._register(norm, _Float(dtype), dtype)
                norm.parametrizations.weight.original.requires_grad_(True)
                self.groups["norms"].append(norm.parametrizations.weight.original)

    def _register(self, module: nn.Module, parametrization: nn.Module, dtype: torch.dtype) -> None:
        if not parametrize.is_parametrized(module, "weight"):
            self.touched.append((module, dtype))
        parametrize.register_parametrization(module, "weight", parametrization, unsafe=True)

    def __bool__(self) -> bool:
        return any(self.groups.values())

    def param_groups(self, lr: float, weight_lr: float) -> list[dict]:
        return [{"params": ps, "lr": weight_lr if kind == "weights" else lr} for kind, ps in self.groups.items() if ps]

    @torch.no_grad()
    def finish(self) -> None:
        """Fold what was trained back into plain parameters (see the module docstring)."""
        for module, dtype in self.touched:
            steps = list(module.parametrizations.weight)
            value = module.parametrizations.weight.original.detach()
            lora = None
            for step in steps:
                if isinstance(step, _ScaleGrid):
                    qw = quantized_of(module)
                    qw.scale = (step.scale * step.factor).to(self.storage).to(qw.scale.device)
                elif isinstance(step, _Float):
                    value = step(value).to(self.storage)
                elif isinstance(step, _LoRA):
                    lora = LoRA(step.B.detach().to(self.storage), step.A.detach().to(self.storage))
            parametrize.remove_parametrizations(module, "weight", leave_parametrized=False)
            module.weight = nn.Parameter(value.to(dtype), requires_grad=False)
            if quantized_of(module) is not None:
                attach(module, quantized_of(module))  # the weight is what the export dequantizes to
            if lora is not None:
                module.weight.data = (
                    (module.weight.float() + lora.B.float() @ lora.A.float()).to(self.storage).to(dtype)
                )
                lora.attach(module)


def train(
    trainables: Trainables,
    loss_of: Callable[[int], torch.Tensor],
    steps: int,
    lr: float,
    weight_lr: float,
    desc: str,
    progress: bool = True,
    optimizer: str = "adamw",
) -> dict:
    """AdamW with cosine decay; ``loss_of(step)`` builds one step's loss. ``optimizer``
    ``adamw8bit``: bitsandbytes' 8-bit AdamW (its moments quantized blockwise; tensors under 4,096
    values keep fp32 moments, as bitsandbytes decides).

    Returns the mean loss of the first and last tenth of the steps (single steps are noisy)
    and the wall time.
    """
    start = time.perf_counter()
    groups = trainables.param_groups(lr, weight_lr)
    if optimizer == "adamw8bit":
        import bitsandbytes as bnb

        optimizer = bnb.optim.AdamW8bit(groups, weight_decay=0.0)
    else:
        optimizer = torch.optim.AdamW(groups, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, steps)
    losses = []
    bar = tqdm(range(steps), desc=desc, unit="step", disable=not progress, leave=False)
    with torch.enable_grad():
        for step in bar:
            loss = loss_of(step)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            schedule.step()
            losses.append(loss.item())
            bar.set_postfix(loss=f"{losses[-1]:.4g}")
    tenth = max(1, steps // 10)
    return {
        "steps": steps,
        "loss_first": sum(losses[:tenth]) / tenth,
        "loss_last": sum(losses[-tenth:]) / tenth,
        "seconds": time.perf_counter() - start,
    }
