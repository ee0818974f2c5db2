import pytest

from compress.passes import RecipeError
from compress.recipe import parse, shipped
from tests.conftest import tiny


@pytest.mark.parametrize(
    "text,message",
    [
        (
            "passes:\n  - foo: {}\n",
            "passes[0]: unknown pass 'foo'; known passes: activations, awq, blockwise, distill, eagle, gptq, kv_cache, "
            "kv_fp8, lorc, lowrank, magnitude, qlora, rotate, rtn, smoothquant, sparsegpt, wanda",
        ),
        ("passes:\n  - rtn: {bits: 5}\n", "passes[0].rtn.bits: Input should be 2, 3, 4 or 8"),
        ("passes:\n  - rtn: {bitz: 4}\n", "passes[0].rtn.bitz: unknown key"),
        ("passes:\n  - rtn: {group_size: 0}\n", "passes[0].rtn.group_size"),
        ("passes: []\n", "passes: List should have at least 1 item"),
        ("model: x\n", "passes: Field required"),
        ("passes:\n  - rtn: {}\ncalibration: {samples: -1}\n", "calibration.samples"),
        ("evaluation: {windows: 0}\npasses:\n  - rtn: {}\n", "evaluation.windows"),
        (
            "passes:\n  - rtn: {}\ncalibration: {dtype: fp16}\n",
            "calibration.dtype: Input should be 'auto', 'float32' or 'bfloat16'",
        ),
        ("- just a list\n", "a recipe is a YAML mapping"),
    ],
)
def test_bad_recipes_name_the_yaml_path(text, message):
    with pytest.raises(RecipeError) as e:
        parse(text)
    assert message in str(e.value)
    assert "\n" not in str(e.value)


def test_group_size_that_does_not_divide_names_the_layers():
    model = tiny("llama", hidden=96)  # 96 % 64 != 0
    recipe = parse("passes:\n  - rtn: {bits: 4, group_size: 64}\n")
    with pytest.raises(
        RecipeError,
        match=r"passes\[0\].rtn.group_size: 64 does not divide .*mlp.gate_proj \(in_features 96\).* and \d more",
    ):
        recipe.passes[0].check(model)


def test_auto_group_size_on_model_shapes():
    recipe = parse("passes:\n  - rtn: {bits: 4}\n")
    recipe.passes[0].check(tiny("llama", hidden=96))
    assert recipe.passes[0].scheme.group_size == 32


def test_ignore_that_matches_nothing_warns():
    recipe = parse("passes:\n  - rtn: {bits: 4, ignore: [lm_head, not_a_layer]}\n")
    with pytest.warns(UserWarning, match="'not_a_layer' matches no linear layer"):
        recipe.passes[0].check(tiny("llama"))


def test_every_shipped_recipe_parses_and_has_a_summary():
    from compress.recipe import load

    names = shipped()
    assert names
    for name, _, summary in names:
        assert summary, name
        load(name)


def test_the_listing_says_what_each_recipe_stores():
    stored = {name: what for name, what, _ in shipped()}
    assert stored["rtn-w4"] == "W4" and stored["smoothquant-w8a8"] == "W8 A8"
    assert stored["nvfp4"] == "W-NVFP4 A-NVFP4" and stored["fp8-dynamic"] == "W-FP8 A-FP8"
    assert stored["sparsegpt-2of4-w4"] == "W4 2:4" and stored["wanda-50"] == "50% sparse"
    assert stored["awq-w4-kv4"] == "W4 KV4" and stored["kv-fp8"] == "KV-FP8"
    assert stored["svdllm-80"] == "rank: 80% of params" and stored["qlora-nf4"] == "W-NF4 +LoRA"


def test_every_shipped_recipe_parses():
    from compress.recipe import RECIPES_DIR, load

    names = [name for name, *_ in shipped()]
    assert len(names) > 20
    for name in names:
        assert load(RECIPES_DIR / f"{name}.yaml").passes, name


def test_every_pass_declares_the_kinds_of_state_it_leaves():
    """Formats refuse passes by their declared ``leaves`` (GGUF: quantized and pruned linears only)."""
    from compress import export  # noqa: F401 - every kind of state registers on import
    from compress.passes import REGISTRY
    from compress.state import KINDS

    for name, cls in REGISTRY.items():
        assert cls.leaves <= set(KINDS), (name, cls.leaves - set(KINDS))
    assert not REGISTRY["distill"].leaves and REGISTRY["gptq"].leaves == {"quantized"}
