"""Each weight format computes what the evaluated weights compute: int4 from a W4 export (either
symmetry), W8A8 on ``_int_mm`` in process and from an export; formats are offered only where exact."""

import pytest
import torch

from compress import machine, models
from compress.decode import DecodeError, choice, greedy, kernels, native, onednn
from compress.decode.engine import Engine
from compress.export import export
from compress.formats.compressed_tensors import attach_integers, unsimulated_by_decoder
from compress.quant import QuantScheme, attach, dequantize, quantize_weight, quantized_of
from tests.conftest import _NoTokenizer, compress_with, tiny

CPU = torch.device("cpu")


def _export_and_reload(model, recipe, folder):
    out = export(model, _NoTokenizer(), folder, recipe.text, {})
    return models.for_compute(models.load_model(out, torch.bfloat16), CPU), out


@pytest.mark.skipif(not choice.int4_kernel_available(), reason="this torch has no int4 CPU kernel")
@pytest.mark.parametrize("symmetric", [True, False])
def test_int4_format_on_an_export_computes_the_dequantized_weights(symmetric, tmp_path):
    model = tiny("llama").to(torch.bfloat16)  # stored in bf16, as checkpoints are
    recipe = compress_with(model, f"  - rtn: {{bits: 4, group_size: 32, symmetric: {str(symmetric).lower()}}}\n")
    reloaded, out = _export_and_reload(model, recipe, tmp_path / "x")
    assert attach_integers(reloaded, out) == 14  # 2 blocks × 7 linears
    down = reloaded.model.layers[0].mlp.down_proj
    x = torch.randn(3, down.in_features).bfloat16().float()  # bf16 values: the kernel's input is exact
    int4 = kernels.build("int4", [down], CPU)
    torch.testing.assert_close(int4(x), x @ down.weight.T, atol=2e-2, rtol=1e-2)  # bf16 output rounding
    ids = torch.randint(0, 128, (1, 24), generator=torch.Generator().manual_seed(0))
    on_int4, on_bf16 = Engine(reloaded, kernel="int4"), Engine(reloaded, kernel="bf16")
    assert [on_int4.formats[g] for g in ("qkv", "o", "gate_up", "down")] == ["int4"] * 4
    assert on_int4.dtype == on_bf16.dtype == torch.bfloat16  # same stream: only the weight format differs
    torch.testing.assert_close(on_int4.forward(ids), on_bf16.forward(ids), atol=3e-2, rtol=0)
    assert on_int4.weight_bytes() < on_bf16.weight_bytes() / 2


def test_formats_are_offered_only_where_they_hold_the_weights():
    model = tiny("llama", hidden=96).to(torch.bfloat16)
    compress_with(model, "  - rtn: {bits: 4, group_size: -1}\n")  # one group of 96 or 192: no kernel size
    assert "int4" not in choice.exact_formats([model.model.layers[0].mlp.down_proj], CPU)
    model = tiny("llama").to(torch.bfloat16)
    compress_with(model, "  - rtn: {bits: 8, group_size: 32}\n")  # int8 weight-only needs one scale per row
    assert not {"int4", "int8"} & set(choice.exact_formats([model.model.layers[0].mlp.down_proj], CPU))
    compress_with(model := tiny("llama").to(torch.bfloat16), "  - rtn: {bits: 8, group_size: -1}\n")
    assert "int8" in choice.exact_formats([model.model.layers[0].mlp.down_proj], CPU)
    assert "bf16" not in choice.exact_formats([tiny("llama").model.layers[0].mlp.down_proj], CPU)  # fp32 values


