"""QLoRA (Dettmers et al. 2023): low-rank adapters trained on a frozen quantized base.

The base is the quantized model that the passes before produced (our integer weights, as
exported), not bitsandbytes NF4: the adapter is then trained against exactly the weights a
server will load. Training is the distillation loop with only the LoRA factors moving (the
teacher's logits are the target). The adapter exports as a PEFT LoRA adapter next to the
checkpoint (scale 1, ``lora_alpha = r``); ``merge: true`` instead adds it to the weights and
quantizes them again with round-to-nearest on the same grid, which costs some of the gain.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

from ..quant import attach, quantize_weight, quantized_of
from ..recovery import Trainables
from ..sparsity import apply_mask, prune_mask_of
from .distill import Distill, DistillOptions


class QLoRAOptions(DistillOptions):
    train: list[Literal["lora", "scales", "norms"]] = ["lora"]
    rank: int = Field(16, gt=0)
    merge: bool = False
    gradient_checkpointing: bool = True


class QLoRA(Distill):
    name = "qlora"
    Options = QLoRAOptions

    def order_problem(self, before, after):
        if not any(q.weight_bits for q in before):
            return "LoRA trains on a frozen quantized base; put a quantization pass before it"
        return super().order_problem(before, after)

    def trainables(self, model) -> Trainables:
        return Trainables(
            model,
            self.linears(model),
            self.options.train,
            self.dtype,
            rank=self.options.rank,
            seed=torch.initial_seed(),
        )

    @torch.no_grad()
    def after_training(self, model) -> None:
        if not self.options.merge:
            return
        for lin in self.linears(model).values():
            if getattr(lin, "lora", None) is None:
                continue
            qw, mask = quantized_of(lin), prune_mask_of(lin)
            attach(lin, quantize_weight(lin.weight.data, qw.scheme, self.dtype))
            if mask is not None:
                apply_mask(lin, mask)
            del lin.lora

    def summary(self) -> str:
        o = self.options
        return f"qlora r{o.rank} ({'+'.join(o.train)}, {o.steps} steps{', merged' if o.merge else ''})"
