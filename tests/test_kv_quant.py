"""KIVI KV-cache quantization: error bounds, the residual window, and an evaluation that
sees exactly what a decoder with the quantized cache sees."""

import pytest
import torch

from compress import kv_quant, models
from compress.decode.loop import with_cache
from compress.kv_quant import KIVICache, KIVILayer, KVScheme, quantize_keys, quantize_values
from compress.passes import RecipeError
from compress.recipe import parse
from tests.conftest import _NoTokenizer, compress_with, tiny

KV = torch.randn(2, 3, 64, 32, generator=torch.Generator().manual_seed(0)) * torch.linspace(0.1, 5, 32)


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("residual", [0, 32])
def test_round_trip_error_within_half_a_step(bits, residual):
    s = KVScheme(bits, 16, residual)
    for quantize, grouped in ((quantize_keys, -2 if residual else -1), (quantize_values, -1)):
        codes, scale, minimum = quantize(KV, s)
        restored = kv_quant.dequantize(codes, scale, minimum, KV.shape)
        step = scale.expand(codes.shape).reshape(KV.shape)  # each element's own group step
        assert ((restored - KV).abs() <= step / 2 + 1e-5).all()
        assert codes.max() <= 2**bits - 1
        assert scale.shape[grouped] == 1  # one scale per group along the grouped axis


