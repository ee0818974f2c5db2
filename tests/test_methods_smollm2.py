"""Each quantizer against its paper's claim on the real SmolLM2: GPTQ and AWQ beat RTN at equal bits.

Small budget (16 calibration samples × 256 tokens, 4 × 512 evaluation tokens) so the suite
stays fast; the full protocol lives in scripts/bench_recipes.py and the README tables.
"""

import copy

import pytest
import torch

from compress.data import calibration_batches
from compress.evaluate import evaluate
from compress.pipeline import run_sequential
from compress.recipe import parse

W3 = "bits: 3, group_size: 64"
RECIPES = {
    "rtn": f"  - rtn: {{{W3}}}\n",
    "gptq": f"  - gptq: {{{W3}, true_sequential: false}}\n",
    "awq": f"  - awq: {{{W3}, search_tokens: 1024}}\n",
}


@pytest.fixture(scope="module")
def w3_ppl(smollm2):
    ids, _ = calibration_batches(smollm2.model, smollm2.tokenizer, "wikitext2", 16, 256, seed=0)
    out = {}
    for name, passes in RECIPES.items():
        model = copy.deepcopy(smollm2.model)
        recipe = parse("passes:\n" + passes)
        for p in recipe.passes:
            p.check(model)
        run_sequential(model, ids, recipe.passes, torch.device("cpu"))
        out[name] = evaluate(model, smollm2.tokenizer, seqlen=512, windows=4, progress=False).ppl
    return out


def test_gptq_w3_beats_rtn_w3(w3_ppl):
    assert w3_ppl["gptq"] < 0.9 * w3_ppl["rtn"], w3_ppl


def test_awq_w3_beats_rtn_w3(w3_ppl):
    assert w3_ppl["awq"] < 0.9 * w3_ppl["rtn"], w3_ppl
