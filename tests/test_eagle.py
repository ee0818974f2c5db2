"""EAGLE draft heads: greedy drafting with a head is token-identical to greedy, the head reads the
target's own states of every verified token, the export reloads and drafts identically, and a
head for another model is refused in one line."""

import json
import subprocess
import sys

import pytest
import torch

from compress.decode import greedy, speculate
from compress.decode.eagle import EagleDraft
from compress.decode.engine import Engine
from compress.decode.loop import HFRunner, Sampling
from compress.eagle import EagleHead, HeadConfig, target_features, train_head
from compress.formats import eagle_head
from compress.passes import RecipeError
from compress.recipe import parse
from tests.conftest import tiny, tiny_folder


def _own_text(model, rows=6, length=48):
    """Greedy continuations of random starts: text the model itself predicts, so that a head
    trained on it gets drafts accepted and the accepted path is exercised."""
    g = torch.Generator().manual_seed(0)
    starts = torch.randint(0, model.config.vocab_size, (rows, 4), generator=g)
    return torch.stack([torch.cat([s, torch.tensor(greedy(model, s[None], length - 4).tokens)]) for s in starts])


@pytest.fixture(scope="module", params=["llama", "gemma3_text"])
def trained(request):
    model = tiny(request.param, layers=2)
    head, log = train_head(model, _own_text(model), steps=60, lr=3e-3, batch=2, draft_vocab=96, progress=False)
    return request.param, model, head, log


def _runners(model_type, model):
    # transformers' sliding-window cache cannot roll back past its window: Gemma-3 runs on our engine only
    return {"engine": Engine(model, kernel="fp32", max_len=256)} | (
        {"transformers": HFRunner(model)} if model_type == "llama" else {}
    )


def test_greedy_eagle_is_token_identical_to_greedy_and_reads_the_targets_states(trained):
    model_type, model, head, log = trained
    assert log["loss_last"] < log["loss_first"]
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 128, (1, 20), generator=g)  # past Gemma's window of 8
    plain = greedy(model, prompt, 40).tokens
    for name, runner in _runners(model_type, model).items():
        draft = EagleDraft(head, model, runner, threshold=0.0)
        result = speculate(runner, prompt, 40, draft, k=4)
        assert result.tokens == plain, name
        assert result.accepted > 0, name  # the accepted path ran
        # the states the head holds are the target's own, token for token
        context = prompt[0].tolist() + result.tokens
        held = len(draft.states)
        assert draft.seen == context[:held] and held >= len(context) - 6  # all but the last step's
        torch.testing.assert_close(
            draft.states, target_features(model, [torch.tensor(context)])[0][:held], atol=1e-5, rtol=1e-5
        )


def test_eagle_methods_reproduce_greedy_and_lookup_keeps_the_head_in_step(trained):
    from compress.decode.methods import METHODS, Settings

    model_type, model, head, _ = trained
    motif = torch.arange(10, 20)
    prompt = torch.cat([torch.randint(0, 128, (12,), generator=torch.Generator().manual_seed(2)), motif, motif])[None]
    target = Engine(model, kernel="fp32", max_len=256)
    plain = greedy(target, prompt, 32).tokens
    settings = Settings(head=head, model=model, threshold=0.0, k=4)
    for name in ("eagle", "eagle-lookup"):
        assert METHODS[name].run(target, prompt, 32, settings).tokens == plain, name


def test_sampled_eagle_proposes_a_distribution_over_its_vocabulary_and_is_reproducible(trained):
    _, model, head, _ = trained
    prompt = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(3))
    sampling = Sampling(temperature=0.8, seed=5)
    runner = Engine(model, kernel="fp32", max_len=256)
    runner.forward(prompt[0])
    draft = EagleDraft(head, model, runner, threshold=0.0, sampling=sampling)
    tokens, probs = draft.propose(prompt[0].tolist() + [7], 3)
    assert len(tokens) == 3 and probs.shape == (3, model.config.vocab_size)
    torch.testing.assert_close(probs.sum(-1), torch.ones(3))
    outside = torch.ones(model.config.vocab_size, dtype=torch.bool)
    outside[head.draft_tokens] = False
    assert probs[:, outside].abs().max() == 0 and all(t in head.draft_tokens.tolist() for t in tokens)
    engines = [Engine(model, kernel="fp32", max_len=256) for _ in range(2)]
    a, b = (speculate(e, prompt, 24, EagleDraft(head, model, e, 0.0, sampling), 4, sampling).tokens for e in engines)
    assert a == b


def test_tree_eagle_is_token_identical_to_greedy_and_accepts_more_than_its_chain(trained):
    from compress.decode.methods import METHODS, Settings

    model_type, model, head, _ = trained
    prompt = torch.randint(0, 128, (1, 20), generator=torch.Generator().manual_seed(1))
    plain = greedy(model, prompt, 40).tokens
    settings = Settings(head=head, model=model, threshold=0.0, k=6)
    targets = {"engine": Engine(model, kernel="fp32", max_len=256)} | (
        {"transformers": model} if model_type == "llama" else {}
    )
    for name, target in targets.items():
        tree = METHODS["eagle-tree"].run(target, prompt, 40, settings)
        assert tree.tokens == plain, name
        chain = METHODS["eagle"].run(target, prompt, 40, Settings(head=head, model=model, threshold=0.0, k=6))
        assert tree.accepted >= chain.accepted > 0, name  # the chain is one of the tree's paths
    sampled = Settings(head=head, model=model, k=6, sampling=Sampling(temperature=0.8, seed=4))
    engines = [Engine(model, kernel="fp32", max_len=256) for _ in range(2)]
    a, b = (METHODS["eagle-tree"].run(e, prompt, 24, sampled).tokens for e in engines)
    assert a == b and len(a) == 24


