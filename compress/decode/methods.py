"""The decode methods by name: the one table that ``compress decode --method`` and
``scripts/bench_decode.py`` both read.

A method runs a target (an ``Engine`` or a transformers model) from a prompt with ``Settings``;
its traits say what it may be combined with, so the command line refuses a bad combination from
the table instead of a branch per method. Every method but early exit is a proposer on the one
propose–verify loop (``loop.speculate``) or plain greedy. Token trees (``eagle-tree``, and
lookahead's guesses) are verified by ``tree.speculate_tree`` and lookahead's own loop, and early
exit changes the target's forward itself (``early_exit.early_exit_greedy``): none is a list of
candidates that ``speculate`` could verify.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .draft import DraftModel, LookupThenDraft, choose_layers, layer_subset
from .loop import DecodeError, DecodeResult, Proposer, Sampling, greedy, runner_for, speculate
from .prompt_lookup import PromptLookup, default_token_cost


@dataclass
class Settings:
    """What the methods read; each reads its own fields and ignores the others."""

    eos: set[int] = field(default_factory=set)
    sampling: Sampling = field(default_factory=Sampling)
    k: int = 8  # tokens proposed per verify step
    draft: Proposer | None = None  # draft: the drafting model; prompt-lookup: drafts where lookup finds nothing
    threshold: float = 0.4  # a draft's confidence to go on proposing (draft, self-spec)
    token_cost: float | None = None  # prompt-lookup; None: ``default_token_cost`` of the target
    store: object | None = None  # prompt-lookup: a ``Datastore`` of earlier outputs
    layers: str | list[int] = "auto"  # self-spec: the drafting layers, or searched ("auto", needs the fields below)
    window: int = 3  # lookahead: Jacobi window W, n-gram size N, pool guesses G per step
    ngram: int = 3
    guesses: int = 5
    exits: list[int] | None = None  # early-exit: the exit layers (None: ``early_exit.default_exits``)
    exit_threshold: float | str = "auto"  # early-exit: confidence to leave, or calibrated (needs the fields below)
    exit_measure: str = "softmax"
    model: torch.nn.Module | None = None  # the transformers model under an engine target (calibration)
    tokenizer: object | None = None  # for searching layers and calibrating exits
    checkpoint: str | None = None  # where self-spec saves the layers it searched
    head: object | None = None  # eagle: the trained head (``formats.eagle_head.load_matching``)


@dataclass(frozen=True)
class Method:
    name: str
    run: Callable[[object, torch.Tensor, int, Settings], DecodeResult]
    summary: str
    lossless: bool = True  # greedy output, or the target's sampling distribution
    samples: bool = True  # takes a temperature
    draft: str = "none"  # a draft model: "none", "optional" or "required"
    datastore: bool = False  # reads a store of earlier outputs
    quantized_cache: bool = True  # runs on a KIVI (quantized) KV cache
    head: bool = False  # drafts with an EAGLE head (``--draft-head``, or the one saved with the model)

    def problem(self, greedy: bool = True, quantized_cache: bool = False, draft: bool = False, store: bool = False):
        """What is wrong with running this method so (sampling or not, on a KIVI cache, with a draft
        model, with a datastore), or None."""
        if not greedy and not self.samples:
            return f"--method {self.name} decodes greedily; drop --temperature (prompt-lookup and draft sample)"
        if quantized_cache and not self.quantized_cache:
            return f"--method {self.name} needs a full-precision KV cache; this checkpoint's is quantized (KIVI)"
        if self.draft == "required" and not draft:
            return f"--method {self.name} needs --draft MODEL (same tokenizer) or --draft self-w4"
        if self.draft == "none" and draft:
            return f"--draft is for --method draft or prompt-lookup, not {self.name}"
        if store and not self.datastore:
            return f"--datastore is for --method prompt-lookup, not {self.name}"
        return None


def _greedy(target, prompt, n, s: Settings) -> DecodeResult:
    return greedy(target, prompt, n, s.eos)


def _prompt_lookup(target, prompt, n, s: Settings) -> DecodeResult:
    cost = default_token_cost(target) if s.token_cost is None else s.token_cost
    proposer = PromptLookup(token_cost=cost, store=s.store)
    proposer = LookupThenDraft(proposer, s.draft) if s.draft is not None else proposer
    return speculate(target, prompt, n, proposer, s.k, s.sampling, s.eos)


def _draft(target, prompt, n, s: Settings) -> DecodeResult:
    return speculate(target, prompt, n, s.draft, s.k, s.sampling, s.eos)


def _eagle(target, prompt, n, s: Settings, lookup: bool = False, tree: bool = False) -> DecodeResult:
    from .eagle import EagleDraft
    from .tree import speculate_tree, tree_runner

    if s.head is None or s.model is None:
        raise DecodeError("--method eagle drafts with a trained head: give it and the transformers model")
    if tree:
        runner, window, rows = tree_runner(target)
        proposer = EagleDraft(s.head, s.model, runner, s.threshold, s.sampling)
        return speculate_tree(runner, prompt, n, proposer, s.k, s.sampling, s.eos, (window, rows))
    runner = runner_for(target)
    proposer = EagleDraft(s.head, s.model, runner, s.threshold, s.sampling)
    if lookup:
        cost = default_token_cost(runner) if s.token_cost is None else s.token_cost
        proposer = LookupThenDraft(PromptLookup(token_cost=cost, store=s.store), proposer)
    return speculate(runner, prompt, n, proposer, s.k, s.sampling, s.eos)


def _self_spec(target, prompt, n, s: Settings) -> DecodeResult:
    layers = s.layers
    if isinstance(layers, str):
        layers = choose_layers(target, s.tokenizer, s.checkpoint, layers, s.k, s.threshold)
    proposer = DraftModel(layer_subset(target, layers), s.threshold, s.sampling)
    return speculate(target, prompt, n, proposer, s.k, s.sampling, s.eos)


def _lookahead(target, prompt, n, s: Settings) -> DecodeResult:
    from .lookahead import lookahead

    return lookahead(target, prompt, n, s.window, s.ngram, s.guesses, s.eos, s.sampling)


def _early_exit(target, prompt, n, s: Settings) -> DecodeResult:
    from ..arch import decoder_layers
    from . import early_exit

    exits = s.exits or early_exit.default_exits(len(decoder_layers(s.model if s.model is not None else target)))
    threshold = s.exit_threshold
    if threshold == "auto":
        if s.model is None or s.tokenizer is None:
            raise DecodeError("early-exit calibrates its threshold on the model and its tokenizer; give both")
        threshold = early_exit.calibrated_threshold(s.model, s.tokenizer, exits, s.exit_measure)
    return early_exit.early_exit_greedy(target, prompt, n, threshold, exits, s.exit_measure, s.eos)


METHODS = {
    m.name: m
    for m in [
        Method("greedy", _greedy, "one token per forward: the reference", samples=False),
        Method(
            "prompt-lookup",
            _prompt_lookup,
            "candidates copied from the context (or a datastore), a draft model where none match",
            draft="optional",
            datastore=True,
        ),
        Method("draft", _draft, "a smaller model (or the target rounded to 4 bits) drafts", draft="required"),
        Method("self-spec", _self_spec, "a subset of the target's own layers drafts"),
        Method("eagle", _eagle, "a trained EAGLE head drafts from the target's own states", head=True),
        Method(
            "eagle-tree",
            lambda target, prompt, n, s: _eagle(target, prompt, n, s, tree=True),
            "the EAGLE head drafts a tree of --k tokens (EAGLE-2's likeliest paths), verified in one step",
            head=True,
        ),
        Method(
            "eagle-lookup",
            lambda target, prompt, n, s: _eagle(target, prompt, n, s, lookup=True),
            "candidates copied from the context where they match, the EAGLE head elsewhere",
            head=True,
            datastore=True,
        ),
        Method("lookahead", _lookahead, "Jacobi guesses and an n-gram pool verified in one forward"),
        Method(
            "early-exit",
            _early_exit,
            "a token leaves the forward at the first confident exit layer (lossy)",
            lossless=False,
            samples=False,
            quantized_cache=False,
        ),
    ]
}
DEFAULT = "prompt-lookup"
