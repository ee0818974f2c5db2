"""Low-rank factorisation (SVD, ASVD, SVD-LLM) and LoRC: exactness, export, reload."""

import json

import pytest
import torch

from compress import factored, models
from compress.export import export
from compress.factored import Factored, allocate_ranks, factors, rank_for_ratio, whitened_svd
from compress.hessian import Hessian
from compress.passes import RecipeError
from compress.recipe import parse
from tests.conftest import _NoTokenizer, compress_with, export_and_reload, tiny

IDS = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(0))


def _logits(model, ids=IDS[:1]):
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("m,n,ratio", [(1536, 576, 0.8), (576, 1536, 0.8), (64, 192, 0.5), (640, 2048, 0.3)])
def test_rank_for_ratio_is_the_largest_rank_within_the_budget(m, n, ratio):
    r = rank_for_ratio(m, n, ratio)
    assert r * (m + n) <= ratio * m * n < (r + 1) * (m + n)
    assert rank_for_ratio(n, m, ratio) == r  # the factors' size is symmetric in m and n


def test_full_rank_reproduces_the_layer():
    torch.manual_seed(0)
    W, X = torch.randn(48, 80), torch.randn(500, 80) * torch.rand(80) * 3
    H = Hessian(torch.nn.Linear(80, 48))
    H.add(X)
    whitenings = {
        "svd": (None, False),
        "asvd": (X.abs().mean(0).sqrt(), True),
        "svdllm": (torch.linalg.cholesky(H.H).float(), False),
    }
    for method, (S, diagonal) in whitenings.items():
        B, A = factors(*whitened_svd(W, S, diagonal), 48, S, diagonal)
        torch.testing.assert_close(B @ A, W, atol=2e-5, rtol=0, msg=method)


def test_whitened_truncation_error_is_the_dropped_singular_values():
    """SVD-LLM's point: with S = chol(XᵀX), the output error ‖(W − BA)Xᵀ‖² is Σ_{i>r} σ_i²."""
    torch.manual_seed(0)
    W, X = torch.randn(32, 64, dtype=torch.float64), torch.randn(400, 64, dtype=torch.float64)
    S = torch.linalg.cholesky(X.T @ X)
    U, sigma, Vh = torch.linalg.svd(W @ S, full_matrices=False)
    B, A = factors(U, sigma, Vh, 10, S)
    error = ((W - B @ A) @ X.T).pow(2).sum()
    torch.testing.assert_close(error, sigma[10:].pow(2).sum(), rtol=1e-8, atol=0)


def test_sensitivity_allocation_spends_the_budget_where_energy_is():
    flat, steep = torch.ones(32), torch.logspace(0, -4, 32)  # steep: a few values carry all the energy
    ranks = allocate_ranks({"flat": (flat, 32, 32), "steep": (steep, 32, 32)}, budget=24 * 64)
    assert ranks["flat"] > ranks["steep"]
    assert (ranks["flat"] + ranks["steep"]) * 64 <= 24 * 64


@pytest.mark.parametrize("method", ["svd", "asvd", "svdllm"])
def test_factored_export_reloads_to_the_same_logits(method, tmp_path):
    model = tiny("llama")
    recipe = compress_with(model, f"  - lowrank: {{method: {method}, ratio: 0.5}}\n", IDS)
    mlp = model.model.layers[0].mlp
    assert isinstance(mlp.down_proj, Factored)
    assert sum(p.numel() for p in mlp.parameters()) <= 0.5 * 3 * 64 * 128
    out = export(model, _NoTokenizer(), tmp_path / "x", recipe.text, {})
    assert "model.layers.0.mlp.down_proj" in json.loads((out / "config.json").read_text())[factored.CONFIG_KEY]
    assert torch.equal(_logits(models.load_model(out, torch.float32)), _logits(model))
    assert torch.equal(_logits(_rebuild_as_documented(out)), _logits(model))


def test_merged_lowrank_exports_dense_weights(tmp_path):
    model = tiny("llama")
    recipe = compress_with(model, "  - lowrank: {method: svd, ratio: 0.5, merge: true}\n")
    W = model.model.layers[0].mlp.down_proj.weight
    assert torch.linalg.matrix_rank(W) == rank_for_ratio(64, 128, 0.5)
    reloaded = export_and_reload(model, recipe, tmp_path / "x")
    assert factored.CONFIG_KEY not in reloaded.config.to_dict()
    assert torch.equal(_logits(reloaded), _logits(model))


def _rebuild_as_documented(folder):
    """docs/formats.md's recipe for loading a factored export in plain transformers (keep the two in step)."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(folder)
    model = AutoModelForCausalLM.from_config(config)
    for name, rank in config.compress_lowrank.items():
        parent, _, leaf = name.rpartition(".")
        dense = model.get_submodule(name)
        setattr(
            model.get_submodule(parent),
            leaf,
            torch.nn.Sequential(
                torch.nn.Linear(dense.in_features, rank, bias=False),
                torch.nn.Linear(rank, dense.out_features, bias=dense.bias is not None),
            ),
        )
    model.load_state_dict(load_file(folder / "model.safetensors"), strict=False)
    model.tie_weights()
    return model.eval()


def test_lorc_lowers_the_weight_error_and_its_adapter_loads_with_peft(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    model, original = tiny("llama"), tiny("llama")
    recipe = compress_with(model, "  - rtn: {bits: 3, group_size: 32}\n  - lorc: {rank: 8}\n")
    for name, lin in model.named_modules():
        if getattr(lin, "lora", None) is not None:
            W = original.get_submodule(name).weight
            B, A = lin.lora.B, lin.lora.A
            assert (W - lin.weight).norm() < (W - (lin.weight - B @ A)).norm(), name
    out = export(model, _NoTokenizer(), tmp_path / "x", recipe.text, {})
    base = AutoModelForCausalLM.from_pretrained(out, quantization_config=CompressedTensorsConfig(dequantize=True))
    with_adapter = PeftModel.from_pretrained(base, out / "adapter")
    torch.testing.assert_close(_logits(with_adapter), _logits(model), atol=1e-5, rtol=0)
    torch.testing.assert_close(_logits(models.load_model(out, torch.float32)), _logits(model), atol=1e-5, rtol=0)


def test_lorc_with_whitening_lowers_the_output_error_more():
    outputs = {}
    for method in ("svd", "svdllm"):
        model = tiny("llama")
        compress_with(model, f"  - rtn: {{bits: 3, group_size: 32}}\n  - lorc: {{rank: 8, method: {method}}}\n", IDS)
        outputs[method] = _logits(model, IDS)
    dense = _logits(tiny("llama"), IDS)
    assert (outputs["svdllm"] - dense).norm() < (outputs["svd"] - dense).norm()


@pytest.mark.parametrize(
    "passes,message",
    [
        (
            "  - lowrank: {ratio: 0.5}\n  - rtn: {bits: 4}\n",
            r"passes\[0\].lowrank: factored layers cannot be combined with other passes \(passes\[1\].rtn\)",
        ),
        ("  - lorc: {rank: 4}\n", r"passes\[0\].lorc: LoRC corrects quantization error; put a quantization pass"),
        ("  - rtn: {bits: 4}\n  - lorc: {rank: 4}\n  - wanda: {sparsity: 0.5}\n", r"LoRC must be the last pass"),
    ],
)
def test_bad_combinations_are_refused(passes, message):
    with pytest.raises(RecipeError, match=message):
        parse("passes:\n" + passes)
