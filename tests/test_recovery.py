"""Recovery training: block-wise reconstruction, distillation, QLoRA.

On tiny models: the compressed structure survives training (integers, masks, export layout),
the LoRA adapter reloads through peft to our logits, runs are deterministic. On the real
SmolLM2: a few distillation steps lower the distillation loss.
"""

import json
import subprocess
import sys

import pytest
import torch

from compress import models
from compress.export import export
from compress.passes import RecipeError
from compress.passes.distill import distill_loss
from compress.quant import quantized_of
from compress.recipe import parse
from compress.sparsity import prune_mask_of
from tests.conftest import _NoTokenizer, compress_with, export_and_reload, tiny

IDS = torch.randint(0, 128, (8, 32), generator=torch.Generator().manual_seed(0))


def _logits(model, ids=IDS[:2]):
    with torch.no_grad():
        return model(ids).logits


def _kd(model, teacher, ids=IDS):
    return distill_loss(_logits(model, ids), _logits(teacher, ids)).item()


def test_blockwise_lowers_the_error_and_keeps_the_integers(tmp_path):
    dense = tiny("llama")
    rtn, tuned = tiny("llama"), tiny("llama")
    compress_with(rtn, "  - rtn: {bits: 3, group_size: 32}\n")
    recipe = compress_with(tuned, "  - rtn: {bits: 3, group_size: 32}\n  - blockwise: {steps: 40, lr: 0.01}\n", IDS)
    assert _kd(tuned, dense) < _kd(rtn, dense)
    for (name, a), b in zip(rtn.named_modules(), tuned.modules()):
        if quantized_of(a) is not None:
            assert torch.equal(quantized_of(a).q, quantized_of(b).q), name
            assert not torch.equal(quantized_of(a).scale, quantized_of(b).scale), name
    blockwise = recipe.passes[1]
    assert all(log["loss_last"] < log["loss_first"] for log in blockwise.log.values()), blockwise.log
    torch.testing.assert_close(
        _logits(export_and_reload(tuned, recipe, tmp_path / "x")), _logits(tuned), atol=1e-5, rtol=0
    )


def test_distillation_keeps_masks_exact_and_lowers_the_loss():
    dense, pruned, tuned = tiny("llama"), tiny("llama"), tiny("llama")
    compress_with(pruned, "  - magnitude: {pattern: '2:4'}\n")
    compress_with(tuned, "  - magnitude: {pattern: '2:4'}\n  - distill: {steps: 30, weight_lr: 0.001, batch: 2}\n", IDS)
    assert _kd(tuned, dense) < _kd(pruned, dense)
    trained = 0
    for (name, a), b in zip(pruned.named_modules(), tuned.modules()):
        mask = prune_mask_of(b)
        if mask is not None:
            assert torch.equal(mask, prune_mask_of(a)), name
            assert (b.weight[mask] == 0).all(), name
            trained += not torch.equal(a.weight, b.weight)
            assert b.weight.requires_grad is False and b.weight.dtype == a.weight.dtype
    assert trained > 0


def test_recovery_is_deterministic_for_a_seed():
    runs = []
    for _ in range(2):
        torch.manual_seed(3)
        model = tiny("llama")
        compress_with(
            model, "  - rtn: {bits: 3, group_size: 32}\n  - distill: {steps: 5, train: [scales, norms]}\n", IDS
        )
        runs.append(_logits(model))
    assert torch.equal(*runs)


