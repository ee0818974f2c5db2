import pytest
import torch

from compress.quant import QuantScheme, dequantize, quantize_weight, resolve_group_size


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("symmetric", [True, False])
def test_rtn_error_within_half_step(bits, symmetric):
    torch.manual_seed(0)
    w = torch.randn(16, 128)
    scheme = QuantScheme(bits, 32, symmetric)
    qw = quantize_weight(w, scheme, torch.float32)
    assert qw.q.min() >= scheme.qmin and qw.q.max() <= scheme.qmax
    err = (dequantize(qw.q, qw.scale, qw.zero_point, torch.float32) - w).abs().reshape(16, 4, 32)
    # every weight lies inside its group's grid, so rounding moves it at most half a step
    assert (err <= qw.scale.unsqueeze(-1) / 2 + 1e-6).all()


def test_more_bits_and_smaller_groups_lower_error():
    torch.manual_seed(0)
    w = torch.randn(64, 256)

    def mse(bits, group):
        qw = quantize_weight(w, QuantScheme(bits, group, False), torch.float32)
        return (dequantize(qw.q, qw.scale, qw.zero_point, torch.float32) - w).pow(2).mean()

    assert mse(8, 64) < mse(4, 64) < mse(3, 64) < mse(2, 64)
    assert mse(4, 32) < mse(4, 128) < mse(4, -1)


@pytest.mark.parametrize("symmetric", [True, False])
def test_mse_observer_rounds_no_worse_than_minmax(symmetric):
    # heavy tails (Student's t, 3 degrees of freedom), as real weights have: clipping an outlier pays
    torch.manual_seed(0)
    w = torch.distributions.StudentT(3.0).sample((32, 256))

    def group_errors(observer):
        qw = quantize_weight(w, QuantScheme(4, 64, symmetric, observer=observer), torch.float32)
        error = dequantize(qw.q, qw.scale, qw.zero_point, torch.float32) - w
        return error.reshape(32, 4, 64).abs().pow(2.4).sum(-1), qw.scale

    minmax, minmax_scale = group_errors("minmax")
    mse, mse_scale = group_errors("mse")
    assert (mse <= minmax).all()  # the unshrunk range is one of the candidates
    assert mse.sum() < 0.95 * minmax.sum()
    assert (mse_scale <= minmax_scale).all() and (mse_scale < minmax_scale).any()  # ranges only shrink


def test_bad_observer_rejected():
    with pytest.raises(ValueError, match="observer must be one of"):
        QuantScheme(observer="percentile")


def test_auto_group_size():
    assert resolve_group_size("auto", [576, 1536]) == 64  # SmolLM2
    assert resolve_group_size("auto", [640, 2048]) == 128  # Gemma-3-270M
    assert resolve_group_size("auto", [100]) == -1
    assert resolve_group_size(32, [576]) == 32


def test_bad_bits_rejected():
    with pytest.raises(ValueError, match="bits must be one of"):
        QuantScheme(bits=6)  # 6: only as the q6_k grid


@pytest.mark.parametrize(
    "bits,group,symmetric", [(4, 32, True), (4, 32, False), (8, -1, True), (3, 64, False), (2, -1, False)]
)
def test_export_layout_decompresses_to_our_weights(bits, group, symmetric):
    """Our packed tensors, read by compressed-tensors' own decompressor, give our dequantized weight."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationScheme

    from compress.formats.compressed_tensors import tensors, weight_args

    torch.manual_seed(0)
    w = torch.randn(48, 128, dtype=torch.bfloat16)
    scheme = QuantScheme(bits, group, symmetric)
    qw = quantize_weight(w, scheme, torch.bfloat16)
    ours = dequantize(qw.q, qw.scale, qw.zero_point, torch.bfloat16)
    packed = {k.split(".", 1)[1]: v for k, v in tensors("m", qw, "pack-quantized").items()}
    ct_scheme = QuantizationScheme(targets=["Linear"], weights=weight_args(scheme))
    theirs = PackedQuantizationCompressor.decompress(packed, ct_scheme)["weight"]
    assert torch.equal(theirs.to(torch.bfloat16), ours)
