"""Hadamard matrices of the widths models have, and the fast transform that applies one."""

import pytest
import torch

from compress import hadamard

# powers of two; Paley I bases (12, 20, 44); Paley II bases (28, 36); the models' widths: SmolLM2's
# hidden 576 = 36 × 16 and FFN 1536 = 12 × 128, Gemma-3-270M's hidden 640 = 20 × 32
WIDTHS = [1, 2, 4, 64, 12, 20, 44, 28, 36, 576, 1536, 640, 2048]


@pytest.mark.parametrize("n", WIDTHS)
def test_the_matrix_is_orthonormal_with_entries_of_one_magnitude(n):
    h = hadamard.matrix(n, torch.float64)
    torch.testing.assert_close(h @ h.T, torch.eye(n, dtype=torch.float64), atol=1e-12, rtol=0)
    torch.testing.assert_close(h.abs(), torch.full((n, n), n**-0.5, dtype=torch.float64), atol=1e-15, rtol=0)


@pytest.mark.parametrize("n", WIDTHS)
def test_the_fast_transform_is_the_product_with_the_matrix(n):
    x = torch.randn(3, 5, n, dtype=torch.float64, generator=torch.Generator().manual_seed(n))
    torch.testing.assert_close(hadamard.transform(x), x @ hadamard.matrix(n, torch.float64), atol=1e-12, rtol=0)


def test_a_rotation_spreads_an_outlying_channel_and_keeps_inner_products():
    x = torch.randn(8, 576, generator=torch.Generator().manual_seed(0))
    x[:, 5] *= 100
    r = hadamard.matrix(576) * hadamard.random_signs(576, seed=1)[:, None]  # diag(signs) @ H
    y = x @ r
    assert y.abs().max() < 0.2 * x.abs().max()
    torch.testing.assert_close(y @ y.T, x @ x.T, rtol=1e-4, atol=1e-2)


@pytest.mark.parametrize("n", [6, 21, 30])
def test_a_width_with_no_known_construction_is_named(n):
    assert not hadamard.supported(n)
    with pytest.raises(ValueError, match=f"no Hadamard construction known for width {n} "):
        hadamard.matrix(n)


@pytest.mark.parametrize("n", [64, 576, 1536, 2048, 6])
def test_the_online_block_rotation_is_compressed_tensors_hadamard_transform(n):
    """``block_matrix`` is compressed-tensors' ``hadamard`` transform with ``head_dim`` the largest
    power of two dividing the width, so vLLM rotates inputs as we evaluated them; any even width
    has one (6 = 3 × 2, which has no full-width construction)."""
    from compressed_tensors.transform import TransformArgs, TransformFactory, TransformScheme

    p = hadamard.block_size(n)
    scheme = TransformScheme(type="hadamard", head_dim=p, apply=[TransformArgs(targets=["Linear"], location="input")])
    linear = torch.nn.Linear(n, 3)
    theirs = TransformFactory.from_scheme(scheme, name="r4").create_transform(linear, scheme.apply[0])
    x = torch.randn(5, n, dtype=torch.float64, generator=torch.Generator().manual_seed(n))
    ours = x @ hadamard.block_matrix(n, torch.float64)
    torch.testing.assert_close(theirs(x.float()).double(), ours, atol=1e-5, rtol=0)
    torch.testing.assert_close(hadamard.block_transform(x), ours, atol=1e-12, rtol=0)
    torch.testing.assert_close(ours @ ours.T, x @ x.T, atol=1e-9, rtol=0)
