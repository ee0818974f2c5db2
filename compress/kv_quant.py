"""KV-cache quantization after KIVI (Liu et al. 2024): keys per channel, values per token.

Keys have outlier *channels*, so each key channel gets its own scale and minimum over a
group of ``group_size`` tokens; values are quantized per token, in groups of ``group_size``
channels. Both are asymmetric (``x ≈ code · scale + minimum``). The most recent tokens stay
in full precision (the residual window): a group of keys can only be quantized once all
its tokens exist, and recent tokens matter most. Every ``residual`` tokens the window is
quantized as one chunk and emptied; ``residual: 0`` quantizes every token at once (keys
then per token, like values), the baseline KIVI improves on.

Two ways to run it, which see the same numbers:

- ``KIVICache``, a transformers ``Cache`` for ``generate`` and our decoder: it stores the
  codes, scales and minima, and hands attention the dequantized prefix plus the window.
- ``simulating(model)``, for perplexity over whole windows: an attention function in which
  query ``i`` reads key ``j`` quantized exactly when a decoder would hold it quantized at
  step ``i`` — ``j < residual·⌊i/residual⌋`` (``j < i`` without a window), the first ``sinks``
  tokens never (counting starts after them).

``pre_rope`` (KVQuant, Hooper et al. 2024): keys are quantized as they were before the rotary
embedding and rotated again when read. Rotation mixes each channel pair by an angle that changes
with the position, so a key channel's outliers, steady before it, are spread over two channels
that swing from token to token after it, which is what a per-channel scale over a group of tokens
copes with worst. The cache holds the post-rotation keys the model hands it, so each chunk is
rotated back by its positions' angles, rounded, and rotated forward again (exact up to float
rounding: a rotation's inverse is its transpose).

Two options for 2 bits, where four levels per group leave little room (issue 31; measured in
docs/results.md). Keys cost most of INT2's error (on SmolLM2, exact values with INT2 keys keep
about 70% of the increase):

- ``key_group_size``: tokens sharing a key channel's scale, apart from the values' channel groups;
  with ``fp8_key_scales`` the key scales are held in float8 e4m3 (as NVFP4 holds its block
  scales) and the minima in 16 bits: smaller key groups for fewer bytes than 16-bit scales.
- ``rotate_values``: each head's values are multiplied by a Hadamard matrix before their per-token
  rounding and by its transpose after (QuaRot, Ashkboos et al. 2024): the rotation spreads an
  outlying channel over all of a token's channels, so one channel no longer sets its group's step.
  A decoder folds the matrix into ``v_proj`` and ``o_proj``; here it multiplies the cache.
- ``rotate_keys``: each head's keys are rounded in a Hadamard basis too (QuaRot's online ``R3``:
  after the rotary embedding a decoder rotates the query alike, so the scores are the same before
  rounding, and no weight can hold it, rotary lying between ``k_proj`` and the cache; with
  ``pre_rope`` the keys are rotated before the rotary embedding, as they are rounded). It spreads an
  outlying key channel over the token's channels, which keys rounded per token (``residual: 0``)
  need most; it helped KIVI's per-channel groups too (docs/results.md, "Hadamard keys").
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from dataclasses import asdict, dataclass
from typing import ClassVar

import torch
from transformers.cache_utils import Cache, DynamicLayer

from .hadamard import matrix as hadamard_matrix
from .state import State

CONFIG_KEY = "compress_kv_cache"
ATTENTION = "compress_kivi_simulation"


@dataclass(frozen=True)
class KVScheme(State, attr="kv_scheme"):
    bits: int = 4
    group_size: int = 32  # keys: tokens sharing a per-channel scale; values: channels sharing a per-token scale
    residual: int = 128  # recent tokens kept in full precision; a multiple of group_size, or 0
    sinks: int = 0  # the first tokens, kept in full precision for good (attention sinks)
    pre_rope: bool = False  # keys quantized before the rotary embedding (KVQuant)
    key_group_size: int | None = None  # tokens sharing a key channel's scale; None: group_size
    fp8_key_scales: bool = False  # key scales in float8 e4m3, minima in 16 bits
    rotate_values: bool = False  # values rounded in a Hadamard basis (QuaRot)
    rotate_keys: bool = False  # keys rounded in a Hadamard basis (QuaRot's R3)

    holds_tensors: ClassVar[bool] = False

    @property
    def key_group(self) -> int:
        return self.key_group_size or self.group_size

    def __post_init__(self):
        if self.bits not in (2, 4, 8):
            raise ValueError(f"KV-cache bits must be 2, 4 or 8, got {self.bits}")
        if self.group_size <= 0 or self.residual < 0 or self.residual % self.group_size:
            raise ValueError(f"residual ({self.residual}) must be 0 or a multiple of group_size ({self.group_size})")
        if self.sinks < 0:
            raise ValueError(f"sinks must be 0 or more, got {self.sinks}")
        if self.key_group <= 0 or self.residual % self.key_group:
            raise ValueError(f"residual ({self.residual}) must be 0 or a multiple of key_group_size ({self.key_group})")

    def saved(self):
        return {}, asdict(self)

    @classmethod
    def restored(cls, tensors, meta):
        return cls(**meta)

    def quantized_upto(self, tokens: int) -> int:
        """Of ``tokens`` cached tokens, a decoder holds ``sinks .. quantized_upto(tokens)`` quantized:
        after the sinks, whole multiples of ``residual`` (every token without a window)."""
        if tokens <= self.sinks:
            return tokens
        after = tokens - self.sinks
        return self.sinks + (after if self.residual == 0 else self.residual * (after // self.residual))

    def bytes_per_token(self, layers: int, kv_heads: int, head_dim: int, float_bytes: int = 2) -> float:
        """Quantized K and V of one token, scales and minima (``float_bytes`` each) included."""
        codes = 2 * head_dim * self.bits / 8
        # per-channel keys: a scale and a minimum per channel per key_group tokens; keys without a
        # window, per token: one pair per key_group channels. Both come to head_dim / key_group
        # pairs a token. Values: one pair per group_size channels.
        key_pair = (1 if self.fp8_key_scales else float_bytes) + float_bytes
        scales = head_dim * key_pair / self.key_group + head_dim * 2 * float_bytes / self.group_size
        return layers * kv_heads * (codes + scales)

    def describe(self) -> str:
        window = f"residual {self.residual}" if self.residual else "no residual"
        sinks = f" sinks {self.sinks}" if self.sinks else ""
        keys = f" keys g{self.key_group_size}" if self.key_group_size else ""
        extra = [
            name
            for name, on in (
                ("pre-RoPE keys", self.pre_rope),
                ("fp8 key scales", self.fp8_key_scales),
                ("Hadamard values", self.rotate_values),
                ("Hadamard keys", self.rotate_keys),
            )
            if on
        ]
        return f"KV INT{self.bits} g{self.group_size}{keys} {window}{sinks}" + "".join(f", {e}" for e in extra)


def dense_bytes_per_token(layers: int, kv_heads: int, head_dim: int, float_bytes: int = 2) -> int:
    return layers * kv_heads * 2 * head_dim * float_bytes


FP8_SMALLEST, FP8_LARGEST = 2.0**-9, 448.0  # float8 e4m3's least subnormal and largest finite


def _fp8(scale: torch.Tensor) -> torch.Tensor:
    """``scale`` as float8 e4m3 holds it, as float32. The nearest: rounding up (so that the range
    stays covered) coarsens every group's step: on Gemma-3 INT2 it cost 0.76 perplexity over
    16-bit scales in a 4-window screen, the nearest 0.12."""
    return scale.float().clamp(FP8_SMALLEST, FP8_LARGEST).to(torch.float8_e4m3fn).float()


def _minmax(x: torch.Tensor, dim: int, bits: int, fp8_scale: bool = False):
    """Asymmetric codes over ``dim`` (kept): ``x ≈ codes · scale + minimum``, error ≤ scale / 2
    (a float8 scale rounded down clamps the top code: up to 3/16 of a step more)."""
    lo, hi = x.amin(dim, keepdim=True), x.amax(dim, keepdim=True)
    scale = ((hi - lo) / (2**bits - 1)).clamp(min=1e-8)
    if fp8_scale:
        scale = _fp8(scale)
    codes = torch.round((x - lo) / scale).clamp(0, 2**bits - 1).to(torch.uint8)
    return codes, scale.to(x.dtype), lo


def _groups_of_channels(x: torch.Tensor, group: int) -> torch.Tensor:
    return x.reshape(*x.shape[:-1], x.shape[-1] // group, group)


def quantize_keys(k: torch.Tensor, s: KVScheme):
    """``k`` (batch, heads, tokens, dim), tokens a multiple of ``key_group`` (per channel) unless no window."""
    if s.rotate_keys:
        k = k @ hadamard(k.shape[-1], k.dtype, k.device)
    if s.residual == 0:
        return _minmax(_groups_of_channels(k, s.key_group), -1, s.bits, s.fp8_key_scales)
    b, h, n, d = k.shape
    return _minmax(k.reshape(b, h, n // s.key_group, s.key_group, d), -2, s.bits, s.fp8_key_scales)


@functools.lru_cache(maxsize=8)
def hadamard(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The orthonormal ``n × n`` Hadamard matrix (``compress.hadamard``), kept for each head width."""
    return hadamard_matrix(n, dtype, device)


