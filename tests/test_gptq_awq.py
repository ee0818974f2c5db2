import pytest
import torch

from compress import memory
from compress.arch import arch_of, decoder_layers, fold
from compress.column_sweep import obs_sweep
from compress.hessian import AsymmetricHessian, Hessian, inverse_cholesky
from compress.lazy import streamed
from compress.passes.awq import search_clip, search_scale
from compress.passes.base import RecipeError
from compress.quant import QuantScheme, dequantize, quantize_weight, quantized_of
from compress.recipe import parse
from tests.conftest import compress_with, export_and_reload, tiny


def _layer_and_inputs(outliers: bool = False):
    torch.manual_seed(0)
    lin = torch.nn.Linear(256, 64, bias=False)
    X = torch.randn(4096, 256) @ torch.randn(256, 256) * 0.3  # correlated inputs, as in real layers
    if outliers:
        X[:, :4] *= 30  # a few salient channels, the case AWQ is built for
    h = Hessian(lin)
    h.add(X)
    return lin, X, h


def _out_err(X, W, qw):
    return (X @ dequantize(qw.q, qw.scale, qw.zero_point, torch.float32).T - X @ W.T).pow(2).mean().item()


def test_hessian_accumulates_two_over_n_xtx_over_uneven_batches():
    """Lower-triangle panels over batches of different sizes give the symmetric product over all tokens."""
    torch.manual_seed(0)
    X = torch.randn(700, 300, dtype=torch.float64).float()  # 300 wide: one full panel of 192 and a partial one
    h = Hessian(torch.nn.Linear(300, 8))
    for part in X.split([1, 255, 444]):
        h.add(part)
    assert h.n == 700
    torch.testing.assert_close(h.H, 2 / 700 * X.double().T @ X.double(), rtol=1e-5, atol=1e-5, check_dtype=False)
    assert torch.equal(h.H, h.H.T)


def test_hessian_is_read_once_filled_and_handed_over_once():
    h = Hessian(torch.nn.Linear(20, 4))
    h.add(torch.randn(30, 20))
    H = h.H
    with pytest.raises(RuntimeError, match="after it was read"):
        h.add(torch.randn(3, 20))
    assert h.take() is H
    with pytest.raises(RuntimeError, match="no longer exists"):
        _ = h.H


@pytest.mark.parametrize("width", [7, 700])  # 700: several blocks of the in-place steps
def test_inverse_cholesky_in_place_is_the_textbook_factor(width):
    """The reversal trick, in place, gives the factor of the usual three steps (factor, invert,
    factor upper) on the permuted, dampened matrix; dead channels included; destroying the input
    (``overwrite``) changes nothing."""
    torch.manual_seed(0)
    X = torch.randn(width + 30, width, dtype=torch.float64)
    X[:, 3] = 0  # a dead channel
    H = X.T @ X
    order = torch.randperm(width)
    expected = H.clone()
    expected[3, 3] = 1
    expected = expected[order][:, order]
    expected += 0.01 * expected.diagonal().mean() * torch.eye(width, dtype=torch.float64)
    expected = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(expected)), upper=True)
    U = inverse_cholesky(H, 0.01, "layer", order)
    torch.testing.assert_close(U, expected.float(), rtol=1e-5, atol=1e-5 * expected.abs().max().item())
    assert torch.equal(U, U.triu())
    assert torch.equal(inverse_cholesky(H.clone(), 0.01, "layer", order, overwrite=True), U)


def test_a_hessian_that_does_not_factor_is_retried_on_a_copy_and_not_in_place():
    torch.manual_seed(0)
    A = torch.randn(40, 40, dtype=torch.float64)
    H = A @ A.T
    H[7, 7] = -H[7, 7]  # not positive definite until dampened well past the default
    with pytest.warns(UserWarning, match="dampening raised to"):
        assert torch.isfinite(inverse_cholesky(H, 0.01, "layer")).all()
    with pytest.warns(UserWarning, match="using its diagonal"):  # no copy to start again from
        U = inverse_cholesky(H.clone(), 0.01, "layer", overwrite=True)
    assert torch.equal(U, torch.diag(U.diagonal()))


@pytest.mark.parametrize("true_sequential", [True, False])
def test_the_memory_plan_holds_one_group_of_hessians_or_the_whole_block(true_sequential):
    model = streamed(tiny("llama", layers=2))
    cfg = model.config
    h, m = cfg.hidden_size, cfg.intermediate_size
    kv = h // cfg.num_attention_heads * cfg.num_key_value_heads
    recipe = parse(f"passes:\n  - gptq: {{bits: 4, true_sequential: {str(true_sequential).lower()}}}\n")
    held = memory.plan(model, recipe.passes, torch.device("cpu"), 4, 64, 0, 0, False).compress["Hessians"]
    # q/k/v, o, gate/up, down: each group's float64 Hessian, and the stacked rows' working copy
    hessians = [8 * h * h, 8 * h * h, 8 * h * h, 8 * m * m]
    work = [(h + 2 * kv) * h * 11, h * h * 7, 2 * m * h * 11, h * m * 7]
    if true_sequential:
        assert held == max(a + b for a, b in zip(hessians, work))
    else:
        assert held == sum(hessians) + max(work)


