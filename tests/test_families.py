"""Decoder-only families on tiny random models: the block's linear groups and scaling mappings
are inferred from one traced forward (``arch.infer``), every method runs on them, the export
reloads in plain transformers to our logits, and our greedy decoding equals transformers'."""

import copy
import json
import re
import warnings

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from compress import lazy
from compress.arch import ARCHS, UnknownArchitecture, arch_of, infer
from compress.decode import greedy
from compress.evaluate import evaluate
from compress.export import export
from tests.conftest import _NoTokenizer, compress_with, export_and_reload

FAMILIES = {  # multi-head attention (kv heads = heads), so that v -> o folds where the family allows it
    "llama": {},
    "mistral": {},
    "qwen2": {},
    "qwen3": {},
    "gemma3_text": {"sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"]},
    "phi3": {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2},
    "granite": {"logits_scaling": 4.0, "residual_multiplier": 0.5, "embedding_multiplier": 2.0},
    "olmo2": {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2},
    # mixtures of experts: 4 experts, 2 per token; their fused 3-D weights become linears (compress/moe.py)
    "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 64},
    "olmoe": {
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "intermediate_size": 64,
        "pad_token_id": 0,
        "eos_token_id": 2,
    },
    # and a shared expert beside them, with a one-output gate
    "qwen2_moe": {
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 64,
    },
}
MOE = ("qwen3_moe", "mixtral", "olmoe", "qwen2_moe")
METHODS = {
    "rtn": "  - rtn: {bits: 4, group_size: 32}\n",
    "gptq": "  - gptq: {bits: 4, group_size: 32}\n",
    "awq": "  - awq: {bits: 4, group_size: 32, grid: 4}\n",
    "smoothquant": "  - smoothquant: {alpha: 0.5}\n  - rtn: {bits: 8, group_size: -1}\n",
    "sparsegpt 2:4": "  - sparsegpt: {pattern: '2:4'}\n",
    # float grids, in compressed-tensors' float layouts (compressed-tensors decompresses them on load)
    "rtn fp8": "  - rtn: {format: fp8}\n",
    "gptq nvfp4": "  - gptq: {format: nvfp4}\n",
    "awq mxfp4": "  - awq: {format: mxfp4, grid: 4}\n",
}


def family(model_type: str):
    kw = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=16,
        vocab_size=128,
        max_position_embeddings=256,
    )
    kw.update(FAMILIES[model_type])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **kw)).eval()
    for name, p in model.named_parameters():  # norms and biases away from their initial value: mistakes show
        if "norm" in name:
            p.data.normal_(0.5 if model_type.startswith("gemma") else 1.0, 0.3)
        elif name.endswith(".bias"):  # Qwen2's q/k/v
            p.data.normal_(0.0, 0.3)
    return model


@pytest.mark.parametrize("model_type", [t for t in FAMILIES if t in ARCHS])
def test_inference_finds_what_the_table_says(model_type):
    inferred, table = infer(family(model_type)), ARCHS[model_type]
    assert inferred.groups == table.groups
    assert set(inferred.scalings) == set(table.scalings)
    assert (inferred.norm_plus_one, inferred.layers, inferred.norm) == (table.norm_plus_one, table.layers, table.norm)


