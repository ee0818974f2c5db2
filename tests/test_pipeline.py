
import pytest
import torch

from compress.arch import arch_of, decoder_layers
from compress.pipeline import run_sequential
from compress.quant import quantized_of
from tests.conftest import compress_with, export_and_reload, tiny


class _Record:
    """A pass that records each block's input as the pipeline delivers it."""

    name = "record"
    needs_data = True

    def __init__(self):
        self.seen = []

    def apply(self, block, data, prefix):
        self.seen.append(torch.cat(data.inputs))


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "gemma3_text"])
def test_block_sweep_reproduces_the_model(model_type):
    """Caught inputs + per-block arguments replay the real forward exactly (Gemma-3: local and global layers)."""
    model = tiny(model_type, layers=4 if model_type == "gemma3_text" else 2)
    ids = torch.randint(0, 128, (3, 24))
    with torch.no_grad():
        hidden = model.get_decoder()(ids, output_hidden_states=True).hidden_states
    rec = _Record()
    run_sequential(model, ids, [rec], torch.device("cpu"))
    for i, seen in enumerate(rec.seen):
        torch.testing.assert_close(seen, hidden[i].reshape(-1, *hidden[i].shape[1:]), rtol=1e-5, atol=1e-5)


def test_rtn_quantizes_every_block_linear_but_lm_head():
    model = tiny("llama")
    compress_with(model, "  - rtn: {bits: 4, group_size: 32}\n")
    names = {n for n, m in model.named_modules() if quantized_of(m) is not None}
    assert len(names) == 7 * len(decoder_layers(model))
    assert quantized_of(model.lm_head) is None
    assert arch_of(model).name == "llama"


def test_ignore_pattern_keeps_layers_dense():
    model = tiny("llama")
    compress_with(model, "  - rtn: {bits: 4, group_size: 32, ignore: [lm_head, mlp.down_proj, 're:layers\\.0\\.']}\n")
    layers = decoder_layers(model)
    assert quantized_of(layers[1].mlp.down_proj) is None
    assert all(quantized_of(m) is None for m in layers[0].modules())
    assert quantized_of(layers[1].self_attn.q_proj) is not None


def test_tied_export_round_trip(tmp_path):
    """A tiny tied model exports and reloads in plain transformers with identical logits."""
    model = tiny("llama")
    model.config.tie_word_embeddings = True
    model.tie_weights()
    recipe = compress_with(model, "  - rtn: {bits: 4, group_size: 32}\n")
    reloaded = export_and_reload(model, recipe, tmp_path / "x")
    ids = torch.randint(0, 128, (1, 16))
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, model(ids).logits)
    assert not list(tmp_path.glob(".x.tmp-*"))  # no temporary folder left behind
