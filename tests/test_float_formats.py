"""Float grids (FP8, NVFP4, MXFP4): values and scales on the grids the formats store, GPTQ's sweep on
them, and exports in compressed-tensors' float layouts that reload to our weights bit for bit."""

import json

import pytest
import torch

from compress.column_sweep import obs_sweep
from compress.passes import RecipeError
from compress.quant import FP4_VALUES, QuantScheme, quantize_weight, quantized_of
from compress.recipe import parse
from tests.conftest import compress_with, export_and_reload, reloads_to_our_logits, tiny

SCHEMES = {
    "fp8": QuantScheme(8, -1, True, format="fp8"),
    "nvfp4": QuantScheme(4, 16, True, format="nvfp4"),
    "mxfp4": QuantScheme(4, 32, True, format="mxfp4"),
    "fp8_block": QuantScheme(8, 128, True, format="fp8_block"),
}


def _weight(rows=128, cols=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, cols, generator=g) * torch.rand(rows, 1, generator=g) * 0.05


def _bf16(model):
    """Parameters in bfloat16, as a bf16 checkpoint holds them (compressed-tensors decompresses FP4
    weights to bfloat16); the rotary table stays float32."""
    for p in model.parameters():
        p.data = p.data.to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    return model


@pytest.mark.parametrize("fmt", SCHEMES)
def test_values_and_scales_lie_on_the_grids_the_format_stores(fmt):
    qw = quantize_weight(_weight(), SCHEMES[fmt], torch.bfloat16)
    q = qw.q.float()
    if fmt.startswith("fp8"):
        assert qw.q.dtype == torch.float8_e4m3fn and qw.scale.dtype == torch.bfloat16
    else:
        assert set(q.abs().unique().tolist()) <= set(FP4_VALUES.tolist())
    if fmt == "nvfp4":  # an FP8 number over the float32 global scale
        fp8 = qw.scale * qw.global_scale
        assert torch.equal(fp8.to(torch.float8_e4m3fn).float(), fp8) and qw.global_scale.dtype == torch.float32
    if fmt == "mxfp4":  # a power of two, and no weight beyond the grid's largest value
        assert torch.equal(torch.exp2(torch.log2(qw.scale).round()), qw.scale)
    w = qw.dequantized().float()
    error = (w - _weight()).pow(2).mean() / _weight().pow(2).mean()
    assert error < (0.001 if fmt.startswith("fp8") else 0.02)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "fp8_block"])
def test_gptq_on_a_float_grid_beats_rounding_to_nearest_on_correlated_inputs(fmt):
    """The sweep rounds onto the same grid (its scales rounded as stored before it starts) and its
    output error is lower than round-to-nearest's, as GPTQ's is at INT4."""
    w = _weight(rows=256)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(512, 16, generator=g) @ torch.randn(16, 128, generator=g) + 0.1 * torch.randn(512, 128, generator=g)
    H = 2 * x.T @ x / len(x)
    result = obs_sweep(w, H, "test", scheme=SCHEMES[fmt], dtype=torch.bfloat16, actorder=True)
    qw = result.quantized
    assert torch.equal(qw.dequantized().to(torch.bfloat16), result.weight.to(torch.bfloat16))
    rtn = quantize_weight(w, SCHEMES[fmt], torch.bfloat16).dequantized().float()
    assert ((qw.dequantized().float() - w) @ x.T).pow(2).mean() < 0.8 * ((rtn - w) @ x.T).pow(2).mean()