def test_what_inference_finds_on_families_the_table_does_not_name():
    phi3, olmo2 = infer(family("phi3")), infer(family("olmo2"))
    assert phi3.groups == (("self_attn.qkv_proj",), ("self_attn.o_proj",), ("mlp.gate_up_proj",), ("mlp.down_proj",))
    assert [(m.prev, m.linears) for m in phi3.scalings] == [  # fused q/k/v: v -> o cannot fold
        ("input_layernorm", ("self_attn.qkv_proj",)),
        ("post_attention_layernorm", ("mlp.gate_up_proj",)),
    ]
    # OLMo-2 normalises sublayer outputs, not inputs: no norm feeds a linear
    assert [(m.prev, m.linears) for m in olmo2.scalings] == [
        ("self_attn.v_proj", ("self_attn.o_proj",)),
        ("mlp.up_proj", ("mlp.down_proj",)),
    ]
    assert infer(family("granite")).scalings == infer(family("llama")).scalings
    qwen2_moe = arch_of(family("qwen2_moe"))  # the shared expert is an MLP like any; its one-output gate stays dense
    assert ("mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj") in qwen2_moe.groups
    assert not any("shared_expert_gate" in n for g in qwen2_moe.groups for n in g)
    assert ("mlp.experts.3.gate_proj", "mlp.experts.3.up_proj") in qwen2_moe.groups


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("model_type", FAMILIES)
def test_every_method_exports_what_transformers_reloads_to_our_logits(model_type, method, tmp_path):
    model = family(model_type)
    if "fp" in method:  # transformers decompresses FP4 to bf16 whatever the model's dtype: bf16 checkpoints' formats
        model = model.to(torch.bfloat16)
    ids = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(0))
    recipe = compress_with(model, METHODS[method], ids)
    if model_type in MOE and method in ("smoothquant", "gptq nvfp4"):
        # transformers 5.24 merges packed int4 and fp8 experts on load, not int8 (W8A8) ones, and NVFP4
        # experts under another expert's global scale: our reader
        export(model, _NoTokenizer(), tmp_path / "x", recipe.text, {})
        reloaded = lazy.open_model(tmp_path / "x", model.dtype).load_all()
    else:
        reloaded = export_and_reload(model, recipe, tmp_path / "x")
    probe = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        tolerance = 1e-4 if model.dtype == torch.float32 else 2e-2  # bf16: the same weights, computed apart
        torch.testing.assert_close(reloaded(probe).logits, model(probe).logits, rtol=tolerance, atol=tolerance)
    if model_type in MOE and method == "rtn":  # routers stay dense, listed under the checkpoint's names
        ignore = json.loads((tmp_path / "x" / "config.json").read_text())["quantization_config"]["ignore"]
        sparse_block = "block_sparse_moe" if model_type == "mixtral" else "mlp"
        assert f"model.layers.1.{sparse_block}.gate" in ignore


@pytest.mark.parametrize("model_type", FAMILIES)
def test_kivi_evaluation_and_greedy_decoding_run_on_every_family(model_type):
    model = family(model_type)
    windows = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(0))
    dense = evaluate(copy.deepcopy(model), None, data=windows, seqlen=32, windows=2, progress=False).ppl
    kivi = copy.deepcopy(model)
    compress_with(kivi, "  - kv_cache: {bits: 2, group_size: 16, residual: 0}\n")
    quantized = evaluate(kivi, None, data=windows, seqlen=32, windows=2, progress=False).ppl
    assert torch.isfinite(torch.tensor([dense, quantized])).all() and quantized != dense
    with torch.no_grad():  # our perplexity is transformers' (Granite's logit scaling, Gemma's soft-capping)
        logits = model(windows).logits[:, :-1].float()
    nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), windows[:, 1:].reshape(-1))
    assert dense == pytest.approx(nll.exp().item(), rel=1e-4)
    prompt = windows[0, :8]
    ours = greedy(model, prompt, 8).tokens
    theirs = model.generate(prompt[None], max_new_tokens=8, min_new_tokens=8, do_sample=False)[0, 8:].tolist()
    assert ours == theirs


def test_standard_errors_are_those_of_the_windows_mean_nll_and_of_its_paired_difference():
    model = family("llama")
    rounded = copy.deepcopy(model)
    compress_with(rounded, "  - rtn: {bits: 2, group_size: 16}\n")
    windows = torch.randint(0, 128, (5, 32), generator=torch.Generator().manual_seed(0))
    result = evaluate(rounded, None, data=windows, seqlen=32, windows=5, reference=model, progress=False)

    def window_nll(m):  # each window's mean NLL, as transformers computes it
        with torch.no_grad():
            logits = m(windows).logits[:, :-1].float()
        return torch.nn.functional.cross_entropy(logits.transpose(1, 2), windows[:, 1:], reduction="none").mean(1)

    mine, theirs = window_nll(rounded).double(), window_nll(model).double()
    n = len(windows)
    assert result.ppl == pytest.approx(mine.mean().exp().item(), rel=1e-4)
    assert result.ppl_se == pytest.approx(result.ppl * (mine.std() / n**0.5).item(), rel=1e-3)
    ratio = result.ppl / result.ref_ppl
    assert result.increase_se == pytest.approx(ratio * ((mine - theirs).std() / n**0.5).item(), rel=1e-3)
    assert 0 < result.increase_se < result.ppl_se / result.ppl  # pairing removes the windows' own difficulty
    one = evaluate(rounded, None, data=windows[:1], seqlen=32, windows=1, reference=model, progress=False)
    assert one.ppl_se is None and one.increase_se is None  # one window: no spread to measure


