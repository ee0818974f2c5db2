"""Models read one block at a time: the export written as blocks finish, evaluation block by block."""

import json
import math

import pytest
import torch
from conftest import compress_with, tiny
from safetensors.torch import save_file

from compress import data, models
from compress.apply import apply
from compress.evaluate import windows_of
from compress.formats.safetensors import Checkpoint, ShardWriter
from compress.recipe import parse


def test_shard_writer_lays_out_bytes_exactly_as_save_file(tmp_path):
    tensors = {
        f"b{i}.{n}": t
        for i in range(3)
        for n, t in {
            "w": torch.randn(7, 5),
            "b": torch.randn(3).bfloat16(),
            "h": torch.randn(2).half(),
            "packed": torch.randint(-8, 8, (4, 3), dtype=torch.int32),
            "shape": torch.tensor([3, 4]),
            "i8": torch.randint(-5, 5, (9,), dtype=torch.int8),
            "mask": torch.rand(5) > 0.5,
            "scalar": torch.tensor(1.5, dtype=torch.float64),
        }.items()
    }
    save_file(tensors, tmp_path / "reference.safetensors", metadata={"format": "pt"})
    writer = ShardWriter(tmp_path)
    for k, v in tensors.items():
        writer.add(k, v)
    assert writer.close() == ["model.safetensors"]
    assert (tmp_path / "model.safetensors").read_bytes() == (tmp_path / "reference.safetensors").read_bytes()


def test_shard_writer_splits_at_the_limit_and_indexes_every_tensor(tmp_path):
    writer = ShardWriter(tmp_path, max_shard_bytes=1000)
    tensors = {f"t{i}": torch.full((100,), float(i)) for i in range(5)}  # 400 bytes each: 2 per shard
    for k, v in tensors.items():
        writer.add(k, v)
    names = writer.close()
    assert names == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    assert index == {"t0": names[0], "t1": names[0], "t2": names[1], "t3": names[1], "t4": names[2]}
    checkpoint = Checkpoint(tmp_path)
    assert all(torch.equal(checkpoint.read([k])[k], v) for k, v in tensors.items())
    assert not list(tmp_path.glob(".shard-*"))  # no scratch file left