def test_aten_cpu_capability_caps_the_instruction_sets_we_choose_kernels_by(monkeypatch):
    """An AVX-512 machine told ``ATEN_CPU_CAPABILITY=avx2`` times and builds what an AVX2-only CPU gets."""
    flags = "fpu avx2 fma avx512f avx512bw avx512_bf16 avx512_vnni amx_bf16 amx_tile"
    monkeypatch.setattr(machine, "_cpuinfo", lambda field: flags if field == "flags" else "Some Xeon")
    assert machine.bf16_arithmetic() and "avx512f" in machine.describe()
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    assert machine.cpu_flags() == {"fpu", "avx2", "fma"} and not machine.bf16_arithmetic()
    assert "(avx2; ATEN_CPU_CAPABILITY=avx2" in machine.describe()
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "default")
    assert machine.cpu_flags() == {"fpu"}
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx512")  # not a cap below what the machine has
    assert "avx512f" in machine.cpu_flags()


def test_w8a8_format_matches_fake_quantized_w8a8_in_process_and_from_the_export(tmp_path):
    model = tiny("llama")
    ids = torch.randint(0, 128, (1, 24), generator=torch.Generator().manual_seed(0))
    calibration = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(1))
    recipe = compress_with(model, "  - smoothquant: {alpha: 0.5}\n  - rtn: {bits: 8, group_size: -1}\n", calibration)
    with torch.no_grad():
        fake = model(ids).logits[0]  # activations fake-quantized as the evaluation simulates
    out = export(model, _NoTokenizer(), tmp_path / "x", recipe.text, {})
    reloaded = models.for_compute(models.load_model(out, torch.float32), CPU)
    for source in (model, reloaded):
        engine = Engine(source)
        assert set(engine.formats.values()) == {"w8a8", "fp32"}  # the lm_head is not W8A8
        # int32 sums are exact, fp32 ones are not: an activation on a rounding boundary can land on
        # the neighbouring integer (how many do depends on the CPU's kernel: 1.9e-3 seen on a VNNI EPYC)
        torch.testing.assert_close(engine.forward(ids), fake, atol=5e-3, rtol=0)
    assert greedy(Engine(reloaded), ids, 12).tokens == greedy(Engine(model), ids, 12).tokens


