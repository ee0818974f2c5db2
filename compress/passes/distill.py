"""End-to-end knowledge distillation: the compressed model (student) learns the original's
(teacher's) next-token distribution on the calibration data.

KL divergence on temperature-softened logits, forward ``KL(teacher‖student)`` by default or
reverse ``KL(student‖teacher)`` (MiniLLM's mode-seeking choice), plus an optional MSE on the
last hidden state. Only the tensors named in ``train`` move (``compress/recovery.py``): by
default quantization scales, norms and the unpruned weights of linears that are not
quantized, so quantization grids and sparsity masks hold exactly.
"""

from __future__ import annotations

import warnings
from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import Field

from ..arch import arch_of, block_linears, decoder_layers
from ..models import cast_params, for_compute
from ..recovery import Trainables, train
from .base import ModelPass, RecoveryOptions, matches


class DistillOptions(RecoveryOptions):
    train: list[Literal["scales", "norms", "weights", "lora"]] = ["scales", "norms", "weights"]
    steps: int = Field(100, gt=0)
    loss: Literal["forward_kl", "reverse_kl"] = "forward_kl"
    temperature: float = Field(1.0, gt=0)
    hidden_weight: float = Field(0.0, ge=0)  # adds this × the last hidden state's relative MSE
    seqlen: int | None = Field(None, gt=1)  # crop calibration samples to this many tokens
    gradient_checkpointing: bool = False  # recompute activations in the backward: less memory, ~30% more time
    ignore: list[str] = ["lm_head"]


def distill_loss(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float = 1.0, kind: str = "forward_kl"
) -> torch.Tensor:
    """Mean per-token KL between the softened distributions, times T² (Hinton et al.'s scaling)."""
    s = F.log_softmax(student_logits.float() / temperature, -1).flatten(0, -2)
    t = F.log_softmax(teacher_logits.float() / temperature, -1).flatten(0, -2)
    kl = (
        F.kl_div(s, t, log_target=True, reduction="batchmean")
        if kind == "forward_kl"
        else F.kl_div(t, s, log_target=True, reduction="batchmean")
    )
    return kl * temperature**2


def _checkpointing(model, on: bool) -> None:
    """Activation checkpointing, by its transformers >= 5.20 name where there is one."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(
            {"use_reentrant": False}
        ) if on else model.activation_checkpointing_disable()
    elif on:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_disable()


class Distill(ModelPass):
    name = "distill"
    Options = DistillOptions

    def check(self, model) -> None:
        self.arch = arch_of(model)
        self.dtype = model.dtype

    def linears(self, model) -> dict[str, torch.nn.Linear]:
        prefix = self.arch.layers + "."
        return {
            f"{prefix}{i}.{name}": lin
            for i, block in enumerate(decoder_layers(model))
            for name, lin in block_linears(block, self.arch).items()
            if not any(matches(f"{prefix}{i}.{name}", p) for p in self.options.ignore)
        }

    def trainables(self, model) -> Trainables:
        return Trainables(model, self.linears(model), self.options.train, self.dtype, seed=torch.initial_seed())

    def apply_model(self, model, teacher, ids, device, tokenizer=None) -> None:
        o = self.options
        home = next(model.parameters()).device
        for_compute(model, device)
        for_compute(teacher, device)
        trainables = self.trainables(model)
        if not trainables:
            warnings.warn(f"{self.where}: nothing to train ({', '.join(o.train)})", stacklevel=2)
            cast_params(model, home, self.dtype)
            return
        ids = ids[:, : o.seqlen] if o.seqlen else ids
        generator = torch.Generator().manual_seed(torch.initial_seed())
        hidden = o.hidden_weight > 0
        if o.gradient_checkpointing:
            _checkpointing(model, True)
        model.train()

        def loss_of(step: int) -> torch.Tensor:
            x = ids[torch.randint(len(ids), (o.batch,), generator=generator)].to(device)
            with torch.no_grad():
                t = teacher(input_ids=x, output_hidden_states=hidden, use_cache=False)
            s = model(input_ids=x, output_hidden_states=hidden, use_cache=False)
            loss = distill_loss(s.logits, t.logits, o.temperature, o.loss)
            if hidden:
                th = t.hidden_states[-1].float()
                loss = loss + o.hidden_weight * F.mse_loss(s.hidden_states[-1].float(), th) / th.pow(2).mean()
            return loss

        try:
            self.log = train(trainables, loss_of, o.steps, o.lr, o.weight_lr, self.name, optimizer=o.optimizer)
        finally:
            trainables.finish()
            model.eval()
            if o.gradient_checkpointing:
                _checkpointing(model, False)
            cast_params(model, home, self.dtype)
        self.after_training(model)

    def after_training(self, model) -> None:
        pass

    def summary(self) -> str:
        o = self.options
        return f"{self.name} ({'+'.join(o.train)}, {o.loss}, {o.steps} steps)"