@pytest.mark.parametrize("model_type", FAMILIES)
def test_w4a4_nvfp4_with_an_fp8_kv_cache_calibrates_exports_and_reloads_on_every_family(model_type, tmp_path):
    """NVFP4 weights and inputs (calibrated global scales) and an FP8 KV cache (calibrated k/v scales):
    the scales land on every linear and attention, and our reader computes the model's logits."""
    from compress.kv_fp8 import KVScale
    from compress.kv_quant import attention_modules
    from compress.quant import InputScale

    model = family(model_type)
    for p in model.parameters():  # bf16 checkpoints' formats; the rotary tables stay float32
        p.data = p.data.to(torch.bfloat16)
    ids = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(0))
    passes = "  - rtn: {format: nvfp4}\n  - activations: {format: nvfp4}\n  - kv_fp8: {}\n"
    recipe = compress_with(model, passes, ids)
    assert all(KVScale.of(a) is not None for a in attention_modules(model))
    assert InputScale.of(model.model.layers[1].self_attn.o_proj) is not None
    export(model, _NoTokenizer(), tmp_path / "x", recipe.text, {})
    reloaded = lazy.open_model(tmp_path / "x", torch.float32).load_all()
    probe = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(probe).logits, model.float()(probe).logits, rtol=0, atol=0)


def test_an_unknown_model_type_is_inferred_and_one_without_linears_fails_before_compute():
    model = family("llama")
    model.config.model_type = "mystery"
    assert arch_of(model).scalings == infer(family("llama")).scalings

    class Matmul(torch.nn.Module):  # a linear layer that is not a torch.nn.Linear
        def __init__(self, linear):
            super().__init__()
            self.w = linear.weight

        def forward(self, x):
            return x @ self.w.T

    opaque = family("llama")
    opaque.config.model_type = "opaque"
    for block in opaque.model.layers:
        for parent in (block.self_attn, block.mlp):
            for name, child in list(parent.named_children()):
                if isinstance(child, torch.nn.Linear):
                    setattr(parent, name, Matmul(child))
    with pytest.raises(UnknownArchitecture, match="model_type 'opaque': its decoder block calls no torch.nn.Linear"):
        compress_with(opaque, METHODS["gptq"], torch.zeros(1, 8, dtype=torch.long))


def test_weights_outside_linears_are_named_not_silently_left_dense():
    moe = family("qwen3_moe")
    for block in moe.model.layers:  # a fused layout we do not know (an extra tensor): it stays fused
        block.mlp.experts.register_parameter("extra", torch.nn.Parameter(torch.zeros(4, 64, 2)))
    with pytest.warns(
        UserWarning, match="mlp.experts, mlp.gate hold .* outside torch.nn.Linear layers; no pass compresses"
    ):
        arch_of(moe)


def _starving(model_type="qwen3_moe"):
    """5 experts, 2 per token, router rows w, -w, v, -v, 0: two logits are always above expert 4's
    zero, so expert 4 never gets a token."""
    model = family(model_type)
    model.config.num_experts = 5
    model = AutoModelForCausalLM.from_config(model.config).eval()
    torch.manual_seed(0)
    for block in model.model.layers:
        w, v = torch.randn(2, 64)
        block.mlp.gate.weight.data = torch.stack([w, -w, v, -v, torch.zeros(64)])
    return model


