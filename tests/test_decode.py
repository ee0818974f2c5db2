"""The decoder: lossless speculation is token-identical to greedy, rollback is exact, and the
sampling rule keeps the target's distribution."""

import copy

import pytest
import torch
from transformers import DynamicCache

from compress.decode import DraftModel, PromptLookup, Sampling, accept_sampled, greedy, speculate
from compress.decode.loop import with_cache
from tests.conftest import compress_with, tiny


def _prompt(length=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    motif = torch.randint(0, 128, (10,), generator=g)
    return torch.cat([torch.randint(0, 128, (length - 20,), generator=g), motif, motif]).unsqueeze(0)  # repeats


def _proposers(model):
    draft = copy.deepcopy(model)
    compress_with(draft, "  - rtn: {bits: 4, group_size: 32}\n")  # a compressed copy drafts for the original
    return {
        "prompt lookup": PromptLookup(),
        "draft model": DraftModel(draft, threshold=0.0),
        "cost-aware prompt lookup": PromptLookup(token_cost=0.05),
    }


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_greedy_speculation_is_token_identical_to_greedy(seed):
    model = tiny("llama")
    prompt = _prompt(seed=seed)
    plain = greedy(model, prompt, 40)
    reference = model.generate(prompt, max_new_tokens=40, do_sample=False, min_new_tokens=40)[0, prompt.shape[1] :]
    assert plain.tokens == reference.tolist()
    for name, proposer in _proposers(model).items():
        result = speculate(model, prompt, 40, proposer, k=5)
        assert result.tokens == plain.tokens, name
        if name != "cost-aware prompt lookup":  # it may rightly withhold a random model's every guess
            assert result.accepted > 0, name  # it really speculated
            assert result.forwards < plain.forwards, name


def test_rollback_leaves_the_cache_as_if_the_rejected_tokens_were_never_seen():
    model = tiny("llama")
    prompt, rejected = _prompt(), torch.tensor([[5, 6, 7]])
    clean, rolled = DynamicCache(config=model.config), DynamicCache(config=model.config)
    with torch.no_grad():
        model(prompt, **with_cache(model, clean))
        model(prompt, **with_cache(model, rolled))
        model(rejected, **with_cache(model, rolled))
        rolled.crop(-3)
        for a, b in zip(clean.layers, rolled.layers):
            assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
        nxt = torch.tensor([[9]])
        assert torch.equal(
            model(nxt, **with_cache(model, clean)).logits, model(nxt, **with_cache(model, rolled)).logits
        )


def test_prompt_lookup_sends_fewer_guesses_as_the_output_refutes_them_and_all_once_it_copies():
    text = list(range(50))
    lookup, plain = PromptLookup(max_ngram=1, token_cost=0.2), PromptLookup(max_ngram=1)
    context, sent = text[:], []
    for i in range(10):  # a word of the text, then a new one: every 1-gram guess is refuted
        for token in (5 * i, 100 + i):
            context.append(token)
            guess = lookup.propose(context, 4)[0]
            if token < 100:
                assert plain.propose(context, 4)[0] == text[token + 1 : token + 5]  # no cost: sent in full
                assert guess == text[token + 1 : token + 1 + len(guess)]  # a prefix of the match
                sent.append(len(guess))
    assert sent[0] > 0 and sent == sorted(sent, reverse=True) and sent[-1] == 0, sent  # prior a = 1/2, then less
    assert lookup.rates(1)[0] < 0.1
    for token in range(20, 40):  # now the output copies the text: guesses withheld are still scored
        context.append(token)
        guess = lookup.propose(context, 4)[0]
    assert guess == [40, 41, 42, 43] and min(lookup.rates(1)) > 0.5


@pytest.mark.parametrize("deterministic_draft", [False, True])
def test_sampling_rule_keeps_the_target_distribution(deterministic_draft):
    """First token out of one speculative step, over many draws: chi-square against the target
    (5 categories, critical value 18.47 at p = 0.001; fixed seed, so deterministic)."""
    p = torch.tensor([0.05, 0.4, 0.25, 0.2, 0.1])
    q = torch.tensor([0.5, 0.1, 0.1, 0.1, 0.2])
    g = torch.Generator().manual_seed(0)
    draws = 8000
    counts = torch.zeros(5)
    for _ in range(draws):
        if deterministic_draft:
            candidate, draft = 0, None  # e.g. prompt lookup: always proposes token 0
        else:
            candidate, draft = int(torch.multinomial(q, 1, generator=g)), q[None]
        n, nxt = accept_sampled([candidate], torch.stack([p, p]), draft, g)
        counts[candidate if n == 1 else nxt] += 1
    expected = p * draws
    chi2 = ((counts - expected) ** 2 / expected).sum().item()
    assert chi2 < 18.47, (counts / draws, chi2)


def test_several_candidates_keep_the_target_distribution_at_every_depth():
    """Lookahead's verification of several deterministic candidates (two share a first token):
    chi-square of the first token against p0, and of the second given the first against that
    prefix's distribution (5 categories, critical value 18.47 at p = 0.001; fixed seed)."""
    from compress.decode.lookahead import accept_candidates

    p0 = torch.tensor([0.05, 0.4, 0.25, 0.2, 0.1])
    after = {1: torch.tensor([0.1, 0.1, 0.2, 0.3, 0.3]), 2: torch.tensor([0.3, 0.2, 0.1, 0.2, 0.2])}
    candidates, begins = [[1, 3], [1, 4], [2, 0]], [1, 3, 5]  # ids: next, 1 3, 1 4, 2 0
    rows = [p0, after[1], p0, after[1], p0, after[2], p0]  # the rows after a full candidate: unused here
    logits = torch.stack(rows).log()
    g, draws = torch.Generator().manual_seed(0), 8000
    first, second = torch.zeros(5), {1: torch.zeros(5), 2: torch.zeros(5)}
    for _ in range(draws):
        best, n, nxt = accept_candidates(candidates, begins, logits, Sampling(temperature=1.0), g)
        out = (candidates[best][:n] if n else []) + [nxt]
        first[out[0]] += 1
        if len(out) > 1:
            second[out[0]][out[1]] += 1
    for counts, p in [(first, p0), (second[1], after[1]), (second[2], after[2])]:
        expected = p * counts.sum()
        chi2 = ((counts - expected) ** 2 / expected).sum().item()
        assert chi2 < 18.47, (counts / counts.sum(), chi2)
    assert second[1].sum() == first[1] and second[2].sum() == first[2]  # a kept first token always gets a second


def test_sampled_speculation_runs_and_is_reproducible():
    model = tiny("llama")
    sampling = Sampling(temperature=0.8, top_p=0.9, seed=3)
    a = speculate(model, _prompt(), 30, PromptLookup(), sampling=sampling)
    b = speculate(model, _prompt(), 30, PromptLookup(), sampling=sampling)
    assert a.tokens == b.tokens and len(a.tokens) == 30
    from compress.decode.lookahead import lookahead

    a, b = (lookahead(model, _prompt(), 30, sampling=sampling) for _ in range(2))
    assert a.tokens == b.tokens and len(a.tokens) == 30 and a.accepted > 0  # the repeated motif gets kept


def test_self_speculation_with_a_layer_subset_is_token_identical_and_leaves_the_model_whole():
    from compress.decode import candidate_subsets, layer_subset, search_layers

    model = tiny("llama", layers=4)
    prompt = _prompt()
    plain = greedy(model, prompt, 30)
    for keep in ([0, 1], [0, 2, 3]):
        result = speculate(model, prompt, 30, DraftModel(layer_subset(model, keep), threshold=0.0), k=4)
        assert result.tokens == plain.tokens, keep
        assert result.proposed > 0
    assert len(model.model.layers) == 4 and greedy(model, prompt, 30).tokens == plain.tokens
    with torch.no_grad():  # all layers kept: the view is the model
        torch.testing.assert_close(
            layer_subset(model, [0, 1, 2, 3])(prompt).logits, model(prompt).logits, rtol=0, atol=0
        )
    assert all(s[0] == 0 for s in candidate_subsets(30))
    best, trials = search_layers(model, [prompt], max_new_tokens=8)
    assert best in [t["layers"] for t in trials] and len(trials) == len(candidate_subsets(4))


@pytest.mark.parametrize("shape", [(3, 3, 3), (5, 4, 5), (2, 2, 1)])
def test_lookahead_is_token_identical_to_greedy(shape):
    from compress.decode.lookahead import lookahead

    model = tiny("llama", layers=3)
    window, ngram, guesses = shape
    for seed in range(3):
        prompt = _prompt(seed=seed)
        plain = greedy(model, prompt, 40)
        result = lookahead(model, prompt, 40, window, ngram, guesses)
        assert result.tokens == plain.tokens, (shape, seed)
        assert result.forwards < plain.forwards  # the repeated motif gets verified in bulk


def test_lookahead_mask_and_positions_reproduce_plain_causal_logits():
    """Each window column and each candidate, run in one masked forward, scores exactly as the
    same tokens run alone after the prefix."""
    from compress.decode.lookahead import _layout

    model = tiny("llama")
    prefix, rows, candidates = _prompt(), [[1, 2, 3], [4, 5, 6]], [[7, 8], [9, 10, 11]]
    offsets, block = _layout(len(rows), 3, [len(c) for c in candidates])
    ids = [12, *rows[0], *rows[1], *candidates[0], *candidates[1]]
    t = prefix.shape[1]
    mask = torch.zeros(len(ids), t + len(ids)).masked_fill_(
        ~torch.cat([torch.ones(len(ids), t, dtype=torch.bool), block], 1), torch.finfo(torch.float32).min
    )
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        model(prefix, **with_cache(model, cache))
        joint = model(
            torch.tensor([ids]),
            position_ids=(t + offsets)[None],
            attention_mask=mask[None, None],
            **with_cache(model, cache),
        ).logits[0]

        def alone(sequence):
            return model(torch.cat([prefix, torch.tensor([sequence])], 1)).logits[0, t:]

        torch.testing.assert_close(joint[1:4], alone([12, 1, 2, 3])[1:], rtol=1e-4, atol=1e-5)  # row 0
        torch.testing.assert_close(joint[5], alone([12, 1, 2, 5])[-1], rtol=1e-4, atol=1e-5)  # row 1, column 1
        torch.testing.assert_close(joint[7:9], alone([12, 7, 8])[1:], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(joint[9:12], alone([12, 9, 10, 11])[1:], rtol=1e-4, atol=1e-5)


def test_lookahead_refuses_a_context_beyond_the_sliding_window():
    from compress.decode import DecodeError
    from compress.decode.lookahead import lookahead

    with pytest.raises(DecodeError, match="sliding window"):
        lookahead(tiny("gemma3_text"), _prompt(), 20)


def test_searched_layers_are_saved_with_the_checkpoint_and_read_back(tmp_path):
    from compress.decode import DecodeError, save_layers, saved_layers, search_layers

    model = tiny("llama", layers=4)
    assert saved_layers(tmp_path, 4) is None
    keep, trials = search_layers(model, [_prompt()], max_new_tokens=8)
    assert save_layers(tmp_path, keep, trials) == tmp_path / "self_spec_layers.json"
    assert saved_layers(tmp_path, 4) == keep
    assert save_layers(tmp_path / "no-such-folder", keep, trials) is None  # an alias, not a folder
    save_layers(tmp_path, [0, 2, 3], trials)
    with pytest.raises(DecodeError, match="layers 0-1"):
        saved_layers(tmp_path, 2)  # saved for a deeper model


def test_replay_runs_the_forwards_speculate_runs_and_the_oracle_sends_only_right_guesses(monkeypatch):
    """scripts/replay_prompt_lookup.py prices proposers from greedy output alone: its replay of
    the loop must send what the real loop sends."""
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "scripts"))
    from replay_prompt_lookup import Oracle, replay

    model, prompt = tiny("llama"), _prompt()
    output = greedy(model, prompt, 40).tokens
    context = prompt[0].tolist()
    for make in (PromptLookup, lambda: PromptLookup(token_cost=0.05)):
        real = speculate(model, prompt, 40, make(), k=10)
        widths = replay(context, output, make(), 40, set())
        assert (len(widths), sum(widths) - len(widths)) == (real.forwards - 1, real.proposed)
    oracle = replay(context, output, Oracle(output, len(context), any_match=False), 40, set())
    assert 1 + sum(oracle) == len(output)  # every guess it sends is right: each token comes from one forward slot


