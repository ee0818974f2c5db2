"""The engine's KV cache: preallocated slots per layer, the rotary tables for every slot, and what
is filled. A KIVI scheme (the ``kv_cache`` pass) makes it flush its window as ``kv_quant.KIVICache``
does: once the full-precision window holds ``residual`` tokens, they are quantized and replaced by
their dequantized values, so attention reads what KIVI decoding reads at dense speed (KIVI's tokens,
not its memory saving)."""

from __future__ import annotations

import torch

from .. import kv_quant
from .loop import DecodeError


class KVCache:
    """Keys and values of ``layers`` layers (``rotary``: each layer's table kind), ``max_len`` slots
    (grown on demand, up to ``context``), and the rotary tables of those positions in ``dtype``."""

    def __init__(
        self,
        rotary_kinds: list[str],
        rotary_module,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        cache_dtype: torch.dtype,
        device: torch.device,
        context: int,
        max_len: int,
        scheme: kv_quant.KVScheme | None = None,
    ):
        self.rotary_kinds, self.rotary_module = rotary_kinds, rotary_module
        self.kv_heads, self.head_dim, self.dtype, self.cache_dtype = kv_heads, head_dim, dtype, cache_dtype
        self.device, self.context, self.scheme = device, context, scheme
        self.max_len, self.length, self.quantized_upto, self.k, self.v = 0, 0, 0, [], []
        self.allocate(max_len)

    def empty(self, rotary_kinds: list[str]) -> KVCache:
        """A cache of its own for ``rotary_kinds`` layers, same sizes, full precision (a draft's)."""
        return KVCache(
            rotary_kinds,
            self.rotary_module,
            self.kv_heads,
            self.head_dim,
            self.dtype,
            self.cache_dtype,
            self.device,
            self.context,
            self.max_len,
        )

    def allocate(self, max_len: int) -> None:
        """Slots and rotary tables for ``max_len`` positions (kept entries are copied over)."""
        max_len = min(max_len, self.context)
        shape = (1, self.kv_heads, max_len, self.head_dim)
        old = self.k + self.v if self.length else []
        self.k = [torch.zeros(shape, dtype=self.cache_dtype, device=self.device) for _ in self.rotary_kinds]
        self.v = [torch.zeros(shape, dtype=self.cache_dtype, device=self.device) for _ in self.rotary_kinds]
        for new, kept in zip(self.k + self.v, old):
            new[:, :, : self.length] = kept[:, :, : self.length]
        positions = torch.arange(max_len, device=self.device)[None]
        probe = torch.zeros((), dtype=self.dtype, device=self.device)
        self.rotary = {}
        for kind in set(self.rotary_kinds):
            args = () if kind == "default" else (kind,)
            cos, sin = self.rotary_module(probe, positions, *args)
            self.rotary[kind] = (cos[0].to(self.dtype), sin[0].to(self.dtype))
        self.max_len = max_len

    def reset(self) -> None:
        self.length = self.quantized_upto = 0

    def crop(self, n: int) -> None:
        """Forget the last ``n`` cached tokens (their slots are overwritten by the next forward)."""
        if self.length - n < self.quantized_upto:
            raise DecodeError(f"cannot roll back {n} tokens past the KIVI-quantized part of the cache")
        self.length -= n

    def keep(self, length: int, extra: list[int]) -> None:
        """Keep the first ``length`` cached tokens and the entries at slots ``extra``, moved in order
        to follow them: lookahead keeps its accepted branch this way (its tree step rotated
        their keys at the positions they keep)."""
        if length < self.quantized_upto:
            raise DecodeError(f"cannot roll back to {length} tokens past the KIVI-quantized part of the cache")
        if extra:
            index = torch.tensor(extra, device=self.device)
            for cache in self.k + self.v:
                cache[:, :, length : length + len(extra)] = cache[:, :, index]  # the gather copies first
        self.length = length + len(extra)

    def make_room(self, count: int) -> int:
        """The slot of the first of ``count`` tokens about to be appended: KIVI's window flushed, the
        context checked, the cache grown where it is too short."""
        if self.scheme is not None:
            self._flush()  # lazily, so a rolled-back candidate is never quantized
        start = self.length
        if start + count > self.context:
            raise DecodeError(
                f"{start + count} tokens do not fit: the model's context is {self.context} tokens; "
                "shorten the prompt or ask for fewer new tokens"
            )
        self.grow(start + count)
        return start

    def grow(self, slots: int, spare: int = 0) -> None:
        """At least ``slots`` slots: doubled (or ``slots + spare``) when too short."""
        if slots > self.max_len:
            self.allocate(max(2 * self.max_len, slots + spare))

    def _flush(self) -> None:
        """KIVI: quantize the window's oldest whole multiple of ``residual`` tokens (all of it
        without a window) and keep their dequantized values, as ``KIVICache`` does after each step;
        the first ``sinks`` tokens stay as they are."""
        s = self.scheme
        start = max(self.quantized_upto, min(s.sinks, self.length))
        n = s.quantized_upto(self.length) - start
        if n <= 0:
            return
        done = slice(start, start + n)
        for kind, k_cache, v_cache in zip(self.rotary_kinds, self.k, self.v):
            cos, sin = self.rotary[kind]
            # in the stream's dtype, as ``KIVICache`` quantizes (the cache may be wider: values stay exact)
            k_cache[:, :, done], v_cache[:, :, done] = kv_quant.round_trip(
                k_cache[:, :, done].to(self.dtype), v_cache[:, :, done].to(self.dtype), s, (cos[done], sin[done])
            )
        self.quantized_upto = start + n
