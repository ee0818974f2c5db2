"""The decode engine computes what transformers computes: token for token on the real SmolLM2
(fp32 and bf16) and on tiny random models of every supported family, a k-token verify equals k
one-token steps, and rollback, kernels, speculation and bad input behave."""

import os
import shutil
import time

import pytest
import torch

from compress.decode import (
    DecodeError,
    DraftModel,
    PromptLookup,
    choice,
    greedy,
    kernels,
    layer_subset,
    native,
    onednn,
    speculate,
    steps,
)
from compress.decode.engine import Engine
from tests.conftest import compress_with, tiny


def _prompt(length=24, seed=0, vocab=128):
    g = torch.Generator().manual_seed(seed)
    motif = torch.randint(0, vocab, (8,), generator=g)
    return torch.cat([torch.randint(0, vocab, (length - 16,), generator=g), motif, motif]).unsqueeze(0)


def _hf_greedy(model, prompt, n):
    out = model.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, prompt.shape[1] :].tolist()


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3", "mistral", "gemma3_text"])
def test_engine_greedy_equals_transformers_greedy_on_tiny_models(model_type):
    model = tiny(model_type, layers=4)
    if model_type == "qwen2":  # q/k/v biases
        for layer in model.model.layers:
            for lin in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                lin.bias.data.normal_(0, 0.5)
    prompt = _prompt()  # 24 tokens: past Gemma-3's 8-token sliding window
    engine = Engine(model, kernel="fp32", max_len=16)  # grows: 24 + 40 tokens do not fit in 16
    assert greedy(engine, prompt, 40).tokens == _hf_greedy(model, prompt, 40)
    assert engine.cache.max_len >= 64