@pytest.mark.parametrize(
    "fmt,preset,layout",
    [
        ("fp8", "FP8_DYNAMIC", "float-quantized"),
        ("nvfp4", "NVFP4A16", "nvfp4-pack-quantized"),
        ("mxfp4", "MXFP4A16", "mxfp4-pack-quantized"),
    ],
)
def test_export_names_the_scheme_as_compressed_tensors_presets_and_reloads_bit_for_bit(fmt, preset, layout, tmp_path):
    from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES

    model = tiny("llama").to(torch.bfloat16)
    recipe = compress_with(model, f"  - rtn: {{format: {fmt}}}\n")
    reloaded = export_and_reload(model, recipe, tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert config["format"] == layout
    (group,) = config["config_groups"].values()
    assert group["format"] == layout  # as llm-compressor names a float group's layout
    theirs = PRESET_SCHEMES[preset]["weights"].model_dump(mode="json")
    assert {k: group["weights"].get(k) for k in theirs} == theirs
    ours = dict(model.named_modules())
    for name, module in reloaded.named_modules():
        if isinstance(module, torch.nn.Linear) and name != "lm_head":
            assert torch.equal(module.weight, ours[name].weight), name


def test_nvfp4_shares_one_global_scale_across_linears_that_read_one_input():
    """vLLM fuses q/k/v and gate/up into one matmul under one global scale."""
    model = tiny("llama").to(torch.bfloat16)
    compress_with(model, "  - rtn: {format: nvfp4}\n")
    attention = model.model.layers[0].self_attn
    scales = {
        n: getattr(attention, n).__dict__["quantized"].global_scale.item() for n in ("q_proj", "k_proj", "v_proj")
    }
    assert len(set(scales.values())) == 1


@pytest.mark.parametrize(
    "text,message",
    [
        ("  - rtn: {format: nvfp4, group_size: 32}\n", "nvfp4 stores 4-bit values with one scale per 16 weights"),
        ("  - gptq: {format: fp8, bits: 4}\n", "fp8 stores 8-bit values with one scale per channel"),
        ("  - rtn: {format: mxfp4, symmetric: false}\n", "mxfp4 is symmetric"),
        ("  - smoothquant: {}\n  - rtn: {format: fp8}\n", "int8 activations need int8 weights"),
        ("  - gptq: {format: nvfp4}\n  - blockwise: {train: [scales]}\n", "drop scales from train"),
        ("  - rtn: {format: nvfp4}\nexport: {format: gguf, type: q4_0}\n", "GGUF q4_0 stores integers, not nvfp4"),
        ("  - rtn: {format: mxfp4}\n  - activations: {format: nvfp4}\n", "nvfp4 activations run with nvfp4 weights"),
        ("  - rtn: {bits: 4, symmetric: false}\n  - activations: {format: fp8}\n", "or symmetric int4"),
        ("  - rtn: {format: nvfp4}\n  - activations: {format: nvfp4, static: true}\n", "strategy and static are fp8's"),
        ("  - rtn: {format: fp8}\n  - activations: {static: true}\n", "set strategy: tensor"),
        ("  - rtn: {bits: 8, symmetric: true}\n  - activations: {format: int}\n", "int8 weights: smoothquant"),
        ("  - rtn: {bits: 4, symmetric: false}\n  - activations: {format: int}\n", "symmetric int weights"),
        ("  - rtn: {format: fp8}\n  - activations: {bits: 4}\n", "bits is for int activations"),
        ("  - rtn: {bits: 4, symmetric: true}\n  - activations: {format: int, static: true}\n", "per token"),
    ],
)
def test_float_formats_refuse_what_does_not_fit_them(text, message):
    with pytest.raises(RecipeError, match=message):
        parse("passes:\n" + text)


def test_fp8_dynamic_activations_are_simulated_exported_and_reloaded_as_evaluated(tmp_path):
    """compressed-tensors' FP8_DYNAMIC: transformers rounds each token's input to FP8 as we did, and
    our streamed reader attaches the same rounding."""
    from compress import lazy

    model = tiny("llama")
    recipe = compress_with(model, "  - rtn: {format: fp8}\n  - activations: {format: fp8}\n")
    q_proj = model.model.layers[0].self_attn.q_proj
    x = torch.randn(3, q_proj.in_features)
    scale = x.float().abs().amax(-1, keepdim=True) / 448
    rounded = ((x.float() / scale).to(torch.float8_e4m3fn).float() * scale).to(x.dtype)
    torch.testing.assert_close(q_proj(x), torch.nn.functional.linear(rounded, q_proj.weight), rtol=0, atol=0)
    reloaded = export_and_reload(model, recipe, tmp_path / "out", dtype=torch.float32)
    config = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    (group,) = config["config_groups"].values()
    from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES

    theirs = PRESET_SCHEMES["FP8_DYNAMIC"]["input_activations"].model_dump(mode="json")
    assert {k: group["input_activations"].get(k) for k in theirs} == theirs
    probe = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(1))
    streamed = lazy.open_model(tmp_path / "out", torch.float32).load_all()
    with torch.no_grad():
        ours = model(probe).logits
        for theirs in (streamed, reloaded):
            torch.testing.assert_close(theirs(probe).logits, ours, rtol=1e-5, atol=1e-5)
    with pytest.raises(RecipeError, match="fp8 activations run with fp8 weights, or symmetric int4"):
        parse("passes:\n  - rtn: {format: nvfp4}\n  - activations: {}\n")