@pytest.mark.parametrize("merge", [False, True])
def test_qlora_adapter_loads_with_peft_and_reproduces_our_logits(merge, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    dense, rtn, model = tiny("llama"), tiny("llama"), tiny("llama")
    compress_with(rtn, "  - rtn: {bits: 3, group_size: 32}\n")
    recipe = compress_with(
        model,
        f"  - rtn: {{bits: 3, group_size: 32}}\n"
        f"  - qlora: {{rank: 4, steps: 30, batch: 8, lr: 0.01, merge: {str(merge).lower()}}}\n",
        IDS,
    )
    if not merge:  # merging re-rounds the weights, which may undo a tiny model's gain
        assert _kd(model, dense) < _kd(rtn, dense)
    out = export(model, _NoTokenizer(), tmp_path / "x", recipe.text, {})
    assert (out / "adapter").exists() != merge
    base = AutoModelForCausalLM.from_pretrained(out, quantization_config=CompressedTensorsConfig(dequantize=True))
    reloaded = base if merge else PeftModel.from_pretrained(base, out / "adapter")
    torch.testing.assert_close(_logits(reloaded), _logits(model), atol=1e-5, rtol=0)
    torch.testing.assert_close(_logits(models.load_model(out, torch.float32)), _logits(model), atol=1e-5, rtol=0)


def test_gemma_norms_train_through_one_plus_weight():
    dense, model = tiny("gemma3_text"), tiny("gemma3_text")
    before = {n: p.clone() for n, p in model.named_parameters() if "norm" in n}
    compress_with(
        model, "  - rtn: {bits: 4, group_size: 32}\n  - blockwise: {steps: 10, train: [norms], lr: 0.01}\n", IDS
    )
    changed = [n for n, p in model.named_parameters() if "norm" in n and not torch.equal(p, before[n])]
    assert changed and _logits(model).isfinite().all()
    assert _kd(model, dense) < float("inf")


def test_qlora_with_8bit_adamw_keeps_8bit_moments_and_trains_as_fp32_adamw_does(monkeypatch):
    """``optimizer: adamw8bit``: bitsandbytes' AdamW8bit trains the adapter; the moments of the
    larger LoRA factors are uint8 codes, and the distillation loss falls about as far as with
    fp32 AdamW on the same steps."""
    bnb = pytest.importorskip("bitsandbytes")
    made, real = [], bnb.optim.AdamW8bit
    monkeypatch.setattr(bnb.optim, "AdamW8bit", lambda *a, **k: made.append(real(*a, **k)) or made[-1])
    logs = {}
    for optimizer in ("adamw", "adamw8bit"):
        torch.manual_seed(0)
        qlora = f"{{steps: 30, rank: 64, optimizer: {optimizer}, batch: 2, gradient_checkpointing: false}}"
        recipe = compress_with(tiny("llama"), f"  - rtn: {{bits: 3, group_size: 32}}\n  - qlora: {qlora}\n", IDS)
        logs[optimizer] = recipe.passes[1].log
    assert logs["adamw8bit"]["loss_last"] < 0.7 * logs["adamw8bit"]["loss_first"], logs
    assert logs["adamw8bit"]["loss_last"] < 1.5 * logs["adamw"]["loss_last"], logs
    (optimizer,) = made
    moments = [s["state1"].dtype for s in optimizer.state.values() if "state1" in s]
    assert torch.uint8 in moments  # factors of 4,096+ values: 8-bit; smaller ones stay fp32 in bitsandbytes


@pytest.mark.parametrize(
    "passes,message",
    [
        ("  - distill: {}\n", r"passes\[0\].distill: recovers what compression lost"),
        (
            "  - distill: {}\n  - rtn: {bits: 4}\n",
            r"passes\[0\].distill: .* must follow every block pass \(passes\[1\].rtn",
        ),
        ("  - wanda: {}\n  - qlora: {}\n", r"passes\[1\].qlora: LoRA trains on a frozen quantized base"),
        ("  - rtn: {bits: 4}\n  - distill: {train: []}\n", r"passes\[1\].distill.train: .*at least one"),
        ("  - rtn: {bits: 4}\n  - blockwise: {train: [lora]}\n", r"passes\[1\].blockwise.train\[0\]"),
        ("  - rtn: {bits: 4}\n  - blockwise: {steps: 0}\n", r"passes\[1\].blockwise.steps"),
    ],
)
def test_bad_recovery_recipes_are_refused(passes, message):
    with pytest.raises(RecipeError, match=message):
        parse("passes:\n" + passes)


@pytest.mark.slow
def test_a_few_distillation_steps_lower_the_loss_on_real_data(tmp_path):
    """`compress apply` on SmolLM2: first ten blocks at RTN W3, then 6 distillation steps on
    scales and norms over the same 2 × 128 wikitext tokens; the loss must fall."""
    recipe = tmp_path / "kd.yaml"
    recipe.write_text(
        "calibration: {source: wikitext2, samples: 2, seqlen: 128}\npasses:\n"
        "  - rtn: {bits: 3, group_size: 64, ignore: [lm_head, 're:layers\\.[12]\\d\\.']}\n"
        "  - distill: {steps: 6, batch: 2, train: [scales, norms]}\n"
        "evaluation: {ppl: wikitext2, seqlen: 256, windows: 2}\n"
    )
    out = tmp_path / "out"
    result = subprocess.run(
        [sys.executable, "-m", "compress.cli", "apply", str(recipe), "--output", str(out)],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    log = json.loads((out / "report.json").read_text())["training"]["passes[1].distill"]
    assert log["steps"] == 6 and log["loss_last"] < log["loss_first"], log
    assert f"training loss {log['loss_first']:.4g} -> {log['loss_last']:.4g}" in result.stdout