@pytest.mark.parametrize("route_all", [False, True])
def test_an_expert_without_calibration_tokens_is_rounded_to_nearest_named_and_exported(route_all, tmp_path, capsys):
    from compress.pipeline import run_passes
    from compress.quant import fake_quantize
    from compress.recipe import parse

    model = _starving()
    arch_of(model)  # experts become linears
    original = {n: p.detach().clone() for n, p in model.named_parameters()}
    recipe = parse("passes:\n" + METHODS["gptq"])
    recipe.passes[0].check(model)
    ids = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run_passes(model, ids, recipe.passes, torch.device("cpu"), None, route_all_experts=route_all)
    printed = capsys.readouterr()
    starved = [str(w.message) for w in caught if "calibration tokens" in str(w.message)]
    for i in range(2):  # the counts, expert 4's zero among them
        assert re.search(
            rf"model.layers.{i}.mlp.experts: calibration tokens per expert: \d+ \d+ \d+ \d+ 0\n", printed.out
        )
    name = "model.layers.0.mlp.experts.4.down_proj.weight"
    rtn = fake_quantize(original[name], recipe.passes[0].scheme)
    if route_all:  # every expert saw every token: GPTQ ran on expert 4 too
        assert not starved and not torch.equal(model.get_parameter(name), rtn)
    else:
        assert len(starved) == 2 and "model.layers.0.mlp.experts: experts 4 received fewer than 16" in starved[0]
        assert torch.equal(model.get_parameter(name), rtn)
        busy = "model.layers.0.mlp.experts.0.down_proj.weight"
        assert not torch.equal(
            model.get_parameter(busy),
            fake_quantize(original[busy], recipe.passes[0].scheme),
        )
    reloaded = export_and_reload(model, recipe, tmp_path / "x")
    probe = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        tolerance = 1e-4 if model.dtype == torch.float32 else 2e-2  # bf16: the same weights, computed apart
        torch.testing.assert_close(reloaded(probe).logits, model(probe).logits, rtol=tolerance, atol=tolerance)


def test_a_hub_moe_checkpoint_is_read_block_by_block_and_decodes_as_transformers_does(tmp_path):
    model = family("mixtral")
    model.save_pretrained(tmp_path / "m")  # experts one by one under block_sparse_moe, as on the hub
    streamed = lazy.open_model(tmp_path / "m", torch.float32)
    ours = streamed.load_all()
    assert "mlp.experts.3.w2" in dict(ours.model.layers[0].named_modules())
    probe = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(ours(probe).logits, model(probe).logits, rtol=1e-5, atol=1e-5)
    prompt = probe[0, :6]
    theirs = model.generate(prompt[None], max_new_tokens=8, min_new_tokens=8, do_sample=False)[0, 6:].tolist()
    assert greedy(ours, prompt, 8).tokens == theirs


@pytest.mark.slow
def test_apply_on_a_moe_checkpoint_prints_expert_tokens_warns_and_exports(tmp_path):
    """End to end on the command line: scripts/tiny_moe.py's model (an expert the router never
    picks), `compress apply` with GPTQ, then `compress eval` on the export."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    make = [sys.executable, str(root / "scripts" / "tiny_moe.py"), str(tmp_path / "moe"), "--experts", "5"]
    assert subprocess.run([*make, "--idle-expert"], capture_output=True, text=True).returncode == 0
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        "passes:\n  - gptq: {bits: 4, group_size: 64}\ncalibration: {samples: 4, seqlen: 128}\n"
        "evaluation: {seqlen: 128, windows: 2}\n"
    )
    cli = [sys.executable, "-m", "compress.cli"]
    out = tmp_path / "out"
    done = subprocess.run(
        [*cli, "apply", str(recipe), "--model", str(tmp_path / "moe"), "--output", str(out)],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert re.search(r"model.layers.1.mlp.experts: calibration tokens per expert: \d+ \d+ \d+ \d+ 0\n", done.stdout)
    assert "model.layers.0.mlp.experts: experts 4 received fewer than 16 calibration tokens" in done.stderr
    report = json.loads((out / "report.json").read_text())
    evaluated = subprocess.run(
        [*cli, "eval", str(out), "--windows", "2", "--seqlen", "128"], capture_output=True, text=True
    )
    assert evaluated.returncode == 0, evaluated.stderr[-2000:]
    ppl = float(evaluated.stdout.split("perplexity: ")[1].split()[0])
    assert abs(ppl - report["eval"]["ppl"]) < 1e-3 * ppl  # the reloaded export scores what apply measured
