"""SmoothQuant W8A8: exact smoothing, int8 activations as compressed-tensors runs them, export."""

import pytest
import torch

from compress import models
from compress.passes import RecipeError
from compress.passes.smoothquant import SmoothQuant
from compress.pipeline import run_sequential
from compress.quant import ActivationScheme, fake_quantize_activation, input_quant_of
from compress.recipe import parse
from tests.conftest import compress_with, export_and_reload, tiny

IDS = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(0))


def _logits(model, ids=IDS):
    with torch.no_grad():
        return model(ids).logits


def _without_activation_quant(model):
    for m in model.modules():
        if input_quant_of(m) is not None:
            m._forward_pre_hooks.clear()
            m.input_quant = None
    return model


def _with_outlier_channels(model):
    """Real LLMs have a few input channels with huge activations; random tiny models do not."""
    for name, p in model.named_parameters():
        if "layernorm.weight" in name or "feedforward_layernorm.weight" in name:
            p.data[:4] *= 30
    return model


@pytest.mark.parametrize("model_type", ["llama", "gemma3_text"])
def test_smoothing_leaves_the_float_model_unchanged(model_type):
    """Folding s into the norms (Gemma: into 1 + w) and up_proj is exact up to float32 rounding:
    logits agree within 1e-4 absolute (they are of order 1)."""
    dense, smoothed = tiny(model_type), tiny(model_type)
    sq = SmoothQuant(SmoothQuant.Options(alpha=0.5), "passes[0].smoothquant")  # alone: weights stay unrounded
    sq.check(smoothed)
    run_sequential(smoothed, IDS, [sq], torch.device("cpu"))
    up = smoothed.model.layers[0].mlp.up_proj.weight
    assert not torch.equal(up, dense.model.layers[0].mlp.up_proj.weight)  # it did scale
    torch.testing.assert_close(_logits(_without_activation_quant(smoothed)), _logits(dense), atol=1e-4, rtol=0)


def test_activation_fake_quant_matches_the_int8_grid():
    x = torch.randn(5, 64) * torch.linspace(0.1, 10, 64)
    per_token = fake_quantize_activation(x, ActivationScheme(8, per_token=True))
    step = x.abs().amax(-1, keepdim=True) / 127.5
    assert ((per_token - x).abs() <= step * 0.501).all()  # half a step; +max|x| clamps to 127: exactly half
    assert torch.allclose(per_token / step, torch.round(per_token / step), atol=1e-4)
    per_tensor = fake_quantize_activation(x, ActivationScheme(8, per_token=False))
    assert (per_tensor - x).abs().mean() > (per_token - x).abs().mean()  # a shared scale is coarser


def test_smoothing_beats_no_smoothing_with_outlier_channels():
    dense = _with_outlier_channels(tiny("llama"))
    errors = {}
    for name, passes in {
        "naive per-tensor": "  - smoothquant: {smooth: false, activations: tensor}\n",
        "per-token": "  - smoothquant: {smooth: false}\n",
        "smoothed": "  - smoothquant: {alpha: 0.5}\n",
    }.items():
        model = _with_outlier_channels(tiny("llama"))
        compress_with(model, passes + "  - rtn: {bits: 8, group_size: -1}\n", IDS)
        errors[name] = (_logits(model) - _logits(dense)).pow(2).mean().item()
    assert errors["smoothed"] < errors["per-token"] < errors["naive per-tensor"], errors


def test_w8a8_export_reloads_in_transformers_with_the_same_logits(tmp_path):
    model = tiny("llama")
    recipe = compress_with(model, "  - smoothquant: {alpha: 0.5}\n  - gptq: {bits: 8, group_size: -1}\n", IDS)
    reloaded = export_and_reload(model, recipe, tmp_path / "x")
    config = reloaded.config.to_dict()["quantization_config"]
    assert config["format"] == "int-quantized"
    activations = next(iter(config["config_groups"].values()))
    assert activations["input_activations"]["strategy"] == "token" and activations["input_activations"]["dynamic"]
    assert torch.equal(_logits(reloaded), _logits(model))  # compressed-tensors quantizes the inputs as we do
    ours = models.load_model(tmp_path / "x", torch.float32)  # our loader: usable before any whole-model forward
    assert all(p.is_floating_point() for p in ours.parameters())
    with torch.no_grad():
        body = ours.model(IDS[:1]).last_hidden_state  # as evaluation calls it: body, then head
        torch.testing.assert_close(ours.lm_head(body), _logits(model, IDS[:1]))


def test_smoothquant_needs_8bit_weights_after_it():
    with pytest.raises(RecipeError, match=r"passes\[0\].smoothquant: int8 activations need int8 weights"):
        parse("passes:\n  - smoothquant: {}\n  - rtn: {bits: 4}\n")
