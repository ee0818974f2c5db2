"""The int4 CPU kernel computes what our dequantized W4 weights compute, from an export too."""

import pytest
import torch

from compress import kernels, models
from compress.decode import greedy
from compress.export import export
from tests.conftest import _NoTokenizer, compress_with, tiny

pytestmark = pytest.mark.skipif(not kernels.int4_kernel_available(), reason="this torch has no int4 CPU kernel")


@pytest.mark.parametrize("symmetric", [True, False])
def test_int4_kernel_on_an_export_matches_the_dequantized_model(symmetric, tmp_path):
    model = tiny("llama")
    recipe = compress_with(model, f"  - rtn: {{bits: 4, group_size: 32, symmetric: {str(symmetric).lower()}}}\n")
    out = export(model, _NoTokenizer(), tmp_path / "x", recipe.text, {})
    reloaded = models.for_compute(models.load_model(out, torch.float32), torch.device("cpu"))
    assert kernels.attach_from_export(reloaded, out) == 14  # 2 blocks × 7 linears
    ids = torch.randint(0, 128, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        dense = reloaded(ids).logits
    assert kernels.use_int4_kernel(reloaded) == 14
    assert isinstance(reloaded.model.layers[0].mlp.down_proj, kernels.Int4Linear)
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, dense, atol=2e-5, rtol=0)
    assert greedy(reloaded, ids, 12).tokens == greedy(model, ids, 12).tokens


def test_unsupported_layers_stay_dense():
    model = tiny("llama", hidden=96)
    compress_with(model, "  - rtn: {bits: 4, group_size: -1}\n")  # one group of 96 or 192: not a kernel size
    assert kernels.use_int4_kernel(model) == 0
    compress_with(model := tiny("llama"), "  - rtn: {bits: 8, group_size: 32}\n")
    assert kernels.use_int4_kernel(model) == 0
