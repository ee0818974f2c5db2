"""``eagle``: train an EAGLE draft head (``compress.eagle``) against the model the passes before
left, on the calibration text, and export it beside the model (``formats.eagle_head``).

It runs last, on the compressed model: the head must predict the states of the target it will
draft for, and rounding changes them; with ``chat_replies`` it also reads the model's own replies
to chat requests, text like what a chat model drafts (wikitext alone is not). It changes nothing
of the model, so it needs no compression before it (``eagle-head`` trains one for the dense
model) and no teacher.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

from ..data import chat_replies
from ..eagle import EagleState, train_head
from ..models import cast_params, for_compute
from .base import ModelPass, PassOptions


class EagleOptions(PassOptions):
    layers: Literal[1] = 1  # EAGLE-1's one decoder layer (the layout vLLM reads)
    steps: int = Field(600, gt=0)
    lr: float = Field(1e-3, gt=0)
    batch: int = Field(2, gt=0)  # calibration samples per step
    draft_vocab: int = Field(8192, gt=1)  # tokens the head proposes: the calibration text's most frequent
    class_weight: float = Field(0.1, ge=0)  # EAGLE's weight of the token loss beside the state regression
    # the compressed model's greedy replies to this many of the shipped chat requests
    # (calibration/chat-prompts.txt) join the calibration text: the states a chat model's head drafts from
    chat_replies: int = Field(0, ge=0)
    reply_tokens: int = Field(256, gt=0)


class Eagle(ModelPass):
    name = "eagle"
    Options = EagleOptions
    compresses = False
    needs_teacher = False

    def order_problem(self, before, after):
        if later := [q for q in after if q.name != self.name]:
            kind = "every block pass" if not isinstance(later[0], ModelPass) else "recovery training"
            return f"trains a head on the finished model, so it must follow {kind} ({later[0].where} comes after it)"
        return None

    def apply_model(self, model, teacher, ids, device, tokenizer=None) -> None:
        o = self.options
        home, dtype = next(model.parameters()).device, model.dtype
        for_compute(model, device)
        try:
            sequences = list(ids)
            if o.chat_replies:
                sequences += chat_replies(model, tokenizer, o.chat_replies, o.reply_tokens)
            head, self.log = train_head(
                model, sequences, o.steps, o.lr, o.batch, o.draft_vocab, o.class_weight, seed=torch.initial_seed()
            )
        finally:
            cast_params(model, home, dtype)
        EagleState(head, self.log).attach(model)

    def summary(self) -> str:
        o = self.options
        return f"eagle head ({o.steps} steps, draft vocabulary {o.draft_vocab})"
