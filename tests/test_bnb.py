"""bitsandbytes baselines: the model load_in_4bit / load_in_8bit gives, scored by our evaluation."""

import json
import subprocess
import sys

import pytest
import torch

from tests.conftest import tiny_folder

bitsandbytes = pytest.importorskip("bitsandbytes")


@pytest.fixture(scope="module")
def folder(tmp_path_factory, smollm2):
    return tiny_folder(tmp_path_factory.mktemp("tiny"), smollm2.tokenizer)


@pytest.mark.parametrize("scheme,module", [("nf4", "Linear4bit"), ("int8", "Linear8bitLt")])
def test_evaluation_scores_what_the_bitsandbytes_model_computes(folder, smollm2, scheme, module):
    """Every block linear is bitsandbytes' own module (lm_head dense, as transformers keeps it), and
    the evaluation's perplexity is the loss of that model's own forward on the same windows."""
    from compress import bnb
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
    from compress import bnb

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
