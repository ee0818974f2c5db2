"""The CUDA paths: the block sweep, the quantized KV cache and the decoder on a GPU.

Skipped without one (CI has none); run on a lent GPU machine with ``pytest tests/test_cuda.py``.
"""

import pytest
import torch

from compress import kv_quant
from compress.decode import PromptLookup, choice, greedy, speculate
from compress.decode.loop import with_cache
from compress.kv_quant import KIVICache, KVScheme
from compress.pipeline import run_sequential
from compress.recipe import parse
from tests.conftest import tiny

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
CUDA = torch.device("cuda")


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_sweep_on_cuda_puts_every_group_on_a_4_bit_grid(method):
    model = tiny("llama").to(torch.bfloat16)
    recipe = parse(f"passes:\n  - {method}: {{bits: 4, group_size: 32}}\n")
    ids = torch.randint(0, 128, (8, 64), generator=torch.Generator().manual_seed(0))
    for p in recipe.passes:
        p.check(model)
    run_sequential(model, ids, recipe.passes, CUDA)
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and "layers" in name:
            groups = module.weight.detach().float().reshape(-1, 32)
            assert torch.isfinite(groups).all(), name
            assert max(len(g.unique()) for g in groups) <= 16, name


def test_kivi_simulation_equals_cached_decoding_on_cuda():
    model = tiny("llama").to(CUDA)
    scheme = KVScheme(2, 16, 32)
    kv_quant.install(model, scheme)
    ids = torch.randint(0, 128, (1, 80), generator=torch.Generator().manual_seed(1)).to(CUDA)
    with torch.no_grad():
        with kv_quant.simulating(model):
            simulated = model(ids, use_cache=False).logits
        cache = KIVICache(scheme, model.config.num_hidden_layers)
        decoded = torch.cat([model(ids[:, t : t + 1], **with_cache(model, cache)).logits for t in range(80)], 1)
    torch.testing.assert_close(simulated, decoded, atol=1e-4, rtol=0)


def test_prompt_lookup_on_cuda_is_token_identical_to_greedy():
    model = tiny("llama").to(CUDA)
    g = torch.Generator().manual_seed(0)
    motif = torch.randint(0, 128, (10,), generator=g)
    prompt = torch.cat([torch.randint(0, 128, (20,), generator=g), motif, motif]).unsqueeze(0).to(CUDA)
    plain = greedy(model, prompt, 40)
    fast = speculate(model, prompt, 40, PromptLookup(), k=5)
    assert fast.tokens == plain.tokens
    assert fast.forwards < plain.forwards


@pytest.mark.parametrize("model_type", ["llama", "gemma3_text"])
def test_engine_on_cuda_equals_transformers_greedy(model_type):
    from compress.decode.engine import Engine

    model = tiny(model_type, layers=4).to(CUDA)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 128, (1, 24), generator=g).to(CUDA)
    engine = Engine(model)
    assert engine.formats["qkv"] == "dense" and engine.dtype == torch.float32  # the model's dtype on a GPU
    reference = model.generate(prompt, max_new_tokens=32, min_new_tokens=32, do_sample=False)[0, 24:].tolist()
    assert greedy(engine, prompt, 32).tokens == reference


@pytest.mark.parametrize("model_type", ["llama", "gemma3_text"])
def test_cuda_graph_steps_equal_eager_steps_and_speculation_equals_greedy(model_type):
    from compress.decode.engine import Engine

    model = tiny(model_type, layers=4).to(CUDA)
    g = torch.Generator().manual_seed(0)
    motif = torch.randint(0, 128, (8,), generator=g)
    prompt = torch.cat([torch.randint(0, 128, (24,), generator=g), motif, motif]).unsqueeze(0).to(CUDA)
    eager, graphed = Engine(model, graphs=False), Engine(model, max_len=48)  # grows: 40 + 40 > 48
    assert graphed.graphs
    plain = greedy(graphed, prompt, 40)
    assert plain.tokens == greedy(eager, prompt, 40).tokens
    # one padded graph
    assert graphed.cache.max_len >= 80 and list(graphed.graphs.captured) == [graphed.step_rows] == [8]
    fast = speculate(graphed, prompt, 40, PromptLookup(), k=5)
    assert fast.tokens == plain.tokens and fast.forwards < plain.forwards