@pytest.mark.parametrize(
    "passes,preset",
    [
        ("  - rtn: {format: nvfp4}\n  - activations: {format: nvfp4}\n", "NVFP4"),
        ("  - rtn: {format: mxfp4}\n  - activations: {format: mxfp4}\n", "MXFP4"),
        ("  - rtn: {format: fp8}\n  - activations: {format: fp8, strategy: tensor, static: true}\n", "FP8"),
        ("  - rtn: {bits: 4, symmetric: true}\n  - activations: {format: fp8}\n", "W4AFP8"),
        ("  - rtn: {bits: 4, symmetric: true}\n  - activations: {format: int}\n", "W4A8"),
        ("  - rtn: {bits: 4, symmetric: true}\n  - activations: {format: int, bits: 4}\n", "W4A4"),
    ],
)
def test_quantized_activations_export_as_the_preset_and_reload_to_our_logits(passes, preset, tmp_path):
    """W4A4 (NVFP4, MXFP4, int), static FP8, W4AFP8 and W4A8: the calibrated scale is stored, the
    config's input arguments are the preset's, and transformers and our streamed reader compute
    our logits."""
    from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES

    from compress.quant import InputScale

    model = _bf16(tiny("llama"))
    ids = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(0))
    recipe = compress_with(model, passes, ids)
    q_proj = model.model.layers[0].self_attn.q_proj
    calibrated = InputScale.of(q_proj)
    assert (calibrated is not None) == (preset in ("NVFP4", "FP8"))
    reloaded = export_and_reload(model, recipe, tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    (group,) = config["config_groups"].values()
    theirs = PRESET_SCHEMES[preset]["input_activations"].model_dump(mode="json", exclude={"observer"})
    assert {k: group["input_activations"].get(k) for k in theirs} == theirs
    reloads_to_our_logits(model, tmp_path / "out", reloaded)
    from compress.formats.compressed_tensors import unsimulated_by_decoder

    said = unsimulated_by_decoder(tmp_path / "out")  # `compress decode` says what it does not round
    assert any(p.endswith("inputs run unrounded") and p.startswith(("int", "FP")) for p in said), said
    if calibrated is not None:
        name = "input_global_scale" if preset == "NVFP4" else "input_scale"
        stored = getattr(reloaded.model.layers[0].self_attn.q_proj, name).data
        torch.testing.assert_close(stored.float(), calibrated.value)


def test_fp4_activations_round_per_group_under_the_calibrated_global_scale():
    """NVFP4 inputs: each group of 16 values is E2M1 codes times an FP8 number over the global scale
    (448 * 6 / the largest |x| calibrated), the group's largest value on the code 6."""
    from compress.quant import ActivationScheme, InputScale, fake_quantize_activation

    x = torch.randn(3, 64) * torch.linspace(0.1, 10, 64)
    scheme = ActivationScheme(4, False, "nvfp4", group_size=16)
    calibrated = InputScale.calibrated(x.abs().amax(), scheme, torch.float32)
    torch.testing.assert_close(calibrated.value, 448 * 6 / x.abs().amax().reshape(1))
    groups = x.unflatten(-1, (-1, 16))
    fp8 = (groups.abs().amax(-1, keepdim=True) / 6 * calibrated.value).to(torch.float8_e4m3fn).float()
    codes = fake_quantize_activation(x, scheme, calibrated).unflatten(-1, (-1, 16)) / (fp8 / calibrated.value)
    halves = codes.abs().mul(2).round().div(2)
    torch.testing.assert_close(codes.abs(), halves)  # E2M1 values, up to float32's rounding of the division
    assert torch.isin(halves, FP4_VALUES).all()
    assert (halves.amax(-1) == 6).all()


@pytest.mark.parametrize("weights", ["", "  - rtn: {format: fp8}\n  - activations: {format: fp8}\n"])
def test_fp8_kv_cache_is_calibrated_exported_as_vllm_reads_it_and_reloads_to_our_logits(weights, tmp_path):
    """Each attention's k_scale / v_scale is the largest |key| / |value| over 448, every key and value
    is read rounded, and our reader computes our logits from the export. transformers 5.24 loads it but
    runs the cache unrounded: compressed-tensors 0.20 hooks the cache argument by its old names
    (``past_key_values``), which transformers now calls ``cache`` (docs/formats.md)."""
    from compress import lazy
    from compress.kv_fp8 import KVScale
    from compress.quant import round_fp8

    model = _bf16(tiny("llama"))
    ids = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(0))
    recipe = compress_with(model, weights + "  - kv_fp8: {}\n", ids)
    scales = [KVScale.of(layer.self_attn) for layer in model.model.layers]
    x = torch.randn(5) * 3
    assert torch.equal(round_fp8(x, torch.tensor([1.0])), x.to(torch.float8_e4m3fn).float())
    reloaded = export_and_reload(model, recipe, tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    scheme = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "tensor", "dynamic": False}
    assert {k: config["kv_cache_scheme"][k] for k in scheme} == scheme
    streamed = lazy.open_model(tmp_path / "out", torch.float32).load_all()
    probe = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = model.float()(probe).logits
        torch.testing.assert_close(streamed(probe).logits, ours, rtol=0, atol=0)
        for layer in model.model.layers:
            KVScale.drop(layer.self_attn)
        assert not torch.equal(model(probe).logits, ours)  # the rounding changes what the model computes
    for layer, kv in zip(streamed.model.layers, scales, strict=True):
        assert torch.equal(KVScale.of(layer.self_attn).k_scale, kv.k_scale)
        assert torch.equal(KVScale.of(layer.self_attn).v_scale, kv.v_scale)
    for name, module in reloaded.named_modules():
        if isinstance(module, torch.nn.Linear) and name != "lm_head":
            assert torch.equal(module.weight.float(), dict(model.named_modules())[name].weight), name