@pytest.fixture(scope="module")
def sharded(tmp_path_factory, smollm2):
    """A tiny Llama with SmolLM2's tokenizer (and vocabulary), saved in several shards."""
    folder = tmp_path_factory.mktemp("sharded")
    model = tiny("llama", hidden=64, layers=3)
    model.resize_token_embeddings(len(smollm2.tokenizer))
    torch.manual_seed(1)
    model.get_input_embeddings().weight.data.normal_(0, 0.5)
    model.to(torch.bfloat16).save_pretrained(folder, max_shard_size="2MB")
    smollm2.tokenizer.save_pretrained(folder)
    assert len(json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]) > 3
    assert len(set(json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"].values())) >= 3
    return folder


def test_blocks_are_read_on_entry_and_freed_on_exit(sharded):
    streamed = models.open_streamed(str(sharded)).model
    whole = models.load(str(sharded)).model.state_dict()
    assert all(p.is_meta for p in streamed.layers.parameters())
    with streamed.block(1) as block:
        for k, v in block.state_dict().items():
            assert torch.equal(v, whole[f"model.layers.1.{k}"]), k
    assert all(p.is_meta for p in streamed.layers.parameters())
    assert torch.equal(streamed.model.get_input_embeddings().weight, whole["model.embed_tokens.weight"])


def test_streamed_apply_matches_the_whole_model_and_reloads_in_transformers(sharded, tmp_path):
    from transformers import AutoModelForCausalLM

    text = (
        "passes:\n  - gptq: {bits: 4, group_size: 32, symmetric: true}\n"
        "calibration: {samples: 4, seqlen: 64}\nevaluation: {windows: 3, seqlen: 64}\n"
    )
    recipe = parse(text)
    out = tmp_path / "export"
    report = apply(recipe, str(sharded), out, device="cpu", max_shard_mb=1)
    assert len(list(out.glob("model-*.safetensors"))) >= 3  # the export is sharded too
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary folder left

    # the same recipe on the whole model in memory, as before streaming
    loaded = models.load(str(sharded))
    whole, tokenizer = loaded.model, loaded.tokenizer
    cal = recipe.calibration
    ids, _ = data.calibration_batches(whole, tokenizer, cal.source, cal.samples, cal.seqlen, recipe.seed)
    torch.manual_seed(recipe.seed)
    compress_with(whole, text.split("passes:\n")[1].split("calibration")[0], ids)
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    windows = windows_of(tokenizer, "wikitext2", 64, 3)
    mine = whole.state_dict()
    for k, v in reloaded.state_dict().items():
        if k in mine:  # (compressed-tensors keeps the scales beside the unpacked weights)
            assert torch.equal(v, mine[k].float()), k
    with torch.no_grad():  # (compressed-tensors' forward rounds differently: ~1e-4 on these logits)
        ours = models.for_compute(whole, torch.device("cpu"))(windows).logits
        torch.testing.assert_close(reloaded(windows).logits, ours, atol=1e-3, rtol=1e-4)

    # evaluation, block by block, equals perplexity and KL from whole-model logits
    dense = models.for_compute(models.load(str(sharded)).model, torch.device("cpu"))
    with torch.no_grad():
        logp = torch.log_softmax(whole(windows).logits[:, :-1].float(), -1)
        ref = torch.log_softmax(dense(windows).logits[:, :-1].float(), -1)
    targets = windows[:, 1:, None]
    assert report.eval["ppl"] == pytest.approx(math.exp(-logp.gather(-1, targets).mean().item()), rel=1e-5)
    assert report.eval["ref_ppl"] == pytest.approx(math.exp(-ref.gather(-1, targets).mean().item()), rel=1e-5)
    assert report.eval["kl"] == pytest.approx((ref.exp() * (ref - logp)).sum(-1).mean().item(), abs=1e-6)


def test_apply_refuses_a_run_that_does_not_fit_before_writing_anything(sharded, tmp_path, monkeypatch):
    from compress import memory

    monkeypatch.setattr(memory, "available_bytes", lambda device: 10**8)
    recipe = parse("passes:\n  - rtn: {bits: 4, group_size: 32}\nevaluation: {windows: 2, seqlen: 64}\n")
    with pytest.raises(memory.MemoryPlanError, match=r"needs about [\d.]+ GB of RAM, 0.1 GB is free; the largest part"):
        apply(recipe, str(sharded), tmp_path / "x", device="cpu")
    assert not list(tmp_path.iterdir())


def test_spilled_activations_give_the_same_export_and_leave_no_file(sharded, tmp_path, capsys):
    text = (
        "passes:\n  - awq: {bits: 4, group_size: 32, quantize: false}\n  - gptq: {bits: 4, group_size: 32}\n"
        "calibration: {samples: 4, seqlen: 64}\n"
    )
    spill = tmp_path / "spill"
    spill.mkdir()
    in_ram = apply(parse(text), str(sharded), tmp_path / "ram", device="cpu", evaluate_after=False)
    spilled = apply(parse(text), str(sharded), tmp_path / "spilled", device="cpu", evaluate_after=False, spill=spill)
    assert "calibration activations on disk" in capsys.readouterr().out
    assert in_ram.bits_per_weight == spilled.bits_per_weight
    assert (tmp_path / "ram" / "model.safetensors").read_bytes() == (
        tmp_path / "spilled" / "model.safetensors"
    ).read_bytes()
    assert not list(spill.iterdir())  # every activation file removed


def test_spilled_list_reads_back_what_was_written(tmp_path):
    from compress.data import SpilledList

    items = SpilledList(tmp_path, torch.device("cpu"))
    tensors = [torch.randn(1, 5, 3), torch.randn(2, 4).bfloat16()]
    for t in tensors:
        items.append(t)
    items[0] = tensors[0] * 2
    assert torch.equal(items[0], tensors[0] * 2) and torch.equal(items[1], tensors[1])
    assert [t.shape for t in items[:2]] == [t.shape for t in tensors] and len(items) == 2
    folder = items.folder
    del items
    assert not folder.exists()


def test_the_reference_is_scored_once_per_model_and_windows(sharded, tmp_path, monkeypatch, capsys):
    from compress.evaluate import evaluate

    monkeypatch.setenv("COMPRESS_CACHE", str(tmp_path / "cache"))
    ids = torch.randint(0, 1000, (2, 48), generator=torch.Generator().manual_seed(0))

    def scored(data):
        model, reference = (models.open_streamed(str(sharded)).model for _ in range(2))
        return evaluate(model, None, seqlen=data.shape[1], windows=len(data), reference=reference, data=data)

    first = scored(ids)
    assert "kept its hidden states" in capsys.readouterr().err
    again = scored(ids)
    assert "hidden states read from" in capsys.readouterr().err
    assert again == first and first.kl < 1e-6  # the same numbers, bit for bit
    other = scored(ids[:, :32])  # other windows: computed, and kept beside the first
    assert "kept its hidden states" in capsys.readouterr().err and other.ppl != first.ppl
    assert len(list((tmp_path / "cache" / "reference").glob("*.safetensors"))) == 2