def test_cuda_int4_kernel_computes_the_dequantized_weights():
    from compress.decode import kernels
    from compress.quant import dequantize

    linear = torch.nn.Linear(576, 1536, bias=False)
    w4 = kernels.rtn_w4(linear)
    assert choice.exact_formats([w4], CUDA) == ["dense", "int4"]
    matmul = kernels.build("int4", [w4], CUDA)
    qw = w4.quantized
    x = torch.randn(3, 576, device=CUDA, dtype=torch.bfloat16)
    reference = x.float() @ dequantize(qw.q, qw.scale, qw.zero_point, torch.float32).to(CUDA).t()
    error = (matmul(x).float() - reference).norm() / reference.norm()
    assert error < 1e-2, error


def test_cuda_graph_verify_step_rounds_as_one_token_steps_in_bf16():
    from compress.decode.engine import Engine

    model = tiny("llama", layers=4).to(CUDA, torch.bfloat16)
    ids = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(2)).to(CUDA)
    engine = Engine(model)
    assert engine.dtype == torch.bfloat16 and engine.step_tokens == 8
    engine.forward(ids[:, :32], all_logits=False)
    together = engine.forward(ids[0, 32:])
    engine.crop(8)
    one_by_one = torch.cat([engine.forward(ids[0, t : t + 1]) for t in range(32, 40)])
    assert torch.equal(together, one_by_one)


def test_w8a8_on_cuda_runs_int_mm_padded_and_matches_the_fake_quantized_model():
    from compress.decode.engine import Engine
    from tests.conftest import compress_with

    model = tiny("llama")
    calibration = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(1))
    compress_with(model, "  - smoothquant: {alpha: 0.5}\n  - rtn: {bits: 8, group_size: -1}\n", calibration)
    model.to(CUDA)
    ids = torch.randint(0, 128, (1, 24), generator=torch.Generator().manual_seed(0)).to(CUDA)
    with torch.no_grad():
        fake = model(ids).logits[0]
    graphed, eager = Engine(model), Engine(model, graphs=False)
    assert set(graphed.formats.values()) == {"w8a8", "dense"}  # the lm_head is not W8A8
    torch.testing.assert_close(eager.forward(ids), fake, atol=5e-3, rtol=0)  # as on the CPU (test_kernels)
    assert greedy(graphed, ids, 16).tokens == greedy(eager, ids, 16).tokens  # padded rows change no row


@pytest.mark.skipif(
    not torch.cuda.is_available() or not choice.fp8_tensor_cores(CUDA), reason="needs FP8 tensor cores (Hopper+)"
)
def test_fp8_on_cuda_runs_scaled_mm_and_matches_the_fake_quantized_model():
    from compress.decode.engine import Engine
    from tests.conftest import compress_with

    model = tiny("llama")
    compress_with(model, "  - rtn: {format: fp8}\n  - activations: {format: fp8}\n")
    model.to(CUDA)
    ids = torch.randint(0, 128, (1, 24), generator=torch.Generator().manual_seed(0)).to(CUDA)
    with torch.no_grad():
        fake = model(ids).logits[0]
    graphed, eager = Engine(model), Engine(model, graphs=False)
    assert set(graphed.formats.values()) == {"fp8", "dense"}  # auto takes it on a GPU; the lm_head is not FP8
    torch.testing.assert_close(eager.forward(ids), fake, atol=5e-3, rtol=0)
    assert greedy(graphed, ids, 16).tokens == greedy(eager, ids, 16).tokens


def test_smoothquant_sweep_on_cuda_keeps_block_checkpoints_and_resumes(tmp_path):
    from compress.resume import BlockCheckpoints

    recipe = parse("passes:\n  - smoothquant: {alpha: 0.5}\n  - rtn: {bits: 8, group_size: -1}\n")
    ids = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(1))
    runs = []
    for resume in (False, True):  # the second run reads both finished blocks back
        model = tiny("llama").to(CUDA)
        for p in recipe.passes:
            p.check(model)
        checkpoints = BlockCheckpoints(tmp_path / "out", {"k": 1}, resume)
        run_sequential(model, ids, recipe.passes, CUDA, checkpoints=checkpoints)
        runs.append(model.state_dict())
    assert all(torch.equal(runs[0][k], runs[1][k]) for k in runs[0])
