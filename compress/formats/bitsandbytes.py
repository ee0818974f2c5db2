"""bitsandbytes' 4-bit layout: NF4/FP4 codes in blocks of 64 as transformers saves a ``load_in_4bit``
model, so that ``from_pretrained`` loads an export as ``Linear4bit`` modules and peft puts an adapter
on them (QLoRA's ``base: nf4``). The codes come from bitsandbytes' own ``quantize_4bit`` and are read
back with its ``dequantize_4bit``: nothing here rounds by itself.
"""

from __future__ import annotations

import functools
import importlib.util
import logging

import torch

from ..state import State

BLOCKSIZE = 64  # what load_in_4bit uses


class Rounded4bit(State, attr="bnb_4bit"):
    """A linear rounded to bitsandbytes' 4-bit codes (``round_4bit``): the codes and its QuantState."""

    def __init__(self, codes: torch.Tensor, quant_state):
        self.codes, self.quant_state = codes, quant_state

    def stored_bits(self, module):
        """Codes and block scales (4.5 bits per weight with fp32 scales)."""
        return 8 * (self.codes.nbytes + self.quant_state.absmax.nbytes), module.weight.numel()

    def tensors(self, name: str) -> dict[str, torch.Tensor]:
        """The weight as transformers saves a ``Linear4bit``: the packed codes under ``{name}.weight``,
        the block scales and code table beside them."""
        parts = self.quant_state.as_dict(packed=True)
        return {f"{name}.weight": self.codes, **{f"{name}.weight.{k}": v for k, v in parts.items()}}


def round_4bit(linear: torch.nn.Linear, dtype: torch.dtype, quant_type: str = "nf4") -> None:
    """Round ``linear``'s weight, seen in ``dtype`` (the checkpoint's: what ``load_in_4bit`` rounds),
    to bitsandbytes' 4-bit codes in blocks of 64. The codes are kept on the linear for the export
    (``Rounded4bit``); its weight becomes what bitsandbytes dequantizes them to."""
    quiet()
    import bitsandbytes.functional as F

    weight = linear.weight.data
    codes, state = F.quantize_4bit(
        weight.detach().cpu().to(dtype).contiguous(), blocksize=BLOCKSIZE, quant_type=quant_type
    )
    Rounded4bit(codes, state).attach(linear)
    linear.weight.data = F.dequantize_4bit(codes, state).to(weight.device, weight.dtype)


def config(quant_type: str, dtype: torch.dtype, dense: list[str]) -> dict:
    """The ``quantization_config`` transformers writes for a ``load_in_4bit`` model, with the linears
    left dense (lm_head, ``ignore``) named, as transformers' default list would not know them."""
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type=quant_type, bnb_4bit_compute_dtype=dtype, llm_int8_skip_modules=dense
    ).to_dict()


class Reader:
    """An export whose linears are stored in this layout: each dequantized by bitsandbytes' own code."""

    format = "bitsandbytes-4bit"

    def __init__(self, qconfig: dict, checkpoint):
        from .safetensors import CheckpointError

        if not qconfig.get("load_in_4bit"):
            raise CheckpointError(f"{checkpoint.folder}: bitsandbytes 8-bit checkpoints cannot be read (4-bit can)")
        if importlib.util.find_spec("bitsandbytes") is None:
            raise CheckpointError(f"{checkpoint.folder} holds bitsandbytes 4-bit weights: pip install bitsandbytes")
        self.checkpoint = checkpoint

    def scheme_of(self, name: str, module: torch.nn.Module) -> bool | None:
        """True for a linear stored in 4 bits (its block scales are there), None for a dense one."""
        if isinstance(module, torch.nn.Linear) and f"{name}.weight.absmax" in self.checkpoint:
            return True
        return None

    def keys(self, stored: str, checkpoint) -> list[str]:
        return [f"{stored}.weight"] + [k for k in checkpoint.file_of if k.startswith(f"{stored}.weight.")]

    def weight(self, tensors: dict[str, torch.Tensor], scheme) -> torch.Tensor:
        """A weight from ``Rounded4bit.tensors``' parts (keys without the linear's name), as
        bitsandbytes' ``Linear4bit`` dequantizes it."""
        quiet()
        import bitsandbytes.functional as F

        state = F.QuantState.from_dict(
            {k.removeprefix("weight."): v for k, v in tensors.items() if k != "weight"}, "cpu"
        )
        return F.dequantize_4bit(tensors["weight"], state)


@functools.cache
def quiet() -> None:
    """Drop two messages bitsandbytes logs that say nothing to act on: that its optional CPU kernels
    from the hub's ``kernels`` package are absent (it falls back to its own), and, on every
    LLM.int8 call, that the rows are cast to fp16 (that is how LLM.int8 multiplies)."""
    for logger, text in (
        ("bitsandbytes.backends.cpu.ops", "kernels-community"),
        ("bitsandbytes.autograd._functions", "inputs will be cast"),
    ):
        logging.getLogger(logger).addFilter(lambda record, text=text: text not in record.getMessage())
