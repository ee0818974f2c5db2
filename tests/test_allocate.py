"""Mixed precision to a bits-per-weight budget: the knapsack, the costs, the export of a mixed model."""

import itertools
import json
import os

import pytest
import torch

from compress import allocate
from compress.apply import apply
from compress.lazy import streamed
from compress.passes import RecipeError
from compress.pipeline import run_passes
from compress.recipe import parse
from tests.conftest import export_and_reload, reloads_to_our_logits, tiny, tiny_folder

DATA = "calibration: {samples: 4, seqlen: 64}\n"
GPTQ = "passes:\n  - gptq: {bits: 4, group_size: 32, symmetric: true}\n"


def _brute_force(costs, sizes, capacity):
    best = None
    for pick in itertools.product(*(range(len(c)) for c in costs)):
        size = sum(s[i] for s, i in zip(sizes, pick))
        cost = sum(c[i] for c, i in zip(costs, pick))
        if size <= capacity and (best is None or cost < best[0] - 1e-12):
            best = (cost, list(pick))
    return best


@pytest.mark.parametrize("seed", range(6))
def test_the_knapsack_finds_the_cheapest_choice_within_the_budget(seed):
    g = torch.Generator().manual_seed(seed)
    items, options = 6, 3
    sizes = [sorted(torch.randint(5, 60, (options,), generator=g).tolist()) for _ in range(items)]
    # more bits, less cost
    costs = [sorted(torch.rand(options, generator=g).tolist(), reverse=True) for _ in range(items)]
    capacity = int(sum(s[1] for s in sizes))
    picked = allocate.choose(costs, sizes, capacity)
    cost, pick = _brute_force(costs, sizes, capacity)
    assert sum(s[i] for s, i in zip(sizes, picked)) <= capacity
    assert sum(c[i] for c, i in zip(costs, picked)) == pytest.approx(cost, abs=1e-12)


def test_the_knapsack_spends_the_budget_exactly_when_that_is_cheapest():
    """Constructed: each bit buys cost down, so the best choice fills the budget to the last unit."""
    sizes = [[2, 3, 4, 8]] * 5
    costs = [[8.0, 4.0, 2.0, 0.1]] * 5
    assert allocate.choose(costs, sizes, 5 * 3) == [1] * 5  # 3.0 "bits" each
    picked = allocate.choose(costs, sizes, 17)
    assert sum(sizes[0][i] for i in picked) == 17
    assert allocate.choose(costs, sizes, 9) is None  # below every item's smallest


def test_candidates_parse_and_bad_ones_are_named():
    assert allocate.parse_candidate("w4g128") == (4, 128)
    assert allocate.parse_candidate("w8") == (8, -1)
    for bad in ("w5g32", "w4g0", "int4", "w4g"):
        with pytest.raises(ValueError, match="w<bits>g<group>"):
            allocate.parse_candidate(bad)


def _ids(n=4, length=32):
    return torch.randint(0, 128, (n, length), generator=torch.Generator().manual_seed(0))


def test_costs_fall_with_more_bits_and_the_choice_meets_the_budget():
    model = tiny("llama", layers=2)
    recipe = parse("allocate: {target_bpw: 3.5, candidates: [w2g32, w3g32, w4g32, w8]}\n" + GPTQ)
    for p in recipe.passes:
        p.check(model)
    planner = allocate.Planner(recipe.allocate, recipe.passes, model.dtype)
    costs = allocate.measure(streamed(model), _ids(), planner.options, torch.device("cpu"))
    assert set(costs) == set(planner.shapes) and len(costs) == 14
    for c in costs.values():
        assert c["w2g32"] > c["w3g32"] > c["w4g32"] > c["w8"] > 0
    allocation = planner.choose(costs, 0.0)
    assert allocation.bits_per_weight <= 3.5
    assert len(allocation.counts) > 1  # a mix, not one scheme everywhere
    sizes = {n: planner.sizes(n) for n in costs}
    total = sum(sizes[n][c] for n, c in allocation.choice.items())
    assert total / planner.weights == allocation.bits_per_weight


def test_a_mixed_export_reloads_in_transformers_to_our_logits(tmp_path):
    model = tiny("llama", layers=2)
    for p in model.parameters():
        p.data = p.data.to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    recipe = parse("allocate: {target_bpw: 3.2, candidates: [w2g32, w3g32, w4g32, w8]}\n" + GPTQ)
    for p in recipe.passes:
        p.check(model)
    ids = _ids()
    allocation = allocate.Planner(recipe.allocate, recipe.passes, model.dtype).run(model, ids, torch.device("cpu"))
    run_passes(model, ids, recipe.passes, torch.device("cpu"), lambda: None)
    from compress.quant import quantized_of

    for name, candidate in allocation.choice.items():
        scheme = quantized_of(model.get_submodule(name)).scheme
        assert (scheme.bits, scheme.group_size) == allocate.parse_candidate(candidate)
    reloaded = export_and_reload(model, recipe, tmp_path / "out")
    groups = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]["config_groups"]
    assert len(groups) == len(allocation.counts)
    reloads_to_our_logits(model, tmp_path / "out", reloaded)


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory, smollm2):
    return tiny_folder(tmp_path_factory.mktemp("model"), smollm2.tokenizer, layers=2, weight_scale=3.0)


