"""Early exit (CALM): a threshold that never exits is the full model; exits keep the cache complete."""

import pytest
import torch
from transformers import DynamicCache

from compress.decode import greedy
from compress.decode.early_exit import calibrate, default_exits, early_exit_greedy
from tests.conftest import tiny

PROMPT = torch.randint(0, 128, (1, 20), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("model_type", ["llama", "gemma3_text"])  # Gemma-3: a sliding window of 8 < the prompt
def test_a_threshold_that_never_exits_is_plain_greedy(model_type):
    model = tiny(model_type, layers=4)
    plain = greedy(model, PROMPT, 24)
    for measure in ("softmax", "saturation"):
        result = early_exit_greedy(model, PROMPT, 24, threshold=2.0, exits=[0, 1, 2], measure=measure)
        assert result.tokens == plain.tokens and result.extra["mean_layers"] == 4


@pytest.mark.parametrize("model_type", ["llama", "gemma3_text"])
def test_exits_skip_layers_and_leave_every_layer_of_the_cache_filled(model_type):
    model = tiny(model_type, layers=4)
    cache = DynamicCache(config=model.config)
    result = early_exit_greedy(model, PROMPT, 16, threshold=-1.0, exits=[1], cache=cache)
    assert result.extra["mean_layers"] == 2  # every generated token left after layer 1
    seen = PROMPT.shape[1] + len(result.tokens) - 1  # the last token is emitted, never fed
    window = getattr(model.config, "sliding_window", None) or seen  # sliding layers keep window - 1
    expected = [
        min(seen, window - 1) if t == "sliding_attention" else seen
        for t in getattr(model.config, "layer_types", None) or ["full_attention"] * 4
    ]
    assert [layer.keys.shape[-2] for layer in cache.layers] == expected


@pytest.mark.parametrize("model_type", ["llama", "gemma3_text"])
def test_early_exit_on_the_engine_decodes_as_on_transformers_forward(model_type):
    """The engine's early exit (skipped layers write only their keys and values) gives the tokens
    of the transformers path, exiting or not."""
    from compress.decode.engine import Engine

    model = tiny(model_type, layers=4)
    engine = Engine(model, kernel="fp32")
    for threshold, layers in ((2.0, 4), (-1.0, 2)):  # never exit; always after layer 1
        on_engine = early_exit_greedy(engine, PROMPT, 16, threshold=threshold, exits=[1])
        assert on_engine.tokens == early_exit_greedy(model, PROMPT, 16, threshold=threshold, exits=[1]).tokens
        assert on_engine.extra["mean_layers"] == layers
    assert early_exit_greedy(engine, PROMPT, 16, threshold=2.0, exits=[1]).tokens == greedy(model, PROMPT, 16).tokens


@pytest.mark.parametrize("model_type", ["llama", "gemma3_text"])
def test_calibrated_threshold_keeps_the_agreement_it_promises(model_type):
    model = tiny(model_type, layers=4)
    ids = torch.randint(0, 128, (2, 64), generator=torch.Generator().manual_seed(1))
    found = calibrate(model, ids, exits=[1, 2], target=0.8)
    assert found["agreement"] >= 0.8 and 2 <= found["mean_layers"] <= 4
    assert calibrate(model, ids, exits=[1, 2], target=1.01)["threshold"] == float("inf")  # unreachable: never exit
    assert default_exits(30) == [14, 21]
