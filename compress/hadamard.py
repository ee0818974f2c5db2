"""Hadamard matrices of the widths models have, and their fast transform.

A rotation by an orthonormal Hadamard matrix spreads a few outlier channels over all of them and
leaves inner products unchanged (QuaRot, QuIP#): what the KV cache's ``rotate_values`` and weight
rotations use. Widths are rarely powers of two (SmolLM2's 576 = 36 × 16, Gemma-3's 640 = 20 × 32),
so ``matrix(n)`` is ``H_m ⊗ H_{2^k}``: Sylvester's construction for the power of two, Paley's for
``m`` (I: ``m - 1`` a prime ≡ 3 mod 4; II: ``m / 2 - 1`` a prime ≡ 1 mod 4), as QuaRot's
hard-coded bases are. ``transform(x)`` applies it in ``O(n log n + n m)`` without the ``n × n``
matrix: a fast Walsh–Hadamard transform over the power of two, a small product over ``m``.

An online rotation (one applied to activations at run time, which a server must reproduce) uses
``block_matrix(n)`` instead: Sylvester's matrix on each block of ``block_size(n)`` channels, the
largest power of two dividing ``n``; compressed-tensors' ``hadamard`` transform with that
``head_dim`` is the same matrix, so vLLM applies what we evaluated.
"""

from __future__ import annotations

import functools
import math
from typing import ClassVar

import torch

from .state import State


def _is_prime(p: int) -> bool:
    return p >= 2 and all(p % d for d in range(2, math.isqrt(p) + 1))


def _jacobsthal(q: int) -> torch.Tensor:
    """``Q[i, j] = χ(j - i)``, χ the quadratic character of the field of ``q`` elements (``q`` prime)."""
    squares = {(x * x) % q for x in range(1, q)}
    chi = torch.tensor([0] + [1 if a in squares else -1 for a in range(1, q)], dtype=torch.float64)
    idx = torch.arange(q)
    return chi[(idx[None, :] - idx[:, None]) % q]


def _paley(m: int) -> torch.Tensor | None:
    """An (unnormalized, ±1) Hadamard matrix of order ``m`` by Paley's constructions, or None."""
    q = m - 1
    if _is_prime(q) and q % 4 == 3:  # Paley I: I + [[0, 1ᵀ], [-1, Q]]
        s = torch.zeros(m, m, dtype=torch.float64)
        s[0, 1:], s[1:, 0], s[1:, 1:] = 1, -1, _jacobsthal(q)
        return s + torch.eye(m, dtype=torch.float64)
    q = m // 2 - 1
    if m % 2 == 0 and _is_prime(q) and q % 4 == 1:  # Paley II: [[0, 1ᵀ], [1, Q]] with 2 × 2 blocks for entries
        c = torch.zeros(q + 1, q + 1, dtype=torch.float64)
        c[0, 1:], c[1:, 0], c[1:, 1:] = 1, 1, _jacobsthal(q)
        one = torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64)
        zero = torch.tensor([[1.0, -1.0], [-1.0, -1.0]], dtype=torch.float64)
        return torch.kron(c, one) + torch.kron((c == 0).double(), zero)
    return None


@functools.cache
def _factors(n: int) -> tuple[int, int]:
    """``(m, p)``: ``n = m · p`` with ``p`` a power of two and a Hadamard matrix of order ``m`` known
    (``m = 1``: ``n`` itself a power of two); ValueError naming ``n`` otherwise."""
    if n < 1:
        raise ValueError(f"a Hadamard matrix needs a positive width; got {n}")
    twos = (n & -n).bit_length() - 1
    odd = n >> twos
    if odd == 1:
        return 1, n
    for j in range(twos + 1):
        if _paley(odd << j) is not None:
            return odd << j, n // (odd << j)
    raise ValueError(
        f"no Hadamard construction known for width {n} (= {odd} × 2^{twos}): it needs {odd} × 2^j for some j ≤ "
        f"{twos} to be p + 1 with p a prime ≡ 3 mod 4, or 2(p + 1) with p a prime ≡ 1 mod 4"
    )