@pytest.mark.skipif(not onednn.onednn_available(), reason="this torch has no oneDNN")
def test_onednn_linears_compute_what_the_model_computes():
    model = tiny("llama")
    prompt = torch.randint(0, 128, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = model(prompt).logits
    plain = greedy(model, prompt, 12).tokens
    assert onednn.use_onednn(model) == 15  # 14 block linears and the lm_head
    assert model.lm_head.weight is None and model.model.layers[0].mlp.up_proj.weight is not None
    with torch.no_grad():  # multi-row (oneDNN) and single-row (MKL) paths both
        torch.testing.assert_close(model(prompt).logits, before, atol=1e-5, rtol=1e-5)
    assert greedy(model, prompt, 12).tokens == plain


def test_bf16_without_onednn_runs_on_aten_and_decodes_as_with_it(monkeypatch):
    """AVX2-only CPUs: oneDNN refuses bf16 weights, so bf16 runs on aten's ``F.linear`` (one row),
    an upcast fp32 GEMM (prompts) and, compiled, one-row steps. Forced here on any CPU."""
    model = tiny("llama").to(torch.bfloat16)
    prompt = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(0))
    reference = greedy(Engine(model, kernel="bf16"), prompt, 12).tokens
    monkeypatch.setattr(onednn, "onednn_bf16_available", lambda: False)
    down = model.model.layers[0].mlp.down_proj
    matmul = kernels.build("bf16", [down], CPU)
    assert isinstance(matmul, kernels.Dense) and matmul.one_row_kernel
    assert not matmul.rows_ride_along and kernels.build("fp32", [down], CPU).rows_ride_along
    x = torch.randn(kernels.VERIFY_ROWS + 4, down.in_features).bfloat16()  # a prompt's rows: the fp32 GEMM
    product = x.float() @ down.weight.float().T
    for rows in (1, len(x)):
        torch.testing.assert_close(matmul(x[:rows]).float(), product[:rows], atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(matmul.traced(x[:1]).float(), product[:1], atol=2e-2, rtol=1e-2)
    engine = Engine(model, kernel="bf16")
    assert engine.dtype == torch.bfloat16
    assert greedy(engine, prompt, 12).tokens == reference


needs_native = pytest.mark.skipif(not native.available(), reason="no AVX2/FMA CPU or no C++ compiler here")


def _random_w4(group: int, width: int = 256):
    """(generator, codes 48×width, scale, offset, the codes packed for our kernels), seeded by ``group``."""
    generator = torch.Generator().manual_seed(group)
    u = torch.randint(0, 16, (48, width), generator=generator)
    scale = torch.rand(48, width // group, generator=generator) / 16
    offset = torch.randn(48, width // group, generator=generator) / 4
    return generator, u, scale, offset, native.pack_int4(u)


@needs_native
@pytest.mark.parametrize("group", [32, 64, 128])
def test_native_int4_product_computes_the_dequantized_weights(group):
    generator, u, scale, offset, packed = _random_w4(group)
    weight = u.float() * scale.repeat_interleave(group, 1) + offset.repeat_interleave(group, 1)
    # the compiler may fuse scale·u + offset into one FMA (one rounding, not two)
    dequantized = torch.ops.compress.int4_dequantize(packed, scale, offset, group)
    torch.testing.assert_close(dequantized, weight)
    # for a bf16 prompt GEMM: the same values, rounded as torch rounds them
    assert torch.equal(torch.ops.compress.int4_dequantize(packed, scale, offset, group, True), dequantized.bfloat16())
    x = torch.randn(5, 256, generator=generator)
    product = torch.ops.compress.int4_matmul(x, packed, scale, offset, group)
    torch.testing.assert_close(product, x @ weight.T, atol=1e-4, rtol=1e-5)
    rows = torch.cat([torch.ops.compress.int4_matmul(row, packed, scale, offset, group) for row in x.split(1)])
    assert torch.equal(product, rows)  # each row alone: verify steps equal one-token steps


@needs_native
@pytest.mark.parametrize("group", [64, 128])
@pytest.mark.parametrize("width", [256, 640])  # 4 blocks; 10 (the kernel takes 8 at a time, then the rest)
@pytest.mark.parametrize("op, limit", [("int4_matmul_a8", 127), ("int4_matmul_a16", 32639)])
def test_native_w4aq_product_rounds_each_block_of_64_values(group, width, op, limit):
    """W4A8 rounds a block of 64 values to int8 (max|x| / 127 a step), W4A16 to max|x| / 32639
    (two int8 parts a value); the integer products are exact, the offset term meets the unrounded
    values."""
    generator, u, scale, offset, packed = _random_w4(group, width)
    x = torch.randn(5, width, generator=generator)
    x[1, 64:128] = 0  # a block of zeros: scale 0, no division by it
    blocks = x.reshape(5, width // 64, 64)
    step = blocks.abs().amax(-1, keepdim=True) / limit
    rounded = (torch.round(blocks / step.clamp(min=1e-30)) * step).reshape(5, width)  # ties to even, as the kernel
    expected = rounded @ (u.float() * scale.repeat_interleave(group, 1)).T + x @ offset.repeat_interleave(group, 1).T
    product = getattr(torch.ops.compress, op)(x, packed, scale, offset, group)
    torch.testing.assert_close(product, expected, atol=1e-4, rtol=1e-5)
    rows = torch.cat([getattr(torch.ops.compress, op)(row, packed, scale, offset, group) for row in x.split(1)])
    assert torch.equal(product, rows)  # each row alone: verify steps equal one-token steps
    with pytest.raises(RuntimeError, match="groups of 64k"):
        getattr(torch.ops.compress, op)(x, packed, torch.zeros(48, 8), torch.zeros(48, 8), 32)
    if op == "int4_matmul_a16":  # finer than bf16 rows, what torch's int4 kernel is fed
        weight = u.double() * scale.double().repeat_interleave(group, 1) + offset.double().repeat_interleave(group, 1)
        exact, bf16 = x.double() @ weight.T, x.bfloat16().double() @ weight.T
        assert (product.double() - exact).abs().max() < (bf16 - exact).abs().max() / 20


@needs_native
@pytest.mark.parametrize("width", [576, 640])  # 9 blocks of 64; 10 (the kernel takes 8 at a time, then the rest)
def test_argmax_head_finds_the_bf16_products_largest_logit(width):
    """int8 scores, a proven bound on their error, and the rows that may still hold the largest
    recomputed from bf16: the largest logit's position and value are ``bf16_matmul``'s bit for bit,
    also where two rows differ in one bf16 step and a channel is 40x the others, with a few rows
    recomputed, not all; each row alone, as a one-row call computes it."""
    generator = torch.Generator().manual_seed(width)
    weight = (torch.randn(3000, width, generator=generator) / 20).bfloat16()
    weight[7] = weight[3]
    weight[7].view(torch.int16)[width // 2] += 1  # one bf16 step apart: the int8 scores cannot tell
    x = torch.randn(6, width, generator=generator) / 4
    x[:4] += weight[3].float() * 20  # rows 3 and 7 nearly tie at the top
    x[:, 9] *= 40  # an outlier channel
    head = kernels.build(kernels.ARGMAX, [_linear(weight)], CPU)
    got = head(x)
    exact = torch.ops.compress.bf16_matmul(x, weight)
    assert torch.equal(got.argmax(-1), exact.argmax(-1)) and torch.equal(got.amax(-1), exact.amax(-1))
    assert set(exact.argmax(-1)[:4].tolist()) <= {3, 7}
    assert ((got == exact).sum(-1) < 50).all()  # the rest keep their int8 scores
    torch.testing.assert_close(got, x @ weight.float().T, atol=0.2, rtol=0)  # measured: 0.05-0.08
    assert torch.equal(got, torch.cat([head(row) for row in x.split(1)]))


def _linear(weight: torch.Tensor) -> torch.nn.Linear:
    linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    linear.weight.data = weight.float()
    return linear


@needs_native
def test_argmax_head_decodes_the_exact_heads_tokens():
    """``lm_head="argmax"`` runs ``Int8Argmax`` where the weights are bf16 values: greedy gives the
    tokens of the exact head (our bf16 product), verify steps equal one-token steps; elsewhere it
    keeps the exact formats."""
    model = tiny("llama", hidden=128).to(torch.bfloat16)
    compress_with(model, "  - rtn: {bits: 4, group_size: 64, symmetric: true}\n")
    prompt = torch.randint(0, 128, (1, 24), generator=torch.Generator().manual_seed(0))
    exact, argmax = Engine(model, kernel="int4-a16"), Engine(model, kernel="int4-a16", lm_head="argmax")
    assert exact.formats["lm_head"] == "bf16-avx2" and argmax.formats["lm_head"] == kernels.ARGMAX
    assert argmax.weight_bytes() < exact.weight_bytes()
    assert greedy(argmax, prompt, 16).tokens == greedy(exact, prompt, 16).tokens
    argmax.reset()
    argmax.forward(prompt[0, :20])
    one_by_one = torch.cat([argmax.forward(prompt[0, i : i + 1]) for i in range(20, 24)])
    argmax.crop(4)
    assert torch.equal(argmax.forward(prompt[0, 20:24]), one_by_one)
    assert Engine(tiny("llama", hidden=128), lm_head="argmax").formats["lm_head"] != kernels.ARGMAX  # fp32 values


@needs_native
def test_w4a8_is_used_only_when_asked_for():
    """``int4-a8`` rounds activations, so ``auto`` never picks it; asked for, it runs every W4
    group (and a lossy int4 lm_head) over a bf16 KV cache, its verify steps equal its one-token
    steps, and its logits stay near the exact W4 kernel's."""
    model = tiny("llama", hidden=128).to(torch.bfloat16)
    compress_with(model, "  - rtn: {bits: 4, group_size: 64, symmetric: true}\n")
    prompt = torch.randint(0, 128, (1, 24), generator=torch.Generator().manual_seed(0))
    assert "int4-a8" not in Engine(model).formats.values()
    a8 = Engine(model, kernel="int4-a8", lm_head="int4")
    assert set(a8.formats.values()) == {"int4-a8"}
    assert a8.cache_dtype == torch.bfloat16 and a8.native_attention  # it rounds more than the cache does
    for named in ("int4-avx2", "int4-a16"):  # any of our W4 kernels asked for runs a lossy int4 lm_head too
        assert Engine(model, kernel=named, lm_head="int4").formats["lm_head"] == named
    a8.forward(prompt[0, :20])
    one_by_one = torch.cat([a8.forward(prompt[0, i : i + 1]) for i in range(20, 24)])
    a8.crop(4)
    assert torch.equal(a8.forward(prompt[0, 20:24]), one_by_one)
    exact = Engine(model, kernel="int4-avx2", lm_head="int4")
    exact.forward(prompt[0, :20])
    torch.testing.assert_close(exact.forward(prompt[0, 20:24]), one_by_one, atol=0.05, rtol=0)


@needs_native
def test_a_bf16_kv_cache_under_the_fp32_stream_is_asked_for():
    """``cache_dtype=torch.bfloat16`` keeps the fp32 stream and products, stores keys and values in
    bf16 (read by our attention), steps verify as one-token steps do, and its logits stay near the
    fp32 cache's; any other dtype is one clear error."""
    model = tiny("llama", hidden=128).to(torch.bfloat16)
    compress_with(model, "  - rtn: {bits: 4, group_size: 64, symmetric: true}\n")
    prompt = torch.randint(0, 128, (1, 24), generator=torch.Generator().manual_seed(0))
    exact = Engine(model, kernel="int4-a16")
    half = Engine(model, kernel="int4-a16", cache_dtype=torch.bfloat16)
    assert exact.cache_dtype == torch.float32 and half.formats == exact.formats
    assert half.dtype == torch.float32 and half.cache.k[0].dtype == torch.bfloat16 and half.native_attention
    half.forward(prompt[0, :20])
    one_by_one = torch.cat([half.forward(prompt[0, i : i + 1]) for i in range(20, 24)])
    half.crop(4)
    assert torch.equal(half.forward(prompt[0, 20:24]), one_by_one)
    exact.forward(prompt[0, :20])
    torch.testing.assert_close(exact.forward(prompt[0, 20:24]), one_by_one, atol=5e-3, rtol=0)
    with pytest.raises(DecodeError, match="float32 or bfloat16"):
        Engine(model, cache_dtype=torch.float16)


@needs_native
def test_a_compiled_engine_does_not_mix_our_bf16_kernel_with_the_compilers(monkeypatch):
    """A mix would pad every compiled step (``rows_alone`` is all or nothing) and so leave its
    verify steps one row, turning every speculative method into plain greedy: whichever group
    times faster on the compiler's GEMM, all take ours once one does."""
    layers = tiny("llama").to(torch.bfloat16).model.layers
    groups = {"o": [[layer.self_attn.o_proj] for layer in layers], "down": [[layer.mlp.down_proj] for layer in layers]}
    faster = {"o": "bf16-avx2", "down": "bf16"}  # as one-row timings on a busy machine can say

    def timed(key, device):
        group = "o" if "'o'" in key else "down"
        return {f: 1.0 if f == faster[group] else 2.0 for f in ("bf16", "bf16-avx2")}

    monkeypatch.setattr(choice, "_timed", timed)
    assert choice.choose(groups, "auto", CPU)[0] == faster
    assert choice.choose(groups, "auto", CPU, compiled=True)[0] == {"o": "bf16-avx2", "down": "bf16-avx2"}


@needs_native
def test_native_bf16_product_and_attention_compute_what_torch_computes():
    generator = torch.Generator().manual_seed(0)
    weight, x = torch.randn(40, 96, generator=generator).bfloat16(), torch.randn(3, 96, generator=generator)
    torch.testing.assert_close(torch.ops.compress.bf16_matmul(x, weight), x @ weight.float().T, atol=1e-5, rtol=1e-5)
    q = torch.randn(4, 3, 16, generator=generator)  # 4 heads over 2 KV heads, 3 rows
    k, v = torch.randn(2, 50, 16, generator=generator), torch.randn(2, 50, 16, generator=generator)
    positions = torch.tensor([20, 21, 22])
    for window, cache in ((0, torch.float32), (8, torch.float32), (0, torch.bfloat16), (8, torch.bfloat16)):
        # a bf16 cache (an int4-a8 engine's) is read as the fp32 values it holds
        kc, vc = k.to(cache), v.to(cache)
        got = torch.ops.compress.decode_attention(q, kc, vc, positions, window, 0.25)
        for m, last in enumerate(positions.tolist()):
            first = max(0, last - window + 1) if window else 0
            keys, values = (t[:, first : last + 1].float().repeat_interleave(2, 0) for t in (kc, vc))
            weights = torch.softmax(torch.einsum("hd,hsd->hs", q[:, m], keys) * 0.25, -1)
            torch.testing.assert_close(got[:, m], torch.einsum("hs,hsd->hd", weights, values), atol=1e-5, rtol=1e-5)
    with pytest.raises(RuntimeError, match="outside the cache"):
        torch.ops.compress.decode_attention(q, k, v, torch.tensor([1, 2, 50]), 0, 0.25)


@needs_native
def test_engine_on_native_kernels_decodes_as_on_torch_kernels():
    """The W4 and bf16 groups on our AVX2 kernels, attention too: the tokens of the same engine on
    torch's kernels (fp32 all along), and verify steps equal one-token steps bit for bit."""
    model = tiny("llama", hidden=128).to(torch.bfloat16)
    compress_with(model, "  - rtn: {bits: 4, group_size: 64, symmetric: false}\n")
    prompt = torch.randint(0, 128, (1, 24), generator=torch.Generator().manual_seed(0))
    ours = Engine(model, kernel="int4-avx2")
    assert {ours.formats[g] for g in ("qkv", "o", "gate_up", "down")} == {"int4-avx2"}
    assert ours.native_attention and ours.dtype == torch.float32
    expected = greedy(Engine(model, kernel="fp32"), prompt, 16).tokens
    assert greedy(ours, prompt, 16).tokens == expected
    a16 = Engine(model, kernel="int4-a16")
    assert {a16.formats[g] for g in ("qkv", "o", "gate_up", "down")} == {"int4-a16"}
    assert a16.cache_dtype == torch.float32 and greedy(a16, prompt, 16).tokens == expected
    ours.reset()
    ours.forward(prompt[0, :20])
    one_by_one = torch.cat([ours.forward(prompt[0, i : i + 1]) for i in range(20, 24)])
    ours.crop(4)
    assert torch.equal(ours.forward(prompt[0, 20:24]), one_by_one)


@needs_native
@pytest.mark.parametrize(
    "scheme",
    [
        QuantScheme(8, 32, True),  # Q8_0
        QuantScheme(3, 64, False),  # our W3
        QuantScheme(6, 16, True, format="q6_k"),  # groups of 16 under super-block scales
        QuantScheme(4, 32, False, format="q4_k"),  # unsigned codes under a float minimum
    ],
)
def test_grouped_int8_product_computes_the_dequantized_weights(scheme):
    """``int8g-avx2`` (codes of up to 8 bits, a scale and an offset per group of 16k) is offered
    for every integer grid and computes its weights; verify steps equal one-token steps."""
    model = tiny("llama", hidden=256).to(torch.bfloat16)
    for layer in model.model.layers:
        for lin in [m for m in layer.modules() if isinstance(m, torch.nn.Linear)]:
            attach(lin, quantize_weight(lin.weight.detach().float(), scheme, torch.bfloat16))
    down = model.model.layers[0].mlp.down_proj
    assert "int8g-avx2" in choice.exact_formats([down], CPU)
    matmul = kernels.build("int8g-avx2", [down], CPU)
    assert matmul.nbytes < down.weight.numel() * 1.6  # a byte a weight, and the groups' scales and offsets
    qw = quantized_of(down)
    weight = dequantize(qw.q, qw.scale.float(), qw.zero_point, torch.float32, qw.scheme)  # not rounded to bf16
    x = torch.randn(5, down.in_features, generator=torch.Generator().manual_seed(0))
    product = matmul(x)
    torch.testing.assert_close(product, x @ weight.T, atol=1e-4, rtol=1e-5)
    assert torch.equal(product, torch.cat([matmul(row) for row in x.split(1)]))
    prompt = torch.randn(40, down.in_features, generator=torch.Generator().manual_seed(1))  # dequantized, a GEMM
    torch.testing.assert_close(matmul(prompt), prompt @ weight.T, atol=5e-2, rtol=2e-2)
    ids = torch.randint(0, 128, (1, 16), generator=torch.Generator().manual_seed(0))
    engine = Engine(model, kernel="int8g-avx2")
    assert {engine.formats[g] for g in ("qkv", "o", "gate_up", "down")} == {"int8g-avx2"}
    assert greedy(engine, ids, 8).tokens == greedy(Engine(model, kernel="fp32"), ids, 8).tokens


@pytest.mark.parametrize("inputs", ["{format: fp8}", "{format: fp8, strategy: tensor, static: true}"])
def test_fp8_format_on_scaled_mm_computes_what_the_evaluation_scored_in_process_and_from_the_export(inputs, tmp_path):
    """FP8_DYNAMIC (per-token inputs) and FP8 (one calibrated scale): ``_scaled_mm`` on the E4M3
    values gives the fake-quantized model's logits; ``auto`` leaves it alone on a CPU (slow there)."""
    model = tiny("llama")
    ids = torch.randint(0, 128, (1, 24), generator=torch.Generator().manual_seed(0))
    calibration = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(1))
    recipe = compress_with(model, f"  - rtn: {{format: fp8}}\n  - activations: {inputs}\n", calibration)
    with torch.no_grad():
        fake = model(ids).logits[0]
    out = export(model, _NoTokenizer(), tmp_path / "x", recipe.text, {})
    reloaded = models.for_compute(models.load_model(out, torch.float32), CPU)
    assert attach_integers(reloaded, out) == 14  # 2 blocks × 7 linears, as E4M3 values and scales
    assert quantized_of(reloaded.model.layers[0].mlp.down_proj).q.dtype == torch.float8_e4m3fn
    assert unsimulated_by_decoder(out, fp8_kernel=True) == []  # what decode tells the user
    assert unsimulated_by_decoder(out) == ["float-quantized weights run dequantized", "FP8 inputs run unrounded"]
    tokens = []
    for source in (model, reloaded):
        engine = Engine(source, kernel="fp8")
        assert set(engine.formats.values()) == {"fp8", "fp32"}  # the lm_head is not FP8
        # float32 sums in another order: an input on a rounding boundary of E4M3 can land on its neighbour
        torch.testing.assert_close(engine.forward(ids), fake, atol=2e-3, rtol=0)  # unrounded inputs: 1.7e-2
        assert "fp8" not in Engine(source).formats.values()
        tokens.append(greedy(engine, ids, 12).tokens)
    assert tokens[0] == tokens[1]
    assert not choice.fp8_kernel_fits([tiny("llama").model.layers[0].mlp.down_proj], CPU)  # dense weights