def quantize_values(v: torch.Tensor, s: KVScheme):
    if s.rotate_values:
        v = v @ hadamard(v.shape[-1], v.dtype, v.device)
    return _minmax(_groups_of_channels(v, s.group_size), -1, s.bits)


def dequantize(codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, shape) -> torch.Tensor:
    return (codes.to(scale.dtype) * scale + minimum).reshape(shape)


def dequantize_keys(quantized: tuple, shape, s: KVScheme) -> torch.Tensor:
    """``quantize_keys``' inverse: back from the Hadamard basis with ``rotate_keys``."""
    k = dequantize(*quantized, shape)
    return k @ hadamard(k.shape[-1], k.dtype, k.device).T if s.rotate_keys else k


def dequantize_values(quantized: tuple, shape, s: KVScheme) -> torch.Tensor:
    """``quantize_values``' inverse: back from the Hadamard basis with ``rotate_values``."""
    v = dequantize(*quantized, shape)
    return v @ hadamard(v.shape[-1], v.dtype, v.device).T if s.rotate_values else v


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """The rotary embedding (the half-split layout of Llama, Mistral, Qwen and Gemma), or its inverse."""
    if cos.shape[-1] != x.shape[-1]:
        raise ValueError(f"the rotary angles cover {cos.shape[-1]} of {x.shape[-1]} channels (no partial rotary here)")
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), -1)
    return x * cos - rotated * sin if inverse else x * cos + rotated * sin


