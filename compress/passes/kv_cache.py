"""KV-cache quantization (KIVI): marks every attention with the scheme; no weight changes.

Evaluation then simulates a decoder's quantized cache, the export records the scheme under
``compress_kv_cache`` in config.json, and ``compress.kv_quant.new_cache`` builds the cache
for ``generate``. The math is in ``compress/kv_quant.py``.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

from ..arch import decoder_layers
from ..kv_quant import KVScheme, attention_modules, hadamard
from .base import LayerPass, PassOptions, RecipeError


class KVCacheOptions(PassOptions):
    bits: Literal[2, 4, 8] = 4
    group_size: int = Field(32, gt=0)
    residual: int = Field(128, ge=0)  # recent tokens in full precision: 0, or a multiple of group_size
    sinks: int = Field(0, ge=0)  # the first tokens in full precision for good (attention sinks)
    pre_rope: bool = False  # keys quantized before the rotary embedding (KVQuant)
    key_group_size: int | None = Field(None, gt=0)  # tokens sharing a key channel's scale; default group_size
    fp8_key_scales: bool = False  # key scales in float8 e4m3, minima in 16 bits
    rotate_values: bool = False  # values rounded in a Hadamard basis (QuaRot)
    rotate_keys: bool = False  # keys rounded in a Hadamard basis (QuaRot's R3)


class KVCachePass(LayerPass):
    name = "kv_cache"
    leaves = frozenset({"kv_scheme"})
    Options = KVCacheOptions
    needs_data = False
    compresses = False  # the weights stay as they are

    def __init__(self, options, where):
        super().__init__(options, where)
        try:
            self.scheme = KVScheme(**options.model_dump())
        except ValueError as e:
            raise RecipeError(f"{where}: {e}") from None

    def check(self, model) -> None:
        attention = attention_modules(decoder_layers(model)[0])
        if not attention:
            raise RecipeError(f"{self.where}: no attention module found in {type(model).__name__}'s blocks")
        head_dim = attention[0].head_dim
        if head_dim % self.scheme.group_size:
            raise RecipeError(
                f"{self.where}.group_size: {self.scheme.group_size} does not divide the head "
                f"dimension {head_dim}; use a divisor of it"
            )
        if self.scheme.residual == 0 and head_dim % self.scheme.key_group:
            raise RecipeError(
                f"{self.where}.key_group_size: without a window keys are grouped by channel, and "
                f"{self.scheme.key_group} does not divide the head dimension {head_dim}; use a divisor of it"
            )
        for key in ("rotate_values", "rotate_keys"):
            if getattr(self.scheme, key):
                try:
                    hadamard(head_dim, torch.float32, torch.device("cpu"))
                except ValueError as e:
                    raise RecipeError(f"{self.where}.{key}: {e}; turn it off") from None

    def apply(self, block, data, prefix: str) -> None:
        for attention in attention_modules(block):
            self.scheme.attach(attention)

    def summary(self) -> str:
        return self.scheme.describe()
