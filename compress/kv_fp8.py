"""An FP8 KV cache as vLLM stores it (``--kv-cache-dtype fp8``): each layer's keys, after the rotary
embedding, and values rounded to E4M3 with one static scale each (``k_scale``, ``v_scale``),
calibrated as the largest |key| and |value| the calibration data produces over 448.

Every token is read back rounded, the ones a step has just written too (vLLM's attention reads
them from the cache). The rounding happens where transformers hands a layer's new keys and values
to its cache (``Cache.update``): a pre-hook on each attention module passes it a stand-in that rounds
them, then hands them on to the real cache or, without one (perplexity over whole windows), back to
the attention. compressed-tensors rounds at that same point when transformers loads an export with a
``kv_cache_scheme``, but 0.20 hooks the argument under its old name (``past_key_values``), which
transformers 5.24 calls ``cache``: there the cache runs unrounded, so ``models.load`` reads such
exports itself.
"""

from __future__ import annotations

import inspect
from typing import ClassVar

import torch

from .quant import FP8_MAX, round_fp8
from .state import State

# what compressed-tensors' config calls it (``kv_cache_scheme``), and vLLM reads
SCHEME = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "tensor", "dynamic": False}


class KVScale(State, attr="kv_fp8"):
    """The static FP8 scales of one attention's keys and values."""

    holds_tensors: ClassVar[bool] = False  # two scalars the hook reads as long as the module lives

    def __init__(self, k_scale: torch.Tensor, v_scale: torch.Tensor):
        self.k_scale, self.v_scale = k_scale.float().reshape(1), v_scale.float().reshape(1)

    @classmethod
    def calibrated(cls, k_max: torch.Tensor, v_max: torch.Tensor, dtype: torch.dtype) -> KVScale:
        """From the largest |key| and |value| seen, rounded to the storage ``dtype`` as transformers holds them."""
        return cls(*((m.float().clamp(min=1e-12) / FP8_MAX).to(dtype) for m in (k_max, v_max)))

    def attach(self, module: torch.nn.Module) -> None:
        if KVScale.of(module) is None:
            module.register_forward_pre_hook(_round_cache_writes, with_kwargs=True)
        super().attach(module)

    def saved(self):
        return {"k_scale": self.k_scale, "v_scale": self.v_scale}, {}

    @classmethod
    def restored(cls, tensors, meta):
        return cls(tensors["k_scale"], tensors["v_scale"])

    def tensors(self, name: str) -> dict[str, torch.Tensor]:
        """What an export stores for attention ``name``, under the names vLLM and compressed-tensors read."""
        return {f"{name}.k_scale": self.k_scale, f"{name}.v_scale": self.v_scale}


class CacheWrites:
    """Stands in for a layer's ``past_key_values``: what the layer writes goes through ``written``
    (rounding, or observing), then on to the real cache when there is one."""

    def __init__(self, written, cache):
        self.written, self.cache = written, cache

    def update(self, key, value, *args, **kwargs):
        key, value = self.written(key, value)
        return (key, value) if self.cache is None else self.cache.update(key, value, *args, **kwargs)

    def __getattr__(self, name):  # the rest of the cache's interface (sequence length, masks)
        if self.cache is None:
            raise AttributeError(name)
        return getattr(self.cache, name)


def through(written, module: torch.nn.Module, kwargs: dict) -> dict:
    """``kwargs`` of ``module``'s forward with its cache argument (``cache`` since transformers 5.2x,
    ``past_key_values`` before) behind a ``CacheWrites`` stand-in that applies ``written``."""
    params = inspect.signature(module.forward).parameters
    name = next((n for n in ("cache", "past_key_values", "past_key_value") if n in params), "cache")
    return kwargs | {name: CacheWrites(written, kwargs.get(name))}


def _round_cache_writes(module, args, kwargs):
    scales = KVScale.of(module)
    if scales is None:  # dropped
        return None

    def written(key, value):
        return round_fp8(key, scales.k_scale), round_fp8(value, scales.v_scale)

    return args, through(written, module, kwargs)
