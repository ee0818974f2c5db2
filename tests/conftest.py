"""Shared fixtures: a tiny random model of each supported shape, and the real SmolLM2."""

import copy

import pytest
import torch


def tiny(model_type: str = "llama", hidden: int = 64, layers: int = 2):
    from transformers import AutoConfig, AutoModelForCausalLM

    kw = dict(
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden // 4,
        vocab_size=128,
        max_position_embeddings=256,
    )
    if model_type == "gemma3_text":
        kw.update(sliding_window=8, layer_types=["sliding_attention", "full_attention"][:layers] * (layers // 2 or 1))
    config = AutoConfig.for_model(model_type, **kw)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    if model_type == "gemma3_text":  # zero-initialised norms would hide (1 + w) mistakes
        for n, p in model.named_parameters():
            if "norm" in n:
                p.data.normal_(0, 0.3)
    return model


def tiny_folder(
    folder, tokenizer, model_type: str = "llama", layers: int = 2, weight_scale: float = 1.0, hidden: int = 64
):
    """A tiny random model with ``tokenizer``'s vocabulary saved as a model folder (bf16), for
    runs of the command line. ``weight_scale`` multiplies its matrices: the random init's outputs
    are near uniform, so that a KL against them is float noise."""
    model = tiny(model_type, hidden, layers)
    model.resize_token_embeddings(len(tokenizer))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(weight_scale)
    model.to(torch.bfloat16).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def smollm2():
    """The real SmolLM2-135M (bf16) and its tokenizer, loaded once; tests deep-copy the model."""
    from compress import models

    loaded = models.load("smollm2-135m")
    return loaded


@pytest.fixture
def smollm2_copy(smollm2):
    return copy.deepcopy(smollm2.model)


def compress_with(model, passes_yaml: str, ids=None):
    """Parse a `passes:` list, check it against the model and run it in place (a recovery pass's
    teacher is a copy of the model from before)."""
    from compress.lazy import streamed
    from compress.passes import ModelPass
    from compress.pipeline import run_passes
    from compress.recipe import parse

    recipe = parse("passes:\n" + passes_yaml)
    for p in recipe.passes:
        p.check(model)
    original = copy.deepcopy(model) if any(isinstance(p, ModelPass) for p in recipe.passes) else None
    model, ids = streamed(model), ids if recipe.needs_data else None
    for p in recipe.passes:  # as apply does: prepared, then fitted on the calibration samples
        p.prepare(model)
    for p in recipe.passes:
        p.fit(model, ids, recipe.passes, torch.device("cpu"))
    run_passes(model, ids, recipe.passes, torch.device("cpu"), lambda: original)
    return recipe


def ppl(model, tokenizer, windows: int = 4, seqlen: int = 512) -> float:
    """Perplexity on a short protocol, computed as `compress` does (float32 on the CPU); casts ``model`` in place."""
    from compress.evaluate import evaluate
    from compress.models import for_compute

    return evaluate(
        for_compute(model, torch.device("cpu")), tokenizer, seqlen=seqlen, windows=windows, progress=False
    ).ppl


class _NoTokenizer:
    def save_pretrained(self, path):
        pass


def export_and_reload(model, recipe, folder, dtype=None):
    """Export ``model`` (tiny models have no tokenizer) and load it back with plain transformers."""
    from transformers import AutoModelForCausalLM

    from compress.export import export

    out = export(model, _NoTokenizer(), folder, recipe.text, {})
    reloaded = AutoModelForCausalLM.from_pretrained(out, **({"dtype": dtype} if dtype else {}))
    with torch.no_grad():
        reloaded(torch.zeros(1, 1, dtype=torch.long))  # compressed-tensors decompresses on the first forward
    return reloaded


def reloads_to_our_logits(model, folder, reloaded):
    """Our reader and transformers compute ``model``'s logits from the export, in float32 as `compress
    eval` computes (in bfloat16 compressed-tensors would divide by the scales in bfloat16)."""
    from compress import lazy, models

    probe = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    streamed = lazy.open_model(folder, torch.float32).load_all()
    whole = models.load_model(folder, torch.float32)  # what decode and bench_recipes score
    with torch.no_grad():
        ours = model.float()(probe).logits
        transformers = torch.nn.Module.float(reloaded)  # it refuses .float() on a quantized model
        for other in (streamed, whole, transformers):
            torch.testing.assert_close(other(probe).logits, ours, rtol=0, atol=0)


def pytest_collection_modifyitems(config, items):
    """A test that takes the real SmolLM2 through a fixture is ``slow`` (``-m "not slow"``: the fast lane)."""
    for item in items:
        if {"smollm2", "smollm2_copy"} & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