def supported(n: int) -> bool:
    try:
        _factors(n)
    except ValueError:
        return False
    return True


@functools.cache
def _base(m: int) -> torch.Tensor:
    return torch.ones(1, 1, dtype=torch.float64) if m == 1 else _paley(m)


def matrix(n: int, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> torch.Tensor:
    """The orthonormal ``n × n`` Hadamard matrix ``(H_m ⊗ H_p) / √n`` (module docstring)."""
    m, p = _factors(n)
    h = _base(m)
    sylvester = torch.ones(1, 1, dtype=torch.float64)
    while sylvester.shape[0] < p:
        sylvester = torch.cat([torch.cat([sylvester, sylvester], 1), torch.cat([sylvester, -sylvester], 1)], 0)
    return (torch.kron(h, sylvester) / math.sqrt(n)).to(device=device, dtype=dtype)


def block_size(n: int) -> int:
    """The largest power of two dividing ``n``: the block of ``block_matrix(n)``."""
    return n & -n


def block_matrix(n: int, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> torch.Tensor:
    """``I_{n/p} ⊗ H_p / √p``, ``p = block_size(n)``: an orthonormal Hadamard rotation of each block."""
    p = block_size(n)
    return torch.kron(torch.eye(n // p, dtype=torch.float64), matrix(p, torch.float64)).to(device=device, dtype=dtype)


def block_transform(x: torch.Tensor) -> torch.Tensor:
    """``x @ block_matrix(n)`` over the last dimension, by a fast Walsh–Hadamard transform per block."""
    p = block_size(x.shape[-1])
    return transform(x.unflatten(-1, (-1, p))).flatten(-2)


def random_signs(n: int, seed: int) -> torch.Tensor:
    """``n`` seeded random ±1 (float32): ``diag(signs) @ matrix(n)`` is a random Hadamard rotation."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 2, (n,), generator=g).float() * 2 - 1


def transform(x: torch.Tensor) -> torch.Tensor:
    """``x @ matrix(n)`` over the last dimension, without the matrix: a fast Walsh–Hadamard
    transform over the power of two, the small Paley factor as a product; in ``x``'s dtype."""
    n = x.shape[-1]
    m, p = _factors(n)
    lead = x.shape[:-1]
    y = x.reshape(*lead, m, p)
    h = 1
    while h < p:  # butterflies at distance h: y @ H_p (Sylvester's order)
        y = y.reshape(*lead, m, p // (2 * h), 2, h)
        a, b = y[..., 0, :], y[..., 1, :]
        y = torch.stack((a + b, a - b), dim=-2)
        h *= 2
    y = y.reshape(*lead, m, p)
    if m > 1:  # (H_m ⊗ H_p) on a row laid out (m, p): H_mᵀ Y H_p
        y = torch.einsum("ij,...ik->...jk", _base(m).to(device=y.device, dtype=y.dtype), y)
    return (y / math.sqrt(n)).reshape(x.shape)


class InputRotation(State, attr="input_rotation"):
    """A linear that reads its input rotated at run time by ``block_matrix`` (QuaRot's online
    Hadamard before ``down_proj``): its weight holds ``W @ block_matrix(n)``, so it computes what it
    did, while the input that an activation scheme rounds next has no outlying channel. The rotation
    runs before any other pre-hook (rounding, observing); an export names it as compressed-tensors'
    ``hadamard`` transform, which vLLM applies."""

    holds_tensors: ClassVar[bool] = False  # a hook, not tensors: it stays as long as the module

    def attach(self, module: torch.nn.Module) -> None:
        if InputRotation.of(module) is None:
            module.register_forward_pre_hook(_rotate_input, prepend=True)
        super().attach(module)

    def saved(self):
        return {}, {}

    @classmethod
    def restored(cls, tensors, meta):
        return cls()


def _rotate_input(module: torch.nn.Module, args: tuple):
    if InputRotation.of(module) is None:  # dropped
        return None
    x = args[0]
    return (block_transform(x.float()).to(x.dtype), *args[1:])  # float32, as compressed-tensors rotates