def test_apply_reports_the_bits_on_disk_and_a_second_run_reuses_the_costs(model_folder, tmp_path, monkeypatch):
    monkeypatch.setenv("COMPRESS_CACHE", str(tmp_path / "cache"))
    recipe = parse(DATA + GPTQ)
    first = apply(recipe, str(model_folder), tmp_path / "a", "cpu", evaluate_after=False, target_bpw=3.0)
    assert first.allocation["measure_s"] > 0
    assert first.bits_per_weight == pytest.approx(first.allocation["bits_per_weight"], abs=1e-12)
    assert first.bits_per_weight <= 3.0
    assert "allocated to 3.0 bits per weight" in first.method
    stored = json.loads((tmp_path / "a" / "report.json").read_text())["allocation"]
    assert stored["choice"] == first.allocation["choice"]
    again = apply(recipe, str(model_folder), tmp_path / "b", "cpu", evaluate_after=False, target_bpw=3.0)
    assert again.allocation["measure_s"] == 0.0 and again.allocation["choice"] == first.allocation["choice"]
    for f in ("model.safetensors", "config.json"):
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes()


@pytest.mark.parametrize(
    ("recipe", "budget", "message"),
    [
        (GPTQ, 1.5, "1.5 is below the smallest these candidates give"),
        (GPTQ, 9.0, "9.0 is above the largest"),
        ("allocate: {target_bpw: 3, candidates: [w4g48]}\n" + GPTQ, None, "none fits"),
        (
            "allocate: {target_bpw: 3}\npasses:\n  - gptq: {format: nvfp4}\n",
            None,
            "allocate chooses among integer schemes",
        ),
    ],
)
def test_a_budget_or_candidate_that_cannot_be_met_is_refused_before_compute(
    recipe, budget, message, model_folder, tmp_path
):
    with pytest.raises(RecipeError, match=message):
        apply(parse(DATA + recipe), str(model_folder), tmp_path / "out", "cpu", evaluate_after=False, target_bpw=budget)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("allocate: {target_bpw: 3, candidates: [w5g32]}\n" + GPTQ, "allocate.candidates: candidate 'w5g32'"),
        ("allocate: {target_bpw: 0}\n" + GPTQ, "allocate.target_bpw"),
        ("allocate: {target_bpw: 3}\npasses:\n  - wanda: {sparsity: 0.5}\n", "no pass of this recipe rounds"),
        ("allocate: {target_bpw: 3}\n" + GPTQ + "export: {format: gguf, type: q4_0}\n", "has one block type"),
        (
            "allocate: {target_bpw: 3, candidates: [w4g32]}\npasses:\n  - gptq: {format: q4_k}\n"
            "export: {format: gguf, type: q4_k_m}\n",
            "its candidates are GGUF k-quant types",
        ),
        ("allocate: {target_bpw: 3, candidates: [q4_k]}\n" + GPTQ, "its candidates are integer schemes"),
        ("allocate: {target_bpw: 3, candidates: [q4_k, w4g32]}\n" + GPTQ, "mix GGUF k-quant types and integer"),
        ("allocate: {target_bpw: q4_k_m}\n" + GPTQ, "q4_k_m is the size of a GGUF file"),
        ("allocate: {target_bpw: q4_0}\n" + GPTQ, "neither a number of bits per weight nor a GGUF k-quant type"),
    ],
)
def test_a_bad_allocate_key_is_one_line_naming_it(text, message):
    with pytest.raises(RecipeError, match=message):
        parse(text)


def test_the_command_line_refuses_a_bad_budget_with_exit_2(model_folder, tmp_path):
    import subprocess
    import sys

    out = tmp_path / "out"
    for budget, said in (("0", "positive"), ("abc", "neither a number"), ("1.0", "below the smallest")):
        r = subprocess.run(
            [sys.executable, "-m", "compress", "apply", "gptq-w4", "--model", str(model_folder), "--output", str(out)]
            + ["--target-bpw", budget, "--no-eval", "--samples", "2"],
            capture_output=True,
            text=True,
            env={**os.environ, "COMPRESS_CACHE": str(tmp_path / "cache")},
        )
        assert r.returncode == 2, r.stderr
        assert said in r.stderr and "Traceback" not in r.stderr
        assert len(r.stderr.strip().splitlines()) <= 2  # the line, and at most a warning before it
        assert not out.exists()


def test_the_memory_plan_counts_what_measuring_the_costs_holds():
    from compress import memory

    model = streamed(tiny("llama", layers=2))
    recipe = parse(DATA + "allocate: {target_bpw: 3}\n" + GPTQ)
    without = memory.plan(model, recipe.passes, torch.device("cpu"), 4, 64, 0, 0, False)
    plan = memory.plan(model, recipe.passes, torch.device("cpu"), 4, 64, 0, 0, False, allocation_samples=4)
    assert not without.allocate
    assert plan.allocate["allocation: every block's inputs"] == 2 * 4 * 64 * 64 * 4  # blocks × tokens × hidden × f32
    assert "allocation: every block's inputs" in plan.describe()
