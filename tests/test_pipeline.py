import pytest
import torch

from compress.arch import arch_of, decoder_layers
from compress.passes import LayerPass
from compress.pipeline import run_sequential
from compress.quant import quantized_of
from tests.conftest import compress_with, export_and_reload, tiny


class _Record(LayerPass):
    """A pass that records each block's input as the pipeline delivers it."""

    name = "record"
    needs_data = True

    def __init__(self):
        super().__init__(None, "passes[0].record")
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


def test_a_bf16_sweep_computes_in_bf16_and_stores_as_before():
    """``calibration.dtype: bfloat16``: the blocks compute in bf16 (their inputs arrive in bf16, within
    bf16's rounding of the float32 sweep's) and go back to the storage dtype."""
    model = tiny("llama").to(torch.bfloat16)
    ids = torch.randint(0, 128, (3, 24), generator=torch.Generator().manual_seed(0))
    in_bf16, in_fp32 = _Record(), _Record()
    run_sequential(model, ids, [in_bf16], torch.device("cpu"), compute=torch.bfloat16)
    run_sequential(model, ids, [in_fp32], torch.device("cpu"))
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    for a, b in zip(in_bf16.seen, in_fp32.seen):
        assert a.dtype == torch.bfloat16 and b.dtype == torch.float32
        torch.testing.assert_close(a.float(), b, atol=0.05, rtol=0.02)


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


@pytest.mark.parametrize(
    "recipe",
    ["  - gptq: {bits: 4, group_size: 32}\n", "  - sparsegpt: {pattern: '2:4', quantize: {bits: 4, group_size: 32}}\n"],
)
@pytest.mark.parametrize("model_type", ["llama", "gemma3_text"])
def test_replaying_attention_and_mlp_from_kept_inputs_changes_nothing(model_type, recipe, monkeypatch):
    """True-sequential stages rebuild attention/MLP outputs from o_proj's and down_proj's kept
    inputs instead of re-running them; the compressed weights are bit-identical to full forwards."""
    from compress.pipeline import BlockData, _Replay

    ids = torch.randint(0, 128, (3, 24))
    replayed, calls = tiny(model_type, layers=2), []
    replay_forward = _Replay.forward
    monkeypatch.setattr(_Replay, "forward", lambda self, *a, **k: calls.append(1) or replay_forward(self, *a, **k))
    compress_with(replayed, recipe, ids)
    # Each of the 2 blocks replays its attention at the gate/up and down stages (and once on sample 0
    # while checking that the MLP ends in down_proj); block 0's final forward runs whole (what it
    # hands the next block must be what the exported block computes).
    n = len(ids)
    assert len(calls) == 2 * (2 * n + 1)
    full = tiny(model_type, layers=2)
    monkeypatch.setattr(BlockData, "_output_tail", lambda self, module, linear: False)  # never replay
    compress_with(full, recipe, ids)
    for (name, a), b in zip(replayed.state_dict().items(), full.state_dict().values()):
        assert torch.equal(a, b), name


def test_no_replay_for_a_module_that_does_more_after_its_last_linear():
    from compress.hessian import Hessian
    from compress.pipeline import BlockData

    model = tiny("llama")
    block = decoder_layers(model)[0]
    data = BlockData(block, [torch.randn(1, 8, 64)], ((), {"position_embeddings": _rotary(model, 8)}))
    assert data._output_tail("mlp", "mlp.down_proj") is None  # the MLP returns down_proj's output itself
    assert data._output_tail("self_attn", "self_attn.o_proj") == (None,)  # (output, attention weights)
    block.mlp.register_forward_hook(lambda module, args, out: out * 2)
    assert data._output_tail("mlp", "mlp.down_proj") is False
    data.observe([("mlp.down_proj",)], Hessian, replay_after=True)
    assert "mlp" not in data.replay


def _rotary(model, length):
    positions = torch.arange(length)[None]
    return model.model.rotary_emb(torch.zeros(1, length, 64), positions)
