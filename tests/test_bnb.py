"""bitsandbytes baselines: the model load_in_4bit / load_in_8bit gives, scored by our evaluation."""

import json
import subprocess
import sys

import pytest
import torch

from compress import bnb
from compress.formats.bitsandbytes import Rounded4bit
from compress.formats.safetensors import CheckpointError
from tests.conftest import tiny_folder

bitsandbytes = pytest.importorskip("bitsandbytes")


@pytest.fixture(scope="module")
def folder(tmp_path_factory, smollm2):
    return tiny_folder(tmp_path_factory.mktemp("tiny"), smollm2.tokenizer)


@pytest.mark.parametrize("scheme,module", [("nf4", "Linear4bit"), ("int8", "Linear8bitLt")])
def test_evaluation_scores_what_the_bitsandbytes_model_computes(folder, smollm2, scheme, module):
    """Every block linear is bitsandbytes' own module (lm_head dense, as transformers keeps it), and
    the evaluation's perplexity is the loss of that model's own forward on the same windows."""
    from compress.evaluate import evaluate, windows_of

    model = bnb.load(str(folder), scheme, torch.device("cpu")).model
    linears = [m for m in model.model.modules() if isinstance(m, torch.nn.Linear)]
    assert {type(m).__name__ for m in linears if m is not model.model.lm_head} == {module}
    assert type(model.model.lm_head) is torch.nn.Linear
    data = windows_of(smollm2.tokenizer, "wikitext2", 64, 2)
    result = evaluate(model, smollm2.tokenizer, data=data, device=torch.device("cpu"))
    with torch.no_grad():
        loss = torch.stack([model.model(window[None], labels=window[None]).loss for window in data]).mean()
    assert result.ppl == pytest.approx(float(torch.exp(loss)), rel=1e-4)


def test_bits_per_weight_counts_codes_and_scales(folder):

    cpu = torch.device("cpu")
    assert bnb.bits_per_weight(bnb.load(str(folder), "nf4", cpu).model.model)[0] == pytest.approx(4.5)  # fp32 / 64
    double, count = bnb.bits_per_weight(bnb.load(str(folder), "nf4-double", cpu).model.model)
    assert 4.125 < double < 4.5 + 8 * 1024 * 14 / count  # uint8 / 64, plus each linear's code table
    int8, _ = bnb.bits_per_weight(bnb.load(str(folder), "int8", cpu).model.model)
    assert int8 == pytest.approx(8 + 32 / 64, rel=0.05)  # fp32 row scales; the tiny model's widths are 64–128


def test_eval_command_prints_bits_and_scores_and_refuses_a_quantized_model(folder, tmp_path):
    run = [sys.executable, "-m", "compress.cli", "eval", str(folder), "--windows", "2", "--seqlen", "64"]
    result = subprocess.run([*run, "--bitsandbytes", "nf4"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "bitsandbytes nf4: 4.500 bits per weight" in result.stdout and "KL:" in result.stdout
    quantized = tmp_path / "quantized"
    quantized.mkdir()
    for f in folder.iterdir():
        (quantized / f.name).write_bytes(f.read_bytes())
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "compressed-tensors"}
    (quantized / "config.json").write_text(json.dumps(config))
    refused = subprocess.run([*run[:4], str(quantized), "--bitsandbytes", "nf4"], capture_output=True, text=True)
    assert refused.returncode == 2 and "already quantized (compressed-tensors)" in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1


@pytest.fixture(scope="module")
def confident_folder(tmp_path_factory, smollm2):
    """A tiny model whose next-token distributions are far from uniform, so that KLs rank runs."""
    return tiny_folder(tmp_path_factory.mktemp("confident"), smollm2.tokenizer, weight_scale=3.0)


def test_qlora_on_nf4_exports_load_in_4bit_codes_that_transformers_and_peft_load(confident_folder, tmp_path):
    """``qlora: {base: nf4}``: the export's codes and block scales are byte for byte what
    ``load_in_4bit`` makes of the original; transformers loads them as ``Linear4bit`` and peft puts
    the adapter on, computing what our reader computes (up to bitsandbytes' CPU kernel); the
    report counts 4.5 bits per weight; and the adapter lowers the KL the NF4 rounding left."""
    from peft import PeftModel
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from compress import models

    recipe = tmp_path / "r.yaml"
    runs = {}
    for steps, lr in ((1, 1e-12), (20, 0.01)):  # ~untrained, then trained
        recipe.write_text(
            f"passes:\n  - qlora: {{base: nf4, rank: 4, steps: {steps}, lr: {lr}, batch: 4}}\n"
            "calibration: {samples: 8, seqlen: 64}\nevaluation: {seqlen: 64, windows: 2}\n"
        )
        out = tmp_path / f"out{steps}"
        model = str(confident_folder)
        run = [sys.executable, "-m", "compress.cli", "apply", str(recipe), "--model", model, "--output", str(out)]
        result = subprocess.run(run, capture_output=True, text=True)
        assert result.returncode == 0, result.stderr[-2000:]
        runs[steps] = json.loads((out / "report.json").read_text())
    assert runs[20]["eval"]["kl"] < runs[1]["eval"]["kl"], runs
    assert runs[20]["bits_per_weight"] == pytest.approx(4.5)

    name = "model.layers.1.mlp.down_proj"
    original = bnb.load(str(confident_folder), "nf4", torch.device("cpu")).model.model.get_submodule(name).weight
    with safe_open(out / "model.safetensors", "pt") as f:
        assert torch.equal(f.get_tensor(f"{name}.weight"), original.data)
        assert torch.equal(f.get_tensor(f"{name}.weight.absmax"), original.quant_state.absmax)

    ids = torch.randint(0, 1000, (2, 16), generator=torch.Generator().manual_seed(0))
    ours = models.load_model(out, torch.float32)
    theirs = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32), out / "adapter")
    assert isinstance(theirs.get_base_model().get_submodule(name).base_layer, bitsandbytes.nn.Linear4bit)
    with torch.no_grad():
        a, b = ours(ids).logits, theirs(ids).logits
    assert (a - b).abs().max() < 0.02 * a.abs().max()
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.95