def test_fp8_kv_cache_refuses_a_second_kv_cache():
    with pytest.raises(RecipeError, match="one KV cache"):
        parse("passes:\n  - kv_cache: {bits: 4}\n  - kv_fp8: {}\n")


def test_fp8_block_holds_one_scale_per_tile_and_exports_as_the_preset(tmp_path):
    """FP8_BLOCK: one scale per 128 × 128 tile (held on each of its rows), weights on E4M3, inputs per
    token and group of 128; the export reloads in transformers to our float32 logits."""
    from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES

    model = _bf16(tiny("llama", hidden=512))  # every width a multiple of 128
    recipe = compress_with(model, "  - rtn: {format: fp8_block}\n  - activations: {format: fp8, strategy: group}\n")
    qw = quantized_of(model.model.layers[0].mlp.down_proj)
    assert qw.scale.shape == (512, 8) and torch.equal(qw.scale[:128], qw.scale[:1].expand(128, -1))
    assert not torch.equal(qw.scale[0], qw.scale[128])
    tile = model.model.layers[0].mlp.down_proj.weight[:128, :128].float()
    torch.testing.assert_close(tile.abs().amax() / 448, qw.scale[0, 0].float(), rtol=1e-2, atol=0)
    reloaded = export_and_reload(model, recipe, tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    (group,) = config["config_groups"].values()
    for part in ("weights", "input_activations"):
        theirs = PRESET_SCHEMES["FP8_BLOCK"][part].model_dump(mode="json")
        assert {k: group[part].get(k) for k in theirs} == theirs, part
    reloads_to_our_logits(model, tmp_path / "out", reloaded)


def test_fp8_block_refuses_a_linear_the_tiles_do_not_fit():
    model = tiny("llama")  # widths of 64: no 128 × 128 tile fits
    with pytest.raises(
        RecipeError, match="fp8_block tiles weights 128 × 128, which do not fit.*add those linears to ignore"
    ):
        compress_with(model, "  - rtn: {format: fp8_block}\n")