def test_the_clip_search_in_bands_of_rows_equals_the_search_at_once():
    torch.manual_seed(0)
    w, x = torch.randn(48, 128), torch.randn(300, 128)
    scheme = QuantScheme(4, 32, True)
    whole = search_clip(w, x, scheme, 20, 0.5, chunk=1 << 30)
    assert torch.equal(search_clip(w, x, scheme, 20, 0.5, chunk=5 * 300 * 4), whole)  # bands of 5 rows, and 3
    assert (whole.abs() < w.abs()).any()  # some groups clipped


@pytest.mark.parametrize("actorder", [False, True])
def test_stacked_linears_quantize_as_if_alone(actorder):
    """GPTQ sweeps q/k/v (and gate/up) as one stacked matrix: rows never interact, so the
    integers and scales are those of one linear at a time."""
    _, _, h = _layer_and_inputs()
    torch.manual_seed(1)
    parts = [torch.randn(rows, 256) * 0.05 for rows in (64, 16, 16)]
    scheme = QuantScheme(4, 64, True)
    alone = [obs_sweep(w, h.H, "layer", scheme=scheme, actorder=actorder).quantized for w in parts]
    stacked = obs_sweep(torch.cat(parts), h.H, "layer", scheme=scheme, actorder=actorder).quantized
    assert torch.equal(stacked.q, torch.cat([a.q for a in alone]))
    assert torch.equal(stacked.scale, torch.cat([a.scale for a in alone]))


@pytest.mark.parametrize("scheme", [QuantScheme(4, 64, True), QuantScheme(3, -1, False), QuantScheme(2, 32, False)])
@pytest.mark.parametrize("actorder", [False, True])
def test_gptq_beats_rtn_on_layer_output(scheme, actorder):
    lin, X, h = _layer_and_inputs()
    W = lin.weight.data
    gptq = obs_sweep(W, h.H, "layer", scheme=scheme, actorder=actorder).quantized
    rtn = quantize_weight(W, scheme, torch.float32)
    assert _out_err(X, W, gptq) < 0.8 * _out_err(X, W, rtn)


@pytest.mark.parametrize("actorder", [False, True])
def test_gptaq_fits_the_dense_output_from_inputs_that_carry_earlier_errors(actorder):
    """GPTAQ's target is W X̂ (the dense inputs) from the compressed inputs X: it lands closer to
    it than GPTQ, which fits W X; with no asymmetry it is GPTQ, integer for integer."""
    lin, dense, _ = _layer_and_inputs()
    torch.manual_seed(2)
    noisy = dense + 0.3 * torch.randn(4096, 256) @ torch.randn(256, 256) * 0.3  # what earlier rounding left
    h = AsymmetricHessian(lin, iter(dense.split(1000)))
    for part in noisy.split(1000):  # uneven batches, paired with the dense ones in order
        h.add(part)
    torch.testing.assert_close(h.asymmetry, 2 / 4096 * (dense - noisy).double().T @ noisy.double())
    W, scheme = lin.weight.data, QuantScheme(4, 64, True)
    gptq = obs_sweep(W, h.H, "layer", scheme=scheme, actorder=actorder).quantized
    gptaq = obs_sweep(W, h.H, "layer", scheme=scheme, actorder=actorder, asymmetry=h.asymmetry).quantized

    def error(qw):  # against the dense model's output
        return (noisy @ dequantize(qw.q, qw.scale, qw.zero_point, torch.float32).T - dense @ W.T).pow(2).mean()

    assert error(gptaq) < 0.98 * error(gptq)
    no_asymmetry = torch.zeros_like(h.asymmetry)
    same = obs_sweep(W, h.H, "layer", scheme=scheme, actorder=actorder, asymmetry=no_asymmetry).quantized
    assert torch.equal(same.q, gptq.q) and torch.equal(same.scale, gptq.scale)


