"""QLoRA (Dettmers et al. 2023): low-rank adapters trained on a frozen quantized base.

The base is, by default, the quantized model that the passes before produced (our integer
weights, as exported): the adapter is then trained against exactly the weights a server will
load. ``base: nf4`` is the paper's and peft users' QLoRA: the pass itself
rounds the original weights with bitsandbytes (NF4 in blocks of 64, what ``load_in_4bit``
gives), trains on that, and exports them as transformers saves a ``load_in_4bit`` model, so
``from_pretrained`` and peft load the export as they load their own.

Training is the distillation loop with only the LoRA factors moving (the teacher's logits are
the target). The adapter exports as a PEFT LoRA adapter next to the checkpoint (scale 1,
``lora_alpha = r``); ``merge: true`` instead adds it to the weights and rounds them again on
the same grid (round-to-nearest, or NF4), which costs some of the gain.
"""

from __future__ import annotations

import importlib.util
from typing import Literal

import torch
from pydantic import Field, model_validator

from ..formats.bitsandbytes import Rounded4bit, round_4bit
from ..quant import attach, quantize_weight, quantized_of
from ..recovery import Trainables
from ..sparsity import apply_mask, prune_mask_of
from ..state import LoRA
from .distill import Distill, DistillOptions


class QLoRAOptions(DistillOptions):
    train: list[Literal["lora", "scales", "norms"]] = ["lora"]
    rank: int = Field(16, gt=0)
    merge: bool = False
    gradient_checkpointing: bool = True
    base: Literal["quantized", "nf4"] = "quantized"

    @model_validator(mode="after")
    def _nf4_base(self):
        if self.base == "nf4" and "scales" in self.train:
            raise ValueError("base: nf4 has no integer scales to train; train lora (and norms)")
        if self.base == "nf4" and importlib.util.find_spec("bitsandbytes") is None:
            raise ValueError("base: nf4 needs the bitsandbytes package: pip install bitsandbytes")
        return self


class QLoRA(Distill):
    name = "qlora"
    leaves = frozenset({"bnb_4bit", "lora", "quantized"})
    Options = QLoRAOptions

    @property
    def compresses(self) -> bool:
        return self.options.base == "nf4"

    @property
    def weight_bits(self) -> int | None:
        return 4 if self.options.base == "nf4" else None

    def order_problem(self, before, after):
        if self.options.base == "nf4":
            if rounding := [q for q in before if q.weight_bits]:
                return (
                    f"base: nf4 rounds the original weights itself; remove {rounding[0].where} "
                    "or train on its integers with base: quantized"
                )
            return super().order_problem([*before, self], after)
        if not any(q.weight_bits for q in before):
            return (
                "LoRA trains on a frozen quantized base; put a quantization pass before it, "
                "or set base: nf4 to train on bitsandbytes NF4"
            )
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

    def apply_model(self, model, teacher, ids, device, tokenizer=None) -> None:
        if self.options.base == "nf4":
            for lin in self.linears(model).values():
                round_4bit(lin, self.dtype)
        super().apply_model(model, teacher, ids, device)

    @torch.no_grad()
    def after_training(self, model) -> None:
        if not self.options.merge:
            return
        for lin in self.linears(model).values():
            if LoRA.of(lin) is None:
                continue
            if Rounded4bit.of(lin) is not None:
                round_4bit(lin, self.dtype)
            else:
                qw, mask = quantized_of(lin), prune_mask_of(lin)
                attach(lin, quantize_weight(lin.weight.data, qw.scheme, self.dtype))
                if mask is not None:
                    apply_mask(lin, mask)
            LoRA.drop(lin)

    def summary(self) -> str:
        o = self.options
        base = " on nf4" if o.base == "nf4" else ""
        return f"qlora r{o.rank}{base} ({'+'.join(o.train)}, {o.steps} steps{', merged' if o.merge else ''})"
