"""Rotations fused into the weights: the rotated model computes what the original did."""

import copy

import pytest
import torch

from compress import models
from compress.apply import apply
from compress.passes import RecipeError
from compress.recipe import parse
from tests.conftest import compress_with, export_and_reload, tiny, tiny_folder

PROBE = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))


def _logits(model):
    with torch.no_grad():
        return model(PROBE).logits


def _spread(model, outliers: float = 30.0):
    """Norm weights far from 1 and an outlying residual channel: what makes folding and rotating matter."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + torch.rand(p.shape, generator=g))
        model.get_input_embeddings().weight[:, 3] *= outliers
    return model


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
@pytest.mark.parametrize("hidden", [64, 48])  # 48 = 12 × 4: a Paley base; head dimensions 16 and 12
@pytest.mark.parametrize("kind", ["hadamard", "random_hadamard"])
def test_a_rotated_model_gives_the_original_logits(family, hidden, kind):
    model = _spread(tiny(family, hidden=hidden))
    before = _logits(model)
    embedding = model.get_input_embeddings().weight.clone()
    compress_with(model, f"  - rotate: {{kind: {kind}}}\n")
    torch.testing.assert_close(_logits(model), before, rtol=0, atol=2e-5 * before.abs().max().item())
    assert not model.config.tie_word_embeddings
    assert model.lm_head.weight is not model.get_input_embeddings().weight
    rotated = model.get_input_embeddings().weight
    assert rotated[:, 3].abs().max() < 0.5 * embedding[:, 3].abs().max()  # the outlying channel spread out


def test_gemma3_rotates_its_values_and_refuses_its_residual_stream():
    model = _spread(tiny("gemma3_text"))
    before = _logits(model)
    compress_with(model, "  - rotate: {residual: false}\n")
    torch.testing.assert_close(_logits(model), before, rtol=0, atol=2e-5 * before.abs().max().item())
    with pytest.raises(RecipeError, match="normalizes its output with a weight of its own"):
        compress_with(tiny("gemma3_text"), "  - rotate: {}\n")


def test_the_rotated_export_reloads_in_transformers_to_the_original_logits(tmp_path):
    model = _spread(tiny("llama"))
    before = _logits(model)
    recipe = compress_with(model, "  - rotate: {kind: random_hadamard, seed: 3}\n")
    reloaded = export_and_reload(model, recipe, tmp_path / "out")
    torch.testing.assert_close(_logits(reloaded), before, rtol=0, atol=2e-5 * before.abs().max().item())


@pytest.mark.parametrize(
    "family,options",
    [
        ("llama", "{down: true}"),
        ("qwen2", "{down: true, kind: random_hadamard}"),
        ("gemma3_text", "{residual: false, down: true}"),
    ],
)
def test_the_online_down_rotation_gives_the_original_logits_and_reloads_everywhere_to_ours(family, options, tmp_path):
    """R4: down_proj's weight holds W R4 and its input is rotated at run time. The export names the
    rotation as compressed-tensors' hadamard transform: our reader, our decoder and transformers
    with compressed-tensors' ``apply_transform_config`` compute our logits and tokens."""
    import json

    from compressed_tensors.transform import TransformConfig, apply_transform_config

    from compress import hadamard, lazy
    from compress.decode import greedy
    from compress.decode.engine import Engine

    model = _spread(tiny(family))
    before = _logits(model)
    recipe = compress_with(model, f"  - rotate: {options}\n")
    down = model.model.layers[0].mlp.down_proj
    assert hadamard.InputRotation.of(down) is not None
    torch.testing.assert_close(_logits(model), before, rtol=0, atol=2e-5 * before.abs().max().item())
    reloaded = export_and_reload(model, recipe, tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    (group,) = config["transform_config"]["config_groups"].values()
    assert group["type"] == "hadamard" and group["head_dim"] == hadamard.block_size(down.in_features)
    assert group["apply"][0]["location"] == "input" and len(group["apply"][0]["targets"]) == 2
    apply_transform_config(reloaded, TransformConfig.model_validate(config["transform_config"]))
    streamed = lazy.open_model(tmp_path / "out", torch.float32).load_all()
    whole = models.load_model(tmp_path / "out", torch.float32)
    ours = _logits(model)
    for other in (reloaded, streamed, whole):
        torch.testing.assert_close(_logits(other), ours, rtol=0, atol=1e-5 * ours.abs().max().item())
    prompt = PROBE[:1]
    tokens = greedy(Engine(whole, kernel="fp32"), prompt, 12).tokens
    expected = model.generate(prompt, max_new_tokens=12, min_new_tokens=12, do_sample=False)[0, prompt.shape[1] :]
    assert tokens == expected.tolist()


def test_the_online_down_rotation_refuses_passes_that_fold_into_it():
    with pytest.raises(RecipeError, match="drop down: true or that pass"):
        parse("passes:\n  - rotate: {down: true}\n  - awq: {bits: 4}\n")
    parse("passes:\n  - rotate: {down: true}\n  - gptq: {bits: 4}\n  - activations: {format: int, bits: 4}\n")


def test_int4_activations_lose_less_after_a_rotation_on_an_outlying_channel():
    """QuaRot's point: one channel 100× the rest sets every token's int4 scale, so the other channels
    round to a few levels; spread over all channels by R1, the same rounding loses far less."""
    reference = _logits(_spread(tiny("llama"), 100.0))

    def kl_with(passes: str) -> float:
        model = _spread(tiny("llama"), 100.0)
        compress_with(model, passes + "  - activations: {format: int, bits: 4}\n")
        logp = torch.log_softmax(_logits(model), -1)
        return torch.nn.functional.kl_div(
            logp, torch.log_softmax(reference, -1), log_target=True, reduction="batchmean"
        ).item()

    rtn = "  - rtn: {bits: 4, symmetric: true, group_size: 16}\n"
    plain, rotated = kl_with(rtn), kl_with("  - rotate: {}\n" + rtn)
    assert rotated < 0.5 * plain, (rotated, plain)


@pytest.fixture(scope="module")
def folder(tmp_path_factory, smollm2):
    return tiny_folder(tmp_path_factory.mktemp("model"), smollm2.tokenizer, layers=2, weight_scale=3.0)


def test_apply_rotates_each_block_as_read_and_later_passes_see_the_rotated_model(folder, tmp_path):
    """Streamed from disk: a rotated dense export computes the original's logits; a rotated GPTQ
    export is a different rounding of the same function."""
    original = models.load(str(folder), torch.float32).model
    rotated = tmp_path / "rotated"
    apply(parse("passes:\n  - rotate: {}\n"), str(folder), rotated, "cpu", dtype="float32", evaluate_after=False)
    reloaded = models.load(str(rotated), torch.float32).model
    before = _logits(original)
    torch.testing.assert_close(_logits(reloaded), before, rtol=0, atol=2e-5 * before.abs().max().item())
    text = "calibration: {samples: 4, seqlen: 64}\npasses:\n  - rotate: {}\n  - gptq: {bits: 4, group_size: 16}\n"
    report = apply(parse(text), str(folder), tmp_path / "gptq", "cpu", dtype="float32", evaluate_after=False)
    assert "rotate" in report.method and "gptq" in report.method
    quantized = models.load(str(tmp_path / "gptq"), torch.float32).model
    assert not quantized.config.tie_word_embeddings
    error = (_logits(quantized) - before).abs().mean()
    assert 0 < error < 0.5 * before.abs().mean()


@pytest.mark.parametrize(
    ("passes", "message"),
    [
        ("  - rtn: {bits: 4}\n  - rotate: {}\n", "must come first"),
        ("  - rotate: {residual: false, values: false}\n", "rotates nothing"),
        ("  - rotate: {kind: learned}\n", "trains against the weight quantizer after it"),
        ("  - rotate: {steps: 10}\n  - rtn: {bits: 4}\n", "steps and lr are options of kind: learned"),
    ],
)
def test_a_misplaced_or_empty_rotation_is_refused_when_read(passes, message):
    with pytest.raises(RecipeError, match=message):
        parse("passes:\n" + passes)


LEARN_AGAINST = "  - rtn: {bits: 3, symmetric: true, group_size: 16}\n  - activations: {format: int, bits: 4}\n"
LEARN_IDS = torch.randint(0, 128, (8, 32), generator=torch.Generator().manual_seed(2))


@pytest.mark.parametrize(
    "family,options",
    [
        ("llama", "{kind: learned, steps: 3, lr: 1.5, down: true}"),
        ("gemma3_text", "{kind: learned, residual: false, steps: 3, lr: 1.5}"),
    ],
)
def test_learned_rotations_stay_rotations_and_keep_the_dense_function(family, options):
    """SpinQuant's R1 and per-layer R2 after training, before anything rounds: orthogonal to float64
    precision, moved from their random Hadamard start, and the model computes what it did."""
    from compress.lazy import streamed

    model = _spread(tiny(family))
    before = _logits(model)
    recipe = parse(f"passes:\n  - rotate: {options}\n" + LEARN_AGAINST)
    rotate = recipe.passes[0]
    assert recipe.needs_data and rotate.whole_model and not rotate.data_parallel
    for p in recipe.passes:
        p.check(model)
    start = rotate._matrix(rotate.head_dim)
    sm, embedding = streamed(model), model.get_input_embeddings().weight.clone()
    rotate.prepare(sm)  # learned: nothing yet
    assert torch.equal(model.get_input_embeddings().weight, embedding)
    rotate.fit(sm, LEARN_IDS, recipe.passes, torch.device("cpu"))
    learned = [rotate.r1] * (rotate.r1 is not None) + rotate.r2
    assert len(rotate.r2) == model.config.num_hidden_layers and rotate.learning["steps"] == 3
    for r in learned:
        torch.testing.assert_close(r.T @ r, torch.eye(len(r), dtype=torch.float64), rtol=0, atol=1e-12)
    assert max((r2 - start).abs().max() for r2 in rotate.r2) > 1e-4
    torch.testing.assert_close(_logits(model), before, rtol=0, atol=2e-5 * before.abs().max().item())


def test_learned_rotations_lose_less_to_rounding_than_their_random_hadamard_start():
    """The point of learning them: on an outlying channel with 3-bit weights and 4-bit inputs, the
    rotations trained against that rounding leave the model closer to the original than the random
    Hadamard rotation they start from (the same seed). A Cayley step is the learning rate times the
    gradient, and this model's KL is a hundredth of SmolLM2's at W4A4: a larger rate than the default."""
    reference = torch.log_softmax(_logits(_spread(tiny("llama"), 100.0)), -1)

    def kl_with(rotation: str) -> float:
        model = _spread(tiny("llama"), 100.0)
        compress_with(model, f"  - rotate: {rotation}\n" + LEARN_AGAINST, LEARN_IDS)
        logp = torch.log_softmax(_logits(model), -1)
        return torch.nn.functional.kl_div(logp, reference, log_target=True, reduction="batchmean").item()

    start, learned = kl_with("{kind: random_hadamard}"), kl_with("{kind: learned, steps: 20, lr: 1.5}")
    assert learned < 0.95 * start, (learned, start)


def test_a_width_with_no_hadamard_matrix_is_named():
    with pytest.raises(RecipeError, match="the head dimension: no Hadamard construction known for width 6 "):
        compress_with(tiny("llama", hidden=24), "  - rotate: {}\n")  # hidden 24 = 12 × 2, heads of 6
    model = tiny("llama", hidden=24)
    unchanged = copy.deepcopy(model)
    compress_with(model, "  - rotate: {values: false}\n")  # the residual stream alone rotates
    assert not torch.equal(model.lm_head.weight, unchanged.lm_head.weight)