def test_every_method_in_the_table_runs_on_the_engine_and_the_lossless_ones_reproduce_greedy():
    """``methods.METHODS`` is what ``compress decode --method`` and ``bench_decode.py`` run."""
    from compress.decode.engine import Engine
    from compress.decode.methods import METHODS, Settings
    from compress.eagle import train_head

    model, prompt = tiny("llama"), _prompt()
    target = Engine(model, max_len=128)
    plain = greedy(target, prompt, 24).tokens
    draft = DraftModel(Engine(copy.deepcopy(model), max_len=128), threshold=0.0)
    head, _ = train_head(model, prompt, steps=2, lr=1e-3, batch=1, draft_vocab=64, progress=False)
    settings = Settings(draft=draft, layers=[0], exits=[0], exit_threshold=0.5, model=model, head=head)
    for name, method in METHODS.items():
        settings.draft = draft if method.draft != "none" else None
        tokens = method.run(target, prompt, 24, settings).tokens
        assert len(tokens) == 24, name
        if method.lossless:
            assert tokens == plain, name
    assert METHODS["greedy"].problem(greedy=False) and METHODS["draft"].problem(draft=False)
    assert METHODS["early-exit"].problem(quantized_cache=True) and not METHODS["prompt-lookup"].problem(store=True)
