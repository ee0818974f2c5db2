"""RTN and export on the real SmolLM2-135M, on a short protocol (4 windows × 512 tokens)."""

import copy

import pytest
import torch

from tests.conftest import compress_with, ppl

WINDOWS, SEQLEN = 4, 512


def _rtn(model, options: str):
    return compress_with(model, f"  - rtn: {options}\n")


@pytest.fixture(scope="module")
def ppls(smollm2):
    """Perplexity of RTN variants of the real model, computed once per module."""
    results = {"dense": ppl(copy.deepcopy(smollm2.model), smollm2.tokenizer, WINDOWS, SEQLEN)}
    for name, options in {
        "w8": "{bits: 8, group_size: -1}",
        "w4g64": "{bits: 4, group_size: 64}",
        "w4ch": "{bits: 4, group_size: -1}",
    }.items():
        model = copy.deepcopy(smollm2.model)
        _rtn(model, options)
        results[name] = ppl(model, smollm2.tokenizer, WINDOWS, SEQLEN)
    return results


def test_w8_within_one_percent_of_dense(ppls):
    assert abs(ppls["w8"] / ppls["dense"] - 1) < 0.01, ppls


def test_w4_group64_worse_than_w8(ppls):
    assert ppls["w4g64"] > ppls["w8"] * 1.02, ppls


def test_w4_per_channel_worse_than_group64(ppls):
    assert ppls["w4ch"] > ppls["w4g64"] * 1.02, ppls


def test_export_reloads_in_plain_transformers(smollm2, smollm2_copy, tmp_path):
    """The exported folder loads with no code of ours; logits equal the in-memory model's."""
    from transformers import AutoModelForCausalLM

    from compress.export import MANIFEST, export

    recipe = _rtn(smollm2_copy, "{bits: 4, group_size: 64}")
    out = export(smollm2_copy, smollm2.tokenizer, tmp_path / "w4", recipe.text, {"base_model": "smollm2-135m"})
    assert {"model.safetensors", "config.json", "recipe.yaml", MANIFEST, "tokenizer.json"} <= {
        p.name for p in out.iterdir()
    }
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
    ids = smollm2.tokenizer("The capital of France is Paris, and the", return_tensors="pt").input_ids
    with torch.no_grad():
        diff = (reloaded(ids).logits.float() - smollm2_copy(ids).logits.float()).abs().max().item()
    assert diff <= 1e-3, diff  # measured: 0.0 (the same bf16 weights, the same kernels)


def test_data_free_calibration_is_deterministic(smollm2):
    from compress.data import _self_generated

    a = _self_generated(smollm2.model, smollm2.tokenizer, samples=2, seqlen=12, seed=3)
    b = _self_generated(smollm2.model, smollm2.tokenizer, samples=2, seqlen=12, seed=3)
    assert a.shape == (2, 12) and torch.equal(a, b)
    assert not torch.equal(a, _self_generated(smollm2.model, smollm2.tokenizer, samples=2, seqlen=12, seed=4))