def round_trip(
    k: torch.Tensor, v: torch.Tensor, s: KVScheme, rotary: tuple[torch.Tensor, torch.Tensor] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values as a decoder reads them back. ``rotary``: the (cos, sin) of the keys'
    positions, broadcastable to ``k``; needed with ``pre_rope``."""
    if s.pre_rope:
        if rotary is None:
            raise ValueError("pre_rope: the keys' rotary angles are needed")
        before = rotate(k, *rotary, inverse=True)
        keys = rotate(dequantize_keys(quantize_keys(before, s), k.shape, s), *rotary)
    else:
        keys = dequantize_keys(quantize_keys(k, s), k.shape, s)
    return keys, dequantize_values(quantize_values(v, s), v.shape, s)


class KIVILayer(DynamicLayer):
    """One layer's cache: full-precision sinks (the first tokens), quantized chunks (codes, scales,
    minima) and a full-precision window (``self.keys`` / ``self.values``, as in ``DynamicLayer``).
    ``rotary(start, count, like)``: the (cos, sin) of positions ``start .. start + count`` for
    this layer's keys (``pre_rope``; positions count from the first cached token)."""

    def __init__(self, scheme: KVScheme, rotary=None):
        super().__init__()
        if scheme.pre_rope and rotary is None:
            raise ValueError("pre_rope: the cache needs the model's rotary embedding (kv_quant.new_cache)")
        self.scheme, self.rotary = scheme, rotary
        self.chunks: list[tuple[tuple, tuple, torch.Size, int]] = []  # key codes, value codes, shape, start
        self.quantized_tokens = 0
        self.sink_keys = self.sink_values = None

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
            self.sink_keys, self.sink_values = key_states[..., :0, :], value_states[..., :0, :]
        self.keys = torch.cat([self.keys, key_states], dim=-2)
        self.values = torch.cat([self.values, value_states], dim=-2)
        keys, values = self._dequantized()
        keys = torch.cat([self.sink_keys, keys, self.keys], dim=-2)
        values = torch.cat([self.sink_values, values, self.values], dim=-2)
        self._flush()  # after attention has read this step's own keys: as quantized_upto() says
        return keys, values

    def _flush(self) -> None:
        s = self.scheme
        if (missing := s.sinks - self.sink_keys.shape[-2]) > 0:  # the first tokens become the sinks
            take = min(missing, self.keys.shape[-2])
            self.sink_keys = torch.cat([self.sink_keys, self.keys[..., :take, :]], dim=-2)
            self.sink_values = torch.cat([self.sink_values, self.values[..., :take, :]], dim=-2)
            self.keys, self.values = self.keys[..., take:, :], self.values[..., take:, :]
        n = self.keys.shape[-2] if s.residual == 0 else s.residual * (self.keys.shape[-2] // s.residual)
        if n == 0:
            return
        k, v = self.keys[..., :n, :], self.values[..., :n, :]
        start = self.sink_keys.shape[-2] + self.quantized_tokens
        if s.pre_rope:
            k = rotate(k, *self.rotary(start, n, k), inverse=True)
        self.chunks.append((quantize_keys(k, s), quantize_values(v, s), k.shape, start))
        self.keys, self.values = self.keys[..., n:, :], self.values[..., n:, :]
        self.quantized_tokens += n

    def _dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        empty = self.keys[..., :0, :]
        if not self.chunks:
            return empty, self.values[..., :0, :]
        keys = [dequantize_keys(qk, shape, self.scheme) for qk, _, shape, _ in self.chunks]
        if self.scheme.pre_rope:
            keys = [rotate(k, *self.rotary(start, k.shape[-2], k)) for k, (*_, start) in zip(keys, self.chunks)]
        values = [dequantize_values(qv, shape, self.scheme) for _, qv, shape, _ in self.chunks]
        return torch.cat(keys, dim=-2), torch.cat(values, dim=-2)

    def get_seq_length(self) -> int:
        if not self.is_initialized:
            return 0
        return self.sink_keys.shape[-2] + self.quantized_tokens + self.keys.shape[-2]

    def crop(self, tokens_to_remove: int) -> None:
        """Remove tokens from the end; only the full-precision window can be rolled back."""
        n = abs(tokens_to_remove)
        if n and self.is_initialized:
            if n > self.keys.shape[-2]:
                raise ValueError(
                    f"cannot roll back {n} tokens: only the {self.keys.shape[-2]} in the "
                    "full-precision window can be; use a larger residual"
                )
            self.keys, self.values = self.keys[..., :-n, :], self.values[..., :-n, :]


class KIVICache(Cache):
    """``model.generate(..., past_key_values=KIVICache(scheme, model.config.num_hidden_layers))``;
    ``rotary(layer)``: that layer's ``KIVILayer`` rotary (``pre_rope``; ``new_cache`` builds it)."""

    def __init__(self, scheme: KVScheme, num_layers: int, rotary=None):
        super().__init__(layers=[KIVILayer(scheme, rotary and rotary(i)) for i in range(num_layers)])


def _simulated_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """Eager attention in which each query reads earlier keys and values quantized as a KIVI
    decoder would hold them at that step (see the module docstring)."""
    from transformers.integrations.sdpa_attention import repeat_kv

    s = KVScheme.of(module)
    n, q_len = key.shape[-2], query.shape[-2]
    a, b = min(s.sinks, n), s.quantized_upto(n)  # the chunks a decoder ends up holding quantized
    kq, vq = key.clone(), value.clone()
    if b > a:
        rotary = None
        if s.pre_rope:  # the angles of this call's tokens (``simulating``), which are all the keys
            if q_len != n:
                raise ValueError("pre_rope is simulated over whole windows only")
            rotary = tuple(t[:, None, a:b].to(key.dtype) for t in module.kv_rotary)
        kq[..., a:b, :], vq[..., a:b, :] = round_trip(key[..., a:b, :], value[..., a:b, :], s, rotary)
    after = (torch.arange(n - q_len, n, device=query.device) - s.sinks).clamp(min=0)  # query i attends at step i
    bound = s.sinks + (after if s.residual == 0 else s.residual * torch.div(after, s.residual, rounding_mode="floor"))
    position = torch.arange(n, device=query.device)[None, :]
    quantized = (position >= s.sinks) & (position < bound[:, None])  # (queries, keys)
    groups = module.num_key_value_groups
    full = torch.matmul(query, repeat_kv(key, groups).transpose(2, 3))
    approx = torch.matmul(query, repeat_kv(kq, groups).transpose(2, 3))
    scores = torch.where(quantized, approx, full) * scaling
    if attention_mask is not None:
        scores = scores + attention_mask[..., :n]
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    out = torch.matmul(probs * quantized, repeat_kv(vq, groups)) + torch.matmul(
        probs * ~quantized, repeat_kv(value, groups)
    )
    return out.transpose(1, 2).contiguous(), None


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register(ATTENTION, _simulated_attention)
    AttentionMaskInterface.register(ATTENTION, eager_mask)


def is_attention(module: torch.nn.Module) -> bool:
    return hasattr(module, "num_key_value_groups")  # every transformers attention that has a KV cache


def attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if is_attention(m)]


