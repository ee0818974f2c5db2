"""The engine's attention of new tokens over the KV cache, and the masks it reads.

A verify step (up to ``kernels.VERIFY_ROWS`` tokens) attends row by row, each over exactly its own
prefix, as a one-token step does: SDPA over a longer masked span rounds differently (in bf16,
enough to flip a near-tie), and lossless speculation must give the tokens plain greedy gives.
Longer inputs (prompts) are one call. A fixed-shape step (compiled, or a CUDA graph) is one masked
call over the whole span (its exactness comes from padding every step to the same rows: ``steps``).
On a CPU with an fp32 cache (or a bf16 one read by an fp32 stream: ``int4-a8``), steps run
``native``'s attention, row by row by design.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import kernels


@dataclass
class Attention:
    heads: int
    kv_heads: int
    scaling: float
    softcap: float | None  # ``attn_logit_softcapping``: soft-capped scores, which SDPA cannot do (spelled out)
    native: bool  # ``native``'s one-row attention (CPU)

    @staticmethod
    def masks(positions: torch.Tensor, span: int, windows: set, static: bool = False) -> dict:
        """Per window size, which of the ``span`` cache slots each new token sees (None: all)."""
        slots = torch.arange(span, device=positions.device)
        causal = slots[None, :] <= positions[:, None]
        masks = {None: None if positions.numel() == 1 and not static else causal}
        for window in windows - {None}:
            masks[window] = causal & (positions[:, None] - slots[None, :] < window)
        return masks

    def __call__(self, q, k, v, mask, window, positions, static=False):
        """Attention of the new tokens ``q`` (heads, tokens, dim) over keys and values ``k``, ``v``."""
        if self.native and q.shape[1] <= kernels.VERIFY_ROWS:
            out = torch.ops.compress.decode_attention(q.float(), k, v, positions, window or 0, self.scaling)
            return out.to(q.dtype)
        if mask is None or q.shape[1] == 1 or q.shape[1] > kernels.VERIFY_ROWS or static:
            return self._sdpa(q, k, v, mask)
        rows = []
        for i, end in enumerate((positions + 1).tolist()):
            rows.append(
                self._sdpa(q[:, i : i + 1], k[:, :end], v[:, :end], None if window is None else mask[i : i + 1, :end])
            )
        return torch.cat(rows, 1)

    def tree(self, q, k, v, seen: list[torch.Tensor]) -> torch.Tensor:
        """Each token over exactly the cache slots ``seen[i]`` marks, gathered in order (lookahead)."""
        rows = []
        for i, slots in enumerate(seen):
            last = torch.tensor([len(slots) - 1], device=q.device)
            rows.append(self(q[:, i : i + 1], k[:, slots], v[:, slots], None, None, last))
        return torch.cat(rows, 1)

    def _sdpa(self, q, k, v, mask):
        dtype, q = q.dtype, q.to(k.dtype)  # the cache's dtype (``cache_dtype``)
        if self.softcap is None:
            return F.scaled_dot_product_attention(
                q[None], k[None], v[None], attn_mask=mask, scale=self.scaling, enable_gqa=True
            )[0].to(dtype)
        groups = self.heads // self.kv_heads
        k, v = k.repeat_interleave(groups, 0), v.repeat_interleave(groups, 0)
        scores = torch.tanh(q @ k.transpose(1, 2) * self.scaling / self.softcap) * self.softcap
        if mask is not None:
            scores = scores.masked_fill(~mask, -math.inf)
        return (torch.softmax(scores.float(), -1).to(q.dtype) @ v).to(dtype)