def test_keys_are_grouped_per_channel_and_values_per_token():
    s = KVScheme(4, 16, 32)
    _, k_scale, _ = quantize_keys(KV, s)
    _, v_scale, _ = quantize_values(KV, s)
    assert k_scale.shape == (2, 3, 64 // 16, 1, 32)  # per channel, per 16 tokens
    assert v_scale.shape == (2, 3, 64, 32 // 16, 1)  # per token, per 16 channels


@pytest.mark.parametrize("sinks", [0, 3])
def test_residual_window_and_sinks_stay_full_precision(sinks):
    s = KVScheme(2, 8, 16, sinks)
    layer = KIVILayer(s)
    k, v = KV[:, :, :40, :16], KV[:, :, :40, 16:]
    layer.update(k[:, :, :21], v[:, :, :21])  # a prefill of 21: 16 quantized (after the sinks), the rest in the window
    for t in range(21, 40):
        keys, values = layer.update(k[:, :, t : t + 1], v[:, :, t : t + 1])
        held = s.quantized_upto(t + 1)  # after this step
        window = t + 1 - held
        assert torch.equal(layer.keys, k[:, :, held : t + 1]) and layer.keys.shape[-2] == window
        start = s.quantized_upto(t)  # what this step's attention read in full precision
        assert torch.equal(keys[:, :, start:], k[:, :, start : t + 1])
        assert torch.equal(values[:, :, start:], v[:, :, start : t + 1])
        assert torch.equal(keys[:, :, :sinks], k[:, :, :sinks])  # the sinks, as they came
        assert not torch.equal(keys[:, :, sinks:start], k[:, :, sinks:start])
    assert layer.get_seq_length() == 40


def test_fp8_key_scales_are_float8_values_near_the_exact_ones():
    s = KVScheme(2, 16, 32, fp8_key_scales=True)
    codes, scale, minimum = quantize_keys(KV, s)
    assert torch.equal(scale.to(torch.float8_e4m3fn).float(), scale)  # e4m3 holds each exactly
    plain = quantize_keys(KV, KVScheme(2, 16, 32))[1]
    assert ((scale - plain).abs() <= plain / 16 + 1e-6).all()  # the nearest: within half an e4m3 step
    # a scale rounded down clamps the top code: 3 levels × under 1/16 of a step, past the usual half
    step = scale.expand(codes.shape).reshape(KV.shape)
    assert ((kv_quant.dequantize(codes, scale, minimum, KV.shape) - KV).abs() <= step * (0.5 + 3 / 16) + 1e-5).all()


def test_rotated_values_spread_an_outlying_channel():
    """A value channel far larger than the rest sets a plain per-token group's step; in the
    Hadamard basis it is spread over every channel, and the round trip is exact when unquantized."""
    h = kv_quant.hadamard(16, torch.float32, torch.device("cpu"))
    torch.testing.assert_close(h @ h.T, torch.eye(16))
    v = torch.randn(1, 2, 64, 16, generator=torch.Generator().manual_seed(3))
    v[..., 7] *= 20
    plain, rotated = KVScheme(2, 16, 32), KVScheme(2, 16, 32, rotate_values=True)
    error = {
        s.rotate_values: (kv_quant.dequantize_values(quantize_values(v, s), v.shape, s) - v).square().mean()
        for s in (plain, rotated)
    }
    assert error[True] < 0.6 * error[False]
    lossless = KVScheme(8, 16, 32, rotate_values=True)
    torch.testing.assert_close(
        kv_quant.dequantize_values(quantize_values(v, lossless), v.shape, lossless), v, atol=0.1, rtol=0
    )
    with pytest.raises(ValueError, match="no Hadamard construction known for width 6"):
        kv_quant.hadamard(6, torch.float32, torch.device("cpu"))


def test_rotated_keys_spread_an_outlying_channel_when_keys_are_rounded_per_token():
    """Keys rounded per token (no window) suffer an outlying channel as values do, and the Hadamard
    basis spreads it; the round trip is exact when unquantized, with per-channel groups too."""
    k = torch.randn(1, 2, 64, 16, generator=torch.Generator().manual_seed(4))
    k[..., 3] *= 20
    error = {
        rotated: (kv_quant.dequantize_keys(quantize_keys(k, s), k.shape, s) - k).square().mean()
        for rotated, s in ((False, KVScheme(2, 16, 0)), (True, KVScheme(2, 16, 0, rotate_keys=True)))
    }
    assert error[True] < 0.6 * error[False]
    for lossless in (KVScheme(8, 16, 0, rotate_keys=True), KVScheme(8, 16, 32, rotate_keys=True)):
        back = kv_quant.dequantize_keys(quantize_keys(k, lossless), k.shape, lossless)
        torch.testing.assert_close(back, k, atol=0.1, rtol=0)


def test_bytes_per_token_counts_codes_scales_and_minima():
    s = KVScheme(4, 16, 32)
    k = KV[:1, :1]  # one layer, one head: 64 tokens × 32 dims
    stored = 0
    for quantize in (quantize_keys, quantize_values):
        codes, scale, minimum = quantize(k, s)
        stored += codes.numel() * s.bits / 8 + (scale.numel() + minimum.numel()) * 2  # fp16 scales
    assert s.bytes_per_token(layers=1, kv_heads=1, head_dim=32) == pytest.approx(stored / 64)
    # keys of 8 tokens with 1-byte scales: 32 channels × 3 bytes / 8 tokens; values as before
    small = KVScheme(4, 16, 32, key_group_size=8, fp8_key_scales=True)
    values = 32 * 2 * 2 / 16
    assert small.bytes_per_token(1, 1, 32) == pytest.approx(2 * 32 * 4 / 8 + 32 * 3 / 8 + values)
    assert kv_quant.dense_bytes_per_token(1, 1, 32) == 2 * 32 * 2


@pytest.mark.parametrize("model_type", ["llama", "gemma3_text"])
@pytest.mark.parametrize(
    "scheme",
    [
        KVScheme(2, 16, 32),
        KVScheme(2, 16, 0),
        KVScheme(4, 16, 16),
        KVScheme(2, 16, 32, 4),
        KVScheme(2, 16, 0, 4),
        KVScheme(2, 16, 32, 4, pre_rope=True),
        KVScheme(2, 16, 0, pre_rope=True),
        KVScheme(2, 16, 32, 4, True, key_group_size=8, fp8_key_scales=True, rotate_values=True),
        KVScheme(2, 8, 0, key_group_size=16, rotate_values=True),
        KVScheme(2, 16, 0, rotate_keys=True, rotate_values=True),
        KVScheme(2, 16, 32, 4, True, rotate_keys=True),
    ],
)
def test_simulated_evaluation_equals_decoding_with_the_cache(model_type, scheme):
    """One full-window forward under ``simulating`` gives the logits that token-by-token
    decoding with ``KIVICache`` gives (Gemma-3: sliding and global layers)."""
    model = tiny(model_type)
    kv_quant.install(model, scheme)
    ids = torch.randint(0, 128, (1, 80), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        with kv_quant.simulating(model):
            simulated = model(ids, use_cache=False).logits
        cache = kv_quant.new_cache(model)
        decoded = torch.cat([model(ids[:, t : t + 1], **with_cache(model, cache)).logits for t in range(80)], 1)
        dense = model(ids).logits
    torch.testing.assert_close(simulated, decoded, atol=2e-6, rtol=0)
    assert (simulated - dense).abs().max() > 1e-3  # the cache is really quantized
    assert model.config._attn_implementation != kv_quant.ATTENTION  # restored after the evaluation


def test_pre_rope_keys_keep_channels_that_are_steady_before_the_rotation():
    """KVQuant's reason: a key channel pair steady across tokens before the rotary embedding swings
    with the position after it, so per-channel groups quantized after the rotation lose what the
    same groups quantized before it keep (here: exactly, since each channel is constant)."""
    model = tiny("llama")
    rotary = kv_quant._rotary_of(model)(0)
    before = torch.randn(1, 2, 1, 16).expand(1, 2, 64, 16)  # constant per channel along the tokens
    cos, sin = rotary(0, 64, before)
    keys = kv_quant.rotate(before, cos, sin)
    values = torch.zeros_like(keys)
    after_rope, _ = kv_quant.round_trip(keys, values, KVScheme(2, 16, 32))
    pre_rope, _ = kv_quant.round_trip(keys, values, KVScheme(2, 16, 32, pre_rope=True), (cos, sin))
    assert (pre_rope - keys).abs().max() < 1e-5
    assert (after_rope - keys).abs().max() > 0.1


def test_scheme_is_exported_and_reinstalled(tmp_path):
    from compress.export import export

    model = tiny("llama")
    kv = "{bits: 2, group_size: 16, pre_rope: true}"
    recipe = compress_with(model, f"  - rtn: {{bits: 4, group_size: 32}}\n  - kv_cache: {kv}\n")
    out = export(model, _NoTokenizer(), tmp_path / "x", recipe.text, {})
    reloaded = models.load_model(out, torch.float32)
    assert reloaded.config.compress_kv_cache == {
        "method": "kivi",
        "bits": 2,
        "group_size": 16,
        "residual": 128,
        "sinks": 0,
        "pre_rope": True,
        "key_group_size": None,
        "fp8_key_scales": False,
        "rotate_values": False,
        "rotate_keys": False,
    }
    assert kv_quant.scheme_of(reloaded) == KVScheme(2, 16, 128, pre_rope=True)
    assert isinstance(kv_quant.new_cache(reloaded), KIVICache)


@pytest.mark.parametrize(
    "passes,message",
    [
        (
            "  - kv_cache: {group_size: 12, residual: 0}\n",
            r"passes\[0\].kv_cache.group_size: 12 does not divide the head dimension 16",
        ),
        (
            "  - kv_cache: {group_size: 16, residual: 20}\n",
            r"passes\[0\].kv_cache: residual \(20\) must be 0 or a multiple",
        ),
        ("  - kv_cache: {bits: 3}\n", r"passes\[0\].kv_cache.bits"),
        (
            "  - kv_cache: {group_size: 16, residual: 32, key_group_size: 12}\n",
            r"passes\[0\].kv_cache: residual \(32\) must be 0 or a multiple of key_group_size \(12\)",
        ),
    ],
)
def test_bad_kv_options_are_refused(passes, message):
    with pytest.raises(RecipeError, match=message):
        recipe = parse("passes:\n" + passes)
        recipe.passes[0].check(tiny("llama"))


@pytest.mark.parametrize("key", ["rotate_values", "rotate_keys"])
def test_rotated_values_or_keys_need_a_head_dimension_with_a_hadamard_matrix(key):
    recipe = parse(f"passes:\n  - kv_cache: {{bits: 2, group_size: 2, {key}: true}}\n")
    with pytest.raises(RecipeError, match=rf"passes\[0\].kv_cache.{key}: .*known for width 6 .*turn it off"):
        recipe.passes[0].check(tiny("llama", hidden=24))  # head dimension 6