def scheme_of(model: torch.nn.Module) -> KVScheme | None:
    schemes = {KVScheme.of(m) for m in attention_modules(model)} - {None}
    if len(schemes) > 1:
        raise ValueError("different KV-cache schemes per layer are not supported")
    return schemes.pop() if schemes else None


def install(model: torch.nn.Module, scheme: KVScheme | dict) -> None:
    """Mark every attention module of ``model`` with the scheme (after load, from the config)."""
    scheme = scheme if isinstance(scheme, KVScheme) else KVScheme(**scheme)
    for m in attention_modules(model):
        scheme.attach(m)


def config_entry(scheme: KVScheme) -> dict:
    return {"method": "kivi", **asdict(scheme)}


@contextlib.contextmanager
def simulating(model: torch.nn.Module):
    """Run full-window forwards as a KIVI decoder would see them (no-op without a scheme)."""
    if scheme_of(model) is None:
        yield model
        return
    _register()
    before = model.config._attn_implementation
    model.set_attn_implementation(ATTENTION)
    hooks = []
    if scheme_of(model).pre_rope:  # the attention function is not handed the rotary angles: keep them

        def keep_angles(module, args, kwargs):
            module.kv_rotary = kwargs["position_embeddings"]

        hooks = [m.register_forward_pre_hook(keep_angles, with_kwargs=True) for m in attention_modules(model)]
    try:
        yield model
    finally:
        model.set_attn_implementation(before)
        for hook in hooks:
            hook.remove()
        for m in attention_modules(model) if hooks else []:
            m.__dict__.pop("kv_rotary", None)