def test_gptaq_recipe_carries_the_dense_activations():
    """Block 0's q/k/v see the dense inputs themselves (no asymmetry: GPTQ's integers); every later
    linear sees the rounding before it and differs somewhere; an MoE model is refused."""
    ids = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(0))
    plain, gptaq = tiny(layers=2), tiny(layers=2)
    compress_with(plain, "  - gptq: {bits: 3, group_size: 32}\n", ids)
    recipe = compress_with(gptaq, "  - gptq: {bits: 3, group_size: 32, gptaq: true}\n", ids)
    assert "gptaq" in recipe.passes[0].summary()
    codes = [
        {n: quantized_of(m).q for n, m in model.named_modules() if quantized_of(m) is not None}
        for model in (plain, gptaq)
    ]
    first = [n for n in codes[0] if n.startswith("model.layers.0.self_attn.") and n[-6] in "qkv"]
    assert len(first) == 3 and all(torch.equal(codes[0][n], codes[1][n]) for n in first)
    assert not torch.equal(codes[0]["model.layers.1.mlp.down_proj"], codes[1]["model.layers.1.mlp.down_proj"])
    with torch.no_grad():
        assert torch.isfinite(gptaq(ids).logits).all()

    from tests.test_families import family

    with pytest.raises(RecipeError, match="gptaq: not for mixture-of-experts"):
        compress_with(family("qwen3_moe"), "  - gptq: {bits: 4, group_size: 32, gptaq: true}\n", ids)


def test_singular_hessian_does_not_crash():
    lin, X, _ = _layer_and_inputs()
    X[:, 5] = 0  # a dead input channel
    X[:, 7] = X[:, 8]  # and two identical ones: H is singular
    h = Hessian(lin)
    h.add(X[:16])  # fewer tokens than channels: rank-deficient too
    with pytest.warns(UserWarning, match="layer: Hessian not positive definite; dampening raised"):
        qw = obs_sweep(lin.weight.data, h.H, "layer", scheme=QuantScheme(4, 64, True), percdamp=0.0).quantized
    assert torch.isfinite(qw.scale).all()
    assert (qw.q[:, 5] == 0).all()  # a dead column's weight is zeroed, as in the reference


def test_actorder_export_reloads_to_the_same_weights(tmp_path):
    """Act-order keeps static groups: the plain pack-quantized layout (no g_idx) reproduces the weights."""
    model = tiny("llama")
    recipe = compress_with(
        model, "  - gptq: {bits: 4, group_size: 32, actorder: true}\n", torch.randint(0, 128, (4, 32))
    )
    reloaded = export_and_reload(model, recipe, tmp_path / "x")
    for (name, ours), (_, theirs) in zip(model.named_modules(), reloaded.named_modules()):
        if quantized_of(ours) is not None:
            assert torch.equal(ours.weight, theirs.weight), name


@pytest.mark.parametrize("model_type", ["llama", "gemma3_text"])
def test_awq_folding_keeps_the_float_block_unchanged(model_type):
    model = tiny(model_type, layers=2).float()
    arch = arch_of(model)
    block = decoder_layers(model)[0]
    ids = torch.randint(0, 128, (2, 16))
    with torch.no_grad():
        before = model(ids).logits
    torch.manual_seed(1)
    for mapping in arch.scalings:
        prev = block.get_submodule(mapping.prev)
        width = prev.out_features if isinstance(prev, torch.nn.Linear) else prev.weight.shape[0]
        if all(block.get_submodule(n).in_features == width for n in mapping.linears):
            fold(block, mapping, torch.rand(width) * 4 + 0.25, arch.norm_plus_one)
    with torch.no_grad():
        after = model(ids).logits
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-4)


def test_awq_scale_search_beats_rtn_with_salient_channels():
    from compress.passes.awq import _Inputs

    lin, X, _ = _layer_and_inputs(outliers=True)
    W = lin.weight.data.clone()
    scheme = QuantScheme(3, 64, True)
    inputs = _Inputs(limit=2048)
    for chunk in X.split(512):
        inputs.add(chunk.unsqueeze(0))
    s = search_scale(inputs, [lin], lin, scheme, grid=20)
    assert torch.equal(lin.weight.data, W)  # the search leaves the layer as it found it
    scaled = quantize_weight(W * s, scheme, torch.float32)
    awq_err = (
        ((X / s) @ dequantize(scaled.q, scaled.scale, scaled.zero_point, torch.float32).T - X @ W.T)
        .pow(2)
        .mean()
        .item()
    )
    assert awq_err < 0.95 * _out_err(X, W, quantize_weight(W, scheme, torch.float32))


@pytest.mark.parametrize("model_type", ["llama", "gemma3_text"])
def test_awq_then_gptq_recipe_runs(model_type):
    model = tiny(model_type, layers=2)
    compress_with(
        model,
        "  - awq: {bits: 4, group_size: 32, quantize: false}\n  - gptq: {bits: 4, group_size: 32}\n",
        torch.randint(0, 128, (4, 32)),
    )
    quantized = [m for m in model.modules() if quantized_of(m) is not None]
    assert len(quantized) == 7 * 2
    with torch.no_grad():
        assert torch.isfinite(model(torch.randint(0, 128, (1, 8))).logits).all()