@pytest.mark.parametrize("model_type", ["llama", "gemma3_text"])
def test_a_tree_step_gives_each_node_the_logits_of_its_path_decoded_in_order(model_type):
    from compress.decode.tree import TokenTree, tree_runner

    model = tiny(model_type, layers=2)
    prompt = torch.randint(0, 128, (9,), generator=torch.Generator().manual_seed(6))  # Gemma's window: 8
    tree = TokenTree([5, 11, 12, 13, 14, 15, 16], [-1, 0, 0, 1, 1, 2, 3])  # two levels of branching
    makers = [(1e-5, lambda: Engine(model, kernel="fp32", max_len=64))]
    makers += [(1e-4, lambda: model)] if model_type == "llama" else []  # (transformers' window cache: no tree)
    for tolerance, make in makers:
        runner, _, _ = tree_runner(make())
        runner.forward(prompt)
        logits = runner.forward_tree(tree.tokens, tree.depths, tree.visible)
        for node in range(len(tree.tokens)):
            path = [node]
            while tree.parents[path[-1]] >= 0:
                path.append(tree.parents[path[-1]])
            sequential, _, _ = tree_runner(make())
            sequential.forward(prompt)
            for n in reversed(path):
                last = sequential.forward([tree.tokens[n]])[-1]
            torch.testing.assert_close(logits[node], last, atol=tolerance, rtol=tolerance)


def test_a_tree_larger_than_the_engines_exact_step_is_refused(trained):
    from compress.decode.loop import DecodeError
    from compress.decode.methods import METHODS, Settings

    _, model, head, _ = trained
    with pytest.raises(DecodeError, match="larger than the 16 tokens this engine's step scores exactly: give --k 15"):
        METHODS["eagle-tree"].run(
            Engine(model, kernel="fp32"), torch.tensor([[1, 2]]), 8, Settings(head=head, model=model, k=16)
        )


@pytest.fixture(scope="module")
def folders(tmp_path_factory, smollm2):
    root = tmp_path_factory.mktemp("eagle")
    model = tiny_folder(root / "model", smollm2.tokenizer, layers=2, weight_scale=3.0)
    return model, root


RECIPE = """calibration: {source: wikitext2, samples: 4, seqlen: 64}
passes:
  - rtn: {bits: 4, group_size: 32}
  - eagle: {steps: 20, batch: 2, draft_vocab: 512}
"""


def test_the_export_holds_the_head_and_it_reloads_and_drafts_identically(folders):
    from compress import models
    from compress.apply import apply
    from compress.eagle import EagleState
    from compress.formats.gguf_integers import attach_export_integers

    folder, root = folders
    out = root / "out"
    report = apply(parse(RECIPE), str(folder), out, "cpu", evaluate_after=False)
    assert set(report.training["passes[1].eagle"]) >= {"loss_first", "loss_last", "seconds"}
    config = json.loads((out / "eagle" / "config.json").read_text())
    assert config["num_hidden_layers"] == 1 and config["eagle"]["head"]["draft_vocab"] == 512
    head = eagle_head.read(out)
    names = set(head.state_dict())
    assert {"fc.weight", "layers.0.self_attn.q_proj.weight", "layers.0.mlp.down_proj.weight"} <= names
    assert not any("input_layernorm" in n or "embed" in n or "lm_head" in n for n in names)  # EAGLE-1, shared
    # the size of the model is the model's: the head is beside it
    assert report.size_mb * 1e6 < sum(p.stat().st_size for p in out.rglob("*.safetensors"))
    loaded = models.load(str(out), torch.float32)
    model = loaded.model
    attach_export_integers(model, str(out))
    assert EagleState.of(model) is None  # a loaded model carries no head: decode reads it from eagle/
    prompt = loaded.tokenizer("The tower is 324 metres tall, about the same", return_tensors="pt").input_ids
    plain = greedy(model, prompt, 16).tokens
    proposals = []
    for again in (head, eagle_head.read(out / "eagle")):
        runner = Engine(model, kernel="fp32", max_len=128)
        draft = EagleDraft(again, model, runner, threshold=0.0)
        result = speculate(runner, prompt, 16, draft, k=4)
        assert result.tokens == plain
        proposals.append((result.proposed, result.accepted))
    assert proposals[0] == proposals[1]


def _decode(*args):
    return subprocess.run(
        [sys.executable, "-m", "compress", "decode", *args], capture_output=True, text=True, timeout=300
    )


def test_a_head_for_another_model_or_none_is_refused_in_one_line(folders):
    folder, root = folders
    (root / "wider-head").mkdir(exist_ok=True)
    if not (root / "wider-head" / eagle_head.FOLDER).exists():
        eagle_head.write(EagleHead(HeadConfig.for_target(tiny("llama", hidden=96).config, 64)), root / "wider-head", {})
    common = ("--prompt", "hi", "--method", "eagle", "--max-new-tokens", "4", "--raw")
    result = _decode(str(folder), *common, "--draft-head", str(root / "wider-head"))
    assert result.returncode == 2, result.stderr[-2000:]
    assert "trained for another model: it has hidden size 96, the target's is 64" in result.stderr
    result = _decode(str(folder), *common)
    assert result.returncode == 2 and "has no EAGLE head beside it" in result.stderr
    result = _decode(str(folder), "--prompt", "hi", "--method", "greedy", "--draft-head", str(root / "wider-head"))
    assert result.returncode == 2 and "--draft-head is for --method eagle" in result.stderr
    assert "Traceback" not in result.stderr


def test_the_eagle_pass_must_come_last():
    with pytest.raises(RecipeError, match="must follow every block pass"):
        parse("passes:\n  - eagle: {steps: 5}\n  - rtn: {bits: 4}\n")