def cache_dims(config) -> tuple[int, int, int]:
    """(layers, KV heads, head dimension) of a model config."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return config.num_hidden_layers, config.num_key_value_heads, head_dim


def bytes_per_token(model: torch.nn.Module) -> float | None:
    """KV-cache bytes per token of ``model``'s scheme (None without one), 16-bit scales."""
    scheme = scheme_of(model)
    return None if scheme is None else scheme.bytes_per_token(*cache_dims(model.config))


def new_cache(model: torch.nn.Module) -> Cache | None:
    """The cache ``generate`` should use for ``model``: a KIVICache when it carries a scheme."""
    scheme = scheme_of(model)
    if scheme is None:
        return None
    return KIVICache(scheme, model.config.num_hidden_layers, _rotary_of(model) if scheme.pre_rope else None)


def _rotary_of(model: torch.nn.Module):
    """Per layer, (start, count, like) -> the (cos, sin) its keys were rotated by, from the model's
    own rotary module (Gemma-3's takes the layer's type: local and global layers differ)."""
    rotary = model.get_decoder().rotary_emb
    types = getattr(model.config, "layer_types", None)
    per_type = "layer_type" in inspect.signature(rotary.forward).parameters

    def of_layer(layer: int):
        def angles(start: int, count: int, like: torch.Tensor):
            positions = torch.arange(start, start + count, device=like.device)[None]
            cos, sin = rotary(like, positions, *([types[layer]] if per_type else []))
            return cos[:, None].to(like.dtype), sin[:, None].to(like.dtype)

        return angles

    return of_layer
