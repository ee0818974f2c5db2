"""Each quantizer against its paper's claim on the real SmolLM2 at equal bits.

GPTQ beats RTN on perplexity. AWQ beats RTN on its own objective (the error of each block's
output) in every block checked; its end-to-end perplexity on SmolLM2 W3 is not yet below
RTN's (README, Known limits), so that is not asserted here.

Small budget (16 calibration samples × 256 tokens, 4 × 512 evaluation tokens, the first
ten of the thirty blocks) so the suite
stays fast; the full protocol lives in scripts/bench_recipes.py and the README tables.
"""

import copy

import pytest
import torch

from compress.data import calibration_batches
from compress.models import cast_params
from compress.recipe import parse
from tests.conftest import compress_with, ppl

# blocks 0-9 only (the rest are ignored) keeps the test to about a minute on two cores
W3 = "bits: 3, group_size: 64, ignore: [lm_head, 're:layers\\.[12]\\d\\.']"
RECIPES = {
    "rtn": f"  - rtn: {{{W3}}}\n",
    "gptq": f"  - gptq: {{{W3}, true_sequential: false}}\n",
}


@pytest.fixture(scope="module")
def w3_ppl(smollm2):
    ids, _ = calibration_batches(smollm2.model, smollm2.tokenizer, "wikitext2", 16, 256, seed=0)
    out = {}
    for name, passes in RECIPES.items():
        model = copy.deepcopy(smollm2.model)
        compress_with(model, passes, ids)
        out[name] = ppl(model, smollm2.tokenizer)
    return out


def test_gptq_w3_beats_rtn_w3(w3_ppl):
    assert w3_ppl["gptq"] < 0.9 * w3_ppl["rtn"], w3_ppl


def test_awq_lowers_block_output_error_vs_rtn(smollm2):
    from compress.pipeline import BlockData, capture_inputs

    ids, _ = calibration_batches(smollm2.model, smollm2.tokenizer, "wikitext2", 16, 256, seed=0)
    cpu = torch.device("cpu")
    inputs, calls = capture_inputs(smollm2.model, ids, cpu, torch.float32)
    block = cast_params(copy.deepcopy(smollm2.model.model.layers[0]), cpu, torch.float32)
    reference = BlockData(block, inputs, calls[0]).forward()
    errors = {}
    for name, passes in {"rtn": "  - rtn: {bits: 3, group_size: 64}\n",
                         "awq": "  - awq: {bits: 3, group_size: 64, clip: false}\n"}.items():
        candidate = copy.deepcopy(block)
        recipe = parse("passes:\n" + passes)
        recipe.passes[0].check(smollm2.model)
        data = BlockData(candidate, inputs, calls[0])
        recipe.passes[0].apply(candidate, data, "model.layers.0.")
        errors[name] = sum((o.float() - r.float()).pow(2).mean().item() for o, r in zip(data.forward(), reference))
    assert errors["awq"] < 0.9 * errors["rtn"], errors  # measured: 4.11 vs 5.14
