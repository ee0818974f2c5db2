"""The int4 CPU kernel computes what our dequantized W4 weights compute, from an export too."""

import pytest
import torch

from compress import models
from compress.decode import kernels
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


def test_int8_kernel_matches_fake_quantized_w8a8_in_process_and_from_the_export(tmp_path):
    model = tiny("llama")
    ids = torch.randint(0, 128, (1, 24), generator=torch.Generator().manual_seed(0))
    calibration = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(1))
    recipe = compress_with(model, "  - smoothquant: {alpha: 0.5}\n  - rtn: {bits: 8, group_size: -1}\n", calibration)
    with torch.no_grad():
        fake = model(ids).logits
    out = export(model, _NoTokenizer(), tmp_path / "x", recipe.text, {})
    assert kernels.use_int8_kernel(model) == 14
    assert isinstance(model.model.layers[1].self_attn.q_proj, kernels.Int8Linear)
    reloaded = models.for_compute(models.load_model(out, torch.float32), torch.device("cpu"))
    assert kernels.use_int8_kernel(reloaded) == 14
    with torch.no_grad():  # int32 sums are exact, fp32 ones are not: a later activation on a rounding
        # boundary can land on the neighbouring integer, hence 5e-3 rather than float epsilon (how
        # many land there depends on the CPU's kernel: 1.9e-3 on an AVX-512 VNNI EPYC)
        torch.testing.assert_close(model(ids).logits, fake, atol=5e-3, rtol=0)
        torch.testing.assert_close(reloaded(ids).logits, fake, atol=5e-3, rtol=0)
    assert greedy(reloaded, ids, 12).tokens == greedy(model, ids, 12).tokens
    assert kernels.use_int8_kernel(tiny("llama")) == 0  # nothing quantized: nothing swapped


@pytest.mark.skipif(not kernels.onednn_available(), reason="this torch has no oneDNN")
def test_onednn_linears_compute_what_the_model_computes():
    model = tiny("llama")
    prompt = torch.randint(0, 128, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = model(prompt).logits
    plain = greedy(model, prompt, 12).tokens
    assert kernels.use_onednn(model) == 15  # 14 block linears and the lm_head
    assert model.lm_head.weight is None and model.model.layers[0].mlp.up_proj.weight is not None
    with torch.no_grad():  # multi-row (oneDNN) and single-row (MKL) paths both
        torch.testing.assert_close(model(prompt).logits, before, atol=1e-5, rtol=1e-5)
    assert greedy(model, prompt, 12).tokens == plain


def test_probe_times_a_kernel_against_the_current_linear():
    model = tiny("llama")
    assert kernels.probe(model, "int4") is None and kernels.probe(model, "int8") is None  # nothing quantized
    compress_with(model, "  - rtn: {bits: 4, group_size: 32}\n")
    kernel_ms, dense_ms = kernels.probe(model, "int4")
    assert kernel_ms > 0 and dense_ms > 0