def test_verify_step_equals_one_token_steps_and_crop_forgets():
    model = tiny("gemma3_text", layers=4)
    engine = Engine(model, kernel="fp32")
    prompt, more = _prompt(), [5, 17, 99, 3, 42, 7]
    engine.forward(prompt)
    together = engine.forward(more)
    engine.crop(len(more))
    one_by_one = torch.cat([engine.forward([t]) for t in more])
    torch.testing.assert_close(together, one_by_one, atol=1e-4, rtol=1e-4)
    engine.crop(4)  # rejected candidates: the next forward sees only what was kept
    after_crop = engine.forward([11])
    engine.reset()
    engine.forward(prompt)
    engine.forward(more[:2])
    torch.testing.assert_close(after_crop, engine.forward([11]), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("model_type", ["llama", "gemma3_text"])
def test_fixed_shape_step_equals_the_dynamic_step(model_type):
    """What a CUDA graph replays (attention over every cache slot under a mask, no value read
    back to the host), checked on the CPU against the step over the filled span."""
    model = tiny(model_type, layers=4)
    engine = Engine(model, kernel="fp32", max_len=64)
    engine.forward(_prompt())  # 24 tokens: past Gemma-3's 8-token sliding window
    for ids in ([7], [5, 17, 99, 3]):
        positions = torch.arange(engine.length, engine.length + len(ids))
        static, static_states = steps.static_logits(engine, torch.tensor(ids), positions)
        dynamic = engine.logits(engine.body(torch.tensor(ids), positions, engine.length + len(ids)))
        torch.testing.assert_close(static, dynamic, atol=1e-5, rtol=1e-5)
        engine.forward(ids)
        torch.testing.assert_close(static_states, engine.features, atol=1e-5, rtol=1e-5)  # what EAGLE reads


def test_cuda_graphs_are_refused_without_a_gpu():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(DecodeError, match="CUDA graphs need a CUDA device"):
        Engine(tiny("llama"), graphs=True)


@pytest.mark.slow
def test_engine_greedy_equals_transformers_greedy_on_smollm2(smollm2):
    import copy

    from compress import models

    tokenizer = smollm2.tokenizer
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Write a poem about the sea at night."}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )["input_ids"]
    bf16 = copy.deepcopy(smollm2.model)  # transformers in bf16, as stored
    fp32 = models.for_compute(copy.deepcopy(smollm2.model), torch.device("cpu"))
    assert greedy(Engine(fp32, kernel="fp32"), prompt, 24).tokens == greedy(fp32, prompt, 24).tokens
    engine = Engine(fp32, kernel="bf16")  # bf16 kernels: a bf16 stream, as transformers computes in bf16
    assert engine.dtype == torch.bfloat16
    plain = greedy(engine, prompt, 24).tokens
    if onednn.onednn_bf16_available():  # else our prompts run on an fp32 GEMM (``kernels.Dense``), whose
        assert plain == greedy(bf16, prompt, 24).tokens  # sums round apart from aten's bf16 GEMM
    engine.reset()  # in bf16 a verify step must round as one-token steps do, or speculation changes tokens
    engine.forward(prompt)
    more = plain[:8]
    together = engine.forward(more)
    engine.crop(len(more))
    assert torch.equal(together, torch.cat([engine.forward([t]) for t in more]))
    assert speculate(engine, prompt, 24, PromptLookup(), k=8).tokens == plain


def test_speculation_on_the_engine_is_token_identical_to_its_greedy():
    model = tiny("llama", layers=4)
    target = Engine(model, kernel="fp32")
    prompt = _prompt(40)
    plain = greedy(target, prompt, 40)
    drafts = {
        "prompt lookup": PromptLookup(),
        "self-w4 draft": DraftModel(Engine(model, quantize="w4"), 0.0),
        "layer subset": DraftModel(layer_subset(target, [0, 1, 3]), 0.0),
    }
    for name, proposer in drafts.items():
        result = speculate(target, prompt, 40, proposer, k=4)
        assert result.tokens == plain.tokens, name
        assert result.accepted > 0, name


@pytest.mark.parametrize("model_type", ["llama", "gemma3_text"])
def test_lookahead_on_the_engine_is_token_identical_to_its_greedy(model_type):
    """Lookahead's window and candidates in one eager step (each token over exactly the slots it
    sees), then its accepted branch moved behind the cache, give the engine's greedy tokens; in
    bf16 too, where a differently summed attention would show. A step holds at most 16 tokens."""
    from compress.decode.lookahead import lookahead

    for dtype in (torch.float32, torch.bfloat16):
        model = tiny(model_type, layers=2).to(dtype)
        for layer in model.model.layers:  # the tiny Gemma's 8-token window would refuse lookahead
            if getattr(layer.self_attn, "sliding_window", None):
                layer.self_attn.sliding_window = 100
        engine = Engine(model, kernel="bf16" if dtype == torch.bfloat16 else "fp32")
        for seed in range(3):
            prompt = _prompt(seed=seed)
            plain = greedy(engine, prompt, 40)
            result = lookahead(engine, prompt, 40, 3, 3, 5)
            assert result.tokens == plain.tokens, (dtype, seed)
            assert result.forwards < plain.forwards  # the repeated motif gets verified in bulk
            assert result.extra["guesses"] == 4  # 1 + (3 + 4) × 2 = 15 tokens: 5 guesses would not fit
            assert engine.length == prompt.shape[1] + 39  # the last token is not in the cache yet


@pytest.mark.skipif(not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"), reason="no int4 CPU kernel")
def test_kernels_hold_the_weights_they_are_offered_for():

    model = tiny("llama", layers=2).to(torch.bfloat16)  # stored in bf16, as checkpoints are
    compress_with(model, "  - rtn: {bits: 4, group_size: 32}\n")
    model.float()  # computed in fp32, as on a CPU
    q_proj = model.model.layers[0].self_attn.q_proj
    assert set(choice.exact_formats([q_proj], torch.device("cpu"))) >= {"fp32", "bf16", "int4"}
    assert "int4" not in choice.exact_formats([tiny("llama").model.layers[0].self_attn.q_proj], torch.device("cpu"))
    x = torch.randn(3, 64)
    reference = x @ q_proj.weight.T
    for fmt in ("fp32", "bf16", "int4"):  # bf16 rows in, so agreement to bf16's precision
        torch.testing.assert_close(
            kernels.build(fmt, [q_proj], torch.device("cpu"))(x), reference, atol=0.05, rtol=0.02
        )
    engine = Engine(model, kernel="auto")
    assert set(engine.timings["qkv"]) >= {"fp32", "bf16", "int4"}  # every exact format was timed
    assert engine.formats["qkv"] == min(engine.timings["qkv"], key=engine.timings["qkv"].get)


def test_kernel_timings_are_kept_per_machine(tmp_path, monkeypatch):
    """``auto`` times a group shape once per machine: a later process (here: the process memory
    cleared) reads the timings back instead of timing again, so it chooses the same kernels."""
    monkeypatch.setenv("COMPRESS_CACHE", str(tmp_path))
    monkeypatch.setattr(choice, "_TIMED", {})
    model = tiny("llama", layers=2)
    first = Engine(model, kernel="auto")
    saved = list((tmp_path / "kernels").glob("timings-*.json"))
    assert len(saved) == 1 and "qkv" in saved[0].read_text()

    monkeypatch.setattr(choice, "_TIMED", {})  # a new process

    def no_timing(*args, **kwargs):
        raise AssertionError("timed again")

    monkeypatch.setattr(choice, "_time_one_row", no_timing)
    again = Engine(model, kernel="auto")
    assert again.formats == first.formats and again.timings == first.timings


@pytest.mark.parametrize(
    "sinks,options",
    [
        (0, {}),
        (3, {}),
        (3, {"pre_rope": True}),
        (3, {"pre_rope": True, "key_group_size": 2, "fp8_key_scales": True, "rotate_values": True}),
        (0, {"residual": 0, "rotate_keys": True}),
    ],
)
def test_kivi_cache_on_the_engine_gives_the_tokens_of_kivi_decoding(sinks, options):
    from compress import kv_quant

    model = tiny("llama", layers=2)
    scheme = kv_quant.KVScheme(**{"bits": 2, "group_size": 4, "residual": 8, "sinks": sinks, **options})  # 2 bits
    kv_quant.install(model, scheme)
    prompt = _prompt(21)
    kivi = greedy(model, prompt, 40, cache=kv_quant.new_cache(model)).tokens
    assert kivi != greedy(Engine(tiny("llama", layers=2), kernel="fp32"), prompt, 40).tokens  # it changes tokens
    engine = Engine(model, kernel="fp32")
    assert greedy(engine, prompt, 40).tokens == kivi
    # 21 + 40 tokens, 60 cached: after the sinks, flushed in whole windows of 8 (without a window,
    # every token but the last, which a step flushes before it adds its own)
    assert engine.cache.quantized_upto == scheme.quantized_upto(59)
    with pytest.raises(DecodeError, match="KIVI"):
        engine.crop(10)


@pytest.fixture
def package_folder(tmp_path, monkeypatch):
    """Compiled steps go to a fresh folder: each test compiles, and nothing lands in the user's cache."""
    monkeypatch.setenv("COMPRESS_CACHE", str(tmp_path))
    return tmp_path / "engine"


def _compiled_or_skip(engine: Engine) -> None:
    """Skip where this machine cannot compile (no C++ compiler); any other failure fails the test."""
    if engine.compiled is None:
        if shutil.which("c++") or shutil.which("g++"):
            pytest.fail(engine.note)
        pytest.skip(engine.note)


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["llama", "gemma3_text"])
def test_compiled_step_computes_what_the_eager_step_computes(model_type, package_folder, monkeypatch):
    """The compiled one-token step (frozen weights, inductor's own GEMMs, logits in the graph)
    agrees with the eager step to fp32 rounding, through a cache that grows past the prompt; a
    second engine over the same weights loads the package from disk and computes the same bits."""
    model = tiny(model_type, layers=2)
    package_folder.mkdir(parents=True)
    stale, live = package_folder / "old.1.partial.pt2", package_folder / "new.2.partial.pt2"
    stale.write_bytes(b"killed"), live.write_bytes(b"being written")
    os.utime(stale, (time.time() - 2 * 86400,) * 2)  # a writer killed two days ago
    unused, foreign = package_folder / f"{'0' * 32}.pt2", package_folder / "mine.pt2"
    unused.write_bytes(b"an older package"), foreign.write_bytes(b"not ours")
    monkeypatch.setenv("COMPRESS_ENGINE_CACHE_GB", "0")  # room for the newest package only
    eager, compiled = Engine(model, kernel="fp32"), Engine(model, kernel="fp32", compile=True)
    prompt = _prompt()[0].tolist()
    eager.forward(prompt), compiled.forward(prompt)
    outputs = []
    for token in [5, 17, 99, 3, 42, 7]:
        expected, got = eager.forward([token]), compiled.forward([token])
        _compiled_or_skip(compiled)
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(compiled.features, eager.features, rtol=1e-4, atol=1e-4)  # an EAGLE head reads them
        outputs.append(got)
    assert compiled.compile_seconds > 0 and compiled.compiled.built
    # its own partial file renamed, a stale one removed, another process's recent one kept; over
    # the size limit, the older package removed, a file we did not write kept
    assert {p.name for p in package_folder.iterdir()} == {compiled.compiled.path.name, live.name, foreign.name}

    again = Engine(model, kernel="fp32", compile=True)
    again.forward(prompt)
    assert torch.equal(torch.cat([again.forward([t]) for t in [5, 17, 99, 3, 42, 7]]), torch.cat(outputs))
    assert again.compiled.built is False  # loaded, not compiled


def test_old_packages_go_least_recently_used_first(tmp_path, monkeypatch):
    """The package folder keeps under its size limit by removing the packages used longest ago."""
    sizes = {"a": 300, "b": 200, "c": 100}  # used 3, 2 and 1 hours ago
    for age, (name, size) in enumerate(sizes.items()):
        package = tmp_path / f"{name * 32}.pt2"
        package.write_bytes(bytes(size))
        os.utime(package, (time.time() - 3600 * (3 - age),) * 2)
    kept = tmp_path / f"{'d' * 32}.pt2"
    kept.write_bytes(bytes(400))
    steps._evict(kept, 750)  # 1000 bytes: "a", the oldest, goes
    assert sorted(p.name[0] for p in tmp_path.iterdir()) == ["b", "c", "d"]
    steps._evict(kept, 0)  # the newest stays even over the limit
    assert [p.name[0] for p in tmp_path.iterdir()] == ["d"]
    monkeypatch.setenv("COMPRESS_CACHE", str(tmp_path / "cache"))  # nothing lands in the user's cache
    monkeypatch.setenv("COMPRESS_ENGINE_CACHE_GB", "lots")
    with pytest.raises(DecodeError, match="number of gigabytes"):
        Engine(tiny("llama"), kernel="fp32", compile=True)


@pytest.mark.slow
def test_compiled_verify_steps_round_as_compiled_one_token_steps(package_folder):
    """In bf16, where summation order shows, a compiled k-token verify step equals k compiled
    one-token steps bit for bit (at cache lengths on both sides of the span's alignment), so prompt
    lookup on the compiled engine gives exactly the compiled engine's greedy tokens. (On this tiny
    model the rows agree even without the alignment; on SmolLM2 they did not: see
    ``scripts/step_cost.py --compile`` and docs/decoder.md.)"""
    model = tiny("llama", layers=2)
    engine = Engine(model, kernel="bf16", compile=True, step_rows=4)
    prompt = _prompt(56)
    plain = greedy(engine, prompt, 24)
    _compiled_or_skip(engine)
    assert engine.step_tokens == 4
    for length in (57, 58, 59, 60, 64):  # verify spans ending before and after 64 slots
        engine.reset()
        engine.forward(prompt[0, :length])
        together = engine.forward([5, 17, 99, 3])
        engine.crop(4)
        assert torch.equal(together, torch.cat([engine.forward([t]) for t in [5, 17, 99, 3]])), length
    result = speculate(engine, prompt, 24, PromptLookup(), k=8)  # k is capped at 3: the step takes 4 tokens
    assert result.tokens == plain.tokens and result.accepted > 0
    assert result.proposed <= 3 * (result.forwards - 1)


@pytest.mark.slow
def test_compiled_steps_on_native_kernels_take_exactly_their_tokens(package_folder):
    """On our kernels, which compute every row alone, the compiled graph takes 1 to ``step_rows``
    rows unpadded (a one-token step pays for one row): a 4-token verify step still equals 4
    one-token steps bit for bit, so prompt lookup on it gives the compiled greedy's tokens."""
    if not native.available():
        pytest.skip("our kernels need an x86 CPU with AVX2 and a C++ compiler")
    model = tiny("llama", hidden=128).to(torch.bfloat16)
    engine = Engine(model, kernel="bf16-avx2", compile=True)
    assert set(engine.formats.values()) == {"bf16-avx2"} and engine.rows_alone and engine.step_tokens == 8
    prompt = _prompt(56)
    plain = greedy(engine, prompt, 24)
    _compiled_or_skip(engine)
    engine.reset()
    engine.forward(prompt[0])
    together = engine.forward([5, 17, 99, 3])
    engine.crop(4)
    assert torch.equal(together, torch.cat([engine.forward([t]) for t in [5, 17, 99, 3]]))
    result = speculate(engine, prompt, 24, PromptLookup(), k=7)
    assert result.tokens == plain.tokens and result.accepted > 0


def test_eager_fallback_when_compiling_fails(package_folder, capsys):
    model = tiny("llama")
    engine = Engine(model, kernel="fp32", compile=True)

    def broken(*args, **kwargs):
        raise RuntimeError("no C++ compiler found")

    engine.compiled = broken
    prompt = _prompt()
    assert greedy(engine, prompt, 8).tokens == _hf_greedy(model, prompt, 8)
    assert engine.compiled is None and "running eager" in capsys.readouterr().err


def test_bad_requests_get_one_clear_error():
    model = tiny("llama")  # max_position_embeddings 256
    engine = Engine(model, kernel="fp32")
    with pytest.raises(DecodeError, match="context is 256 tokens"):
        engine.forward(torch.zeros(300, dtype=torch.long))
    model.config.model_type = "gpt2"
    with pytest.raises(DecodeError, match="supports llama"):
        Engine(model)