def test_qlora_on_nf4_merged_is_rounded_again_and_reads_back_as_trained(tmp_path):
    from compress import models
    from compress.export import export
    from compress.formats import gguf_file
    from tests.conftest import _NoTokenizer, compress_with, tiny

    model = tiny("llama")
    ids = torch.randint(0, 128, (8, 32), generator=torch.Generator().manual_seed(0))
    compress_with(model, "  - qlora: {base: nf4, rank: 4, steps: 10, lr: 0.01, batch: 4, merge: true}\n", ids)
    down = model.model.layers[0].mlp.down_proj
    assert getattr(down, "lora", None) is None
    rounded = Rounded4bit.of(down)
    codes, state = rounded.codes, rounded.quant_state
    assert torch.equal(bitsandbytes.functional.dequantize_4bit(codes, state).float(), down.weight)
    out = export(model, _NoTokenizer(), tmp_path / "x", "", {})
    assert not (out / "adapter").exists()
    with pytest.raises(gguf_file.GGUFError, match="bitsandbytes NF4/FP4 weights, which GGUF has no type for"):
        gguf_file.write(out, None, tmp_path / "x.gguf")
    with torch.no_grad():
        torch.testing.assert_close(models.load_model(out, torch.float32)(ids).logits, model(ids).logits)


@pytest.mark.parametrize(
    "passes,message",
    [
        ("  - rtn: {bits: 4}\n  - qlora: {base: nf4}\n", "base: nf4 rounds the original weights itself; remove"),
        ("  - qlora: {base: nf4, train: [lora, scales]}\n", "base: nf4 has no integer scales to train"),
        ("  - qlora: {}\n", "or set base: nf4"),
    ],
)
def test_qlora_base_problems_are_one_line_recipe_errors(passes, message):
    from compress.passes import RecipeError
    from compress.recipe import parse

    with pytest.raises(RecipeError, match=message):
        parse("passes:\n" + passes)


def test_nf4_without_bitsandbytes_is_a_one_line_error(monkeypatch, folder, tmp_path):
    """Without bitsandbytes (an optional extra) the recipe and a reader of an NF4 export say what
    to install, before any work."""
    import importlib.util
    import shutil

    from compress import lazy
    from compress.passes import RecipeError
    from compress.recipe import parse

    real = importlib.util.find_spec
    absent = lambda name, *a: None if name == "bitsandbytes" else real(name, *a)  # noqa: E731
    monkeypatch.setattr(importlib.util, "find_spec", absent)
    with pytest.raises(RecipeError, match="base: nf4 needs the bitsandbytes package: pip install bitsandbytes"):
        parse("passes:\n  - qlora: {base: nf4}\n")
    nf4 = shutil.copytree(folder, tmp_path / "nf4")
    config = json.loads((nf4 / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (nf4 / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="holds bitsandbytes 4-bit weights: pip install bitsandbytes"):
        lazy.open_model(nf4, torch.bfloat16)
