"""Decoder-only families on tiny random models: the block's linear groups and scaling mappings
are inferred from one traced forward (``arch.infer``), every method runs on them, the export
reloads in plain transformers to our logits, and our greedy decoding equals transformers'."""

import copy

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from compress.arch import ARCHS, UnknownArchitecture, arch_of, infer
from compress.decode import greedy
from compress.evaluate import evaluate
from tests.conftest import compress_with, export_and_reload

FAMILIES = {  # multi-head attention (kv heads = heads), so that v -> o folds where the family allows it
    "llama": {},
    "mistral": {},
    "qwen2": {},
    "qwen3": {},
    "gemma3_text": {"sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"]},
    "phi3": {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2},
    "granite": {"logits_scaling": 4.0, "residual_multiplier": 0.5, "embedding_multiplier": 2.0},
    "olmo2": {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2},
}
METHODS = {
    "rtn": "  - rtn: {bits: 4, group_size: 32}\n",
    "gptq": "  - gptq: {bits: 4, group_size: 32}\n",
    "awq": "  - awq: {bits: 4, group_size: 32, grid: 4}\n",
    "smoothquant": "  - smoothquant: {alpha: 0.5}\n  - rtn: {bits: 8, group_size: -1}\n",
    "sparsegpt 2:4": "  - sparsegpt: {pattern: '2:4'}\n",
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
        **FAMILIES[model_type],
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **kw)).eval()
    for name, p in model.named_parameters():  # norms away from their initial value: folding mistakes show
        if "norm" in name:
            p.data.normal_(0.5 if model_type.startswith("gemma") else 1.0, 0.3)
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


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("model_type", FAMILIES)
def test_every_method_exports_what_transformers_reloads_to_our_logits(model_type, method, tmp_path):
    model = family(model_type)
    ids = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(0))
    recipe = compress_with(model, METHODS[method], ids)
    reloaded = export_and_reload(model, recipe, tmp_path / "x")
    probe = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(probe).logits, model(probe).logits, rtol=1e-4, atol=1e-4)


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
    kw = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=64, num_hidden_layers=2)
    kw.update(num_attention_heads=4, num_key_value_heads=4, head_dim=16, vocab_size=128, num_experts=4)
    moe = AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen3_moe", **kw, num_experts_per_tok=2))
    with pytest.warns(
        UserWarning, match="mlp.experts, mlp.gate hold .* outside torch.nn.Linear layers; no pass compresses"
    ):
        infer(moe)
