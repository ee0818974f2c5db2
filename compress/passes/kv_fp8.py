"""An FP8 KV cache with calibrated per-layer scales, as vLLM stores it (the math in ``compress/kv_fp8.py``).

The largest |key| (after the rotary embedding) and |value| each attention writes over the calibration
data set its ``k_scale`` and ``v_scale``; evaluation then reads every key and value rounded, and the
export writes the scales with the ``kv_cache_scheme`` that vLLM and transformers read. It changes no
weight, so it combines with any weight recipe (FP8 weights and activations is vLLM's usual pairing).
"""

from __future__ import annotations

import torch

from .. import distributed
from ..arch import decoder_layers
from ..kv_fp8 import KVScale, through
from ..kv_quant import attention_modules
from .base import LayerPass, PassOptions, RecipeError


class KVFP8Options(PassOptions):
    pass


class KVFP8(LayerPass):
    name = "kv_fp8"
    Options = KVFP8Options
    compresses = False  # the weights stay as they are
    leaves = frozenset({"kv_fp8"})

    def order_problem(self, before, after):
        if any(p.name in ("kv_cache", "kv_fp8") for p in before + after):
            return "a model has one KV cache; keep either kv_cache (KIVI) or kv_fp8"
        return None

    def check(self, model) -> None:
        if not attention_modules(decoder_layers(model)[0]):
            raise RecipeError(f"{self.where}: no attention module found in {type(model).__name__}'s blocks")
        self.dtype = model.dtype  # storage dtype: the scales are rounded to it, as transformers holds them

    def apply(self, block, data, prefix: str) -> None:
        largest = {}  # attention -> [largest |key|, largest |value|]

        def observer(attention):
            device = next(attention.parameters()).device
            seen = largest.setdefault(attention, [torch.zeros((), device=device), torch.zeros((), device=device)])

            def written(key, value):
                seen[0] = torch.maximum(seen[0], key.detach().abs().amax().float())
                seen[1] = torch.maximum(seen[1], value.detach().abs().amax().float())
                return key, value

            return lambda module, args, kwargs: (args, through(written, module, kwargs))

        handles = [a.register_forward_pre_hook(observer(a), with_kwargs=True) for a in attention_modules(block)]
        try:
            data.forward()
        finally:
            for h in handles:
                h.remove()
        for attention, (k_max, v_max) in largest.items():
            distributed.max_(k_max)
            distributed.max_(v_max)
            KVScale.calibrated(k_max, v_max, self.dtype).attach(attention)

    def summary(self) -> str:
        return "KV cache FP8 E4M3, static per-layer scales"
