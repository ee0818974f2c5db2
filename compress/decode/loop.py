"""The decoder: plain greedy decoding, and one propose–verify loop for every speculative method.

Each step of ``speculate`` takes the token the target already chose, asks a proposer for up
to ``k`` candidates after it, and scores all of them in one target forward with the KV
cache. Greedy keeps the longest prefix the target agrees with, so the output is the target's
own greedy output; sampling uses the speculative rejection rule (Leviathan et al. 2023, Chen
et al. 2023), so the output distribution is the target's. The cache is then cropped back
past the rejected candidates, and the target's distribution after the last kept token picks
the next token (the "bonus" token): every target forward yields at least one token.

The target is a ``Runner`` (``forward``, ``crop``, ``reset``): ``engine.Engine`` is the fast one
(our forward over a preallocated cache); ``HFRunner`` wraps a transformers model and its cache,
for what the engine does not cover, and a plain transformers model passed in is wrapped in one.
Candidates come from a ``Proposer`` (prompt lookup, a draft model, a layer subset). Lookahead
and early exit run loops of their own (``lookahead.py``, ``early_exit.py``): lookahead verifies a
tree of guesses in one step and keeps one branch (``keep``), which a linear propose–verify step
cannot express; early exit changes how the target computes each token (a hook inside its
forward), it proposes nothing.
"""

from __future__ import annotations

import inspect
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch
from transformers import DynamicCache


class Runner(Protocol):
    """A target the loop decodes with: a model and its KV cache (``engine.Engine``, ``HFRunner``)."""

    device: torch.device

    def forward(self, ids, all_logits: bool = True) -> torch.Tensor:
        """Float32 logits of ``ids`` appended to the cache: one row per token (or the last only)."""
        ...

    def crop(self, n: int) -> None:
        """Forget the last ``n`` cached tokens."""
        ...

    def reset(self) -> None:
        """Empty the cache."""
        ...


class Proposer(Protocol):
    """What drafts candidates for ``speculate``: prompt lookup, a draft model, a layer subset."""

    def propose(self, context: list[int], k: int) -> tuple[list[int], torch.Tensor | None]:
        """Up to ``k`` tokens to follow ``context``, and the draft's probabilities for them (None:
        a deterministic proposer, whose candidates sampling accepts by the target's alone)."""
        ...


class DecodeError(ValueError):
    """A decoding request that cannot run as asked; the message says what to change."""


@dataclass
class Sampling:
    """``temperature == 0`` is greedy."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """The distribution tokens are drawn from: softmax(logits / T), cut to the top-p nucleus."""
        p = torch.softmax(logits.float() / self.temperature, -1)
        if self.top_p < 1:
            sorted_p, order = p.sort(-1, descending=True)
            drop = sorted_p.cumsum(-1) - sorted_p >= self.top_p  # keep the smallest set reaching top_p
            sorted_p[drop] = 0
            p = torch.zeros_like(p).scatter(-1, order, sorted_p)
            p = p / p.sum(-1, keepdim=True)
        return p


@dataclass
class DecodeResult:
    tokens: list[int]  # the new tokens
    forwards: int  # target forward passes, the prompt's included
    seconds: float
    proposed: int = 0
    accepted: int = 0
    extra: dict = field(default_factory=dict)
    prompt_seconds: float = 0.0  # of ``seconds``, the prompt's forward (0: not measured apart)

    @property
    def tokens_per_forward(self) -> float:
        """New tokens per target forward after the prompt's (1.0 for plain decoding)."""
        return len(self.tokens) / max(1, self.forwards - 1)


def with_cache(module, cache) -> dict:
    """The keyword that hands ``module`` its KV cache: ``cache`` from transformers 5.24 on (which
    deprecates ``past_key_values``), ``past_key_values`` before."""
    name = _CACHE_KWARG.get(type(module))
    if name is None:
        params = inspect.signature(module.forward).parameters
        name = _CACHE_KWARG[type(module)] = "cache" if "cache" in params else "past_key_values"
    return {name: cache}


_CACHE_KWARG: dict[type, str] = {}


def forward_logits(model, ids: list[int] | torch.Tensor, cache, all_logits: bool = True) -> torch.Tensor:
    """A transformers model's float32 logits for ``ids`` appended to ``cache``, one row per token."""
    ids = torch.as_tensor(ids, device=device_of(model)).reshape(1, -1)
    out = model(input_ids=ids, **with_cache(model, cache), use_cache=True, logits_to_keep=0 if all_logits else 1)
    return out.logits[0].float()


def device_of(model) -> torch.device:
    return next(model.parameters()).device


class HFRunner:
    """A transformers model and its cache (dynamic, or a KIVI cache) as a runner."""

    def __init__(self, model, cache=None):
        self.model, self.device, self.config = model, device_of(model), model.config
        # with ``track_features``, the final-normed states of the last forward's rows, as ``Engine`` keeps
        self.track_features, self.features, self.features_start = False, None, 0
        self.reset(cache)

    def reset(self, cache=None) -> None:
        self.cache = cache if cache is not None else DynamicCache(config=self.model.config)

    def forward(self, ids: list[int] | torch.Tensor, all_logits: bool = True) -> torch.Tensor:
        return self.tracking(lambda: forward_logits(self.model, ids, self.cache, all_logits))

    def tracking(self, run: Callable[[], torch.Tensor]) -> torch.Tensor:
        """``run()``'s logits; with ``track_features``, the final norm's output of its rows kept too."""
        if not self.track_features:
            return run()
        from ..arch import arch_of

        captured = []
        norm = self.model.get_submodule(arch_of(self.model).norm)
        handle = norm.register_forward_hook(lambda _m, _i, out: captured.append(out))
        self.features_start = self.cache.get_seq_length()
        try:
            logits = run()
        finally:
            handle.remove()
        self.features = captured[-1][0]
        return logits

    def crop(self, n: int) -> None:
        if n:
            self.cache.crop(-n)


def runner_for(model, cache=None):
    """``model`` itself if it is a runner (reset to an empty cache), else an ``HFRunner`` around it."""
    if hasattr(model, "crop"):
        model.reset()
        return model
    return HFRunner(model, cache)


@torch.no_grad()
def greedy(
    model: Runner | torch.nn.Module,
    prompt: torch.Tensor,
    max_new_tokens: int,
    eos: set[int] = frozenset(),
    cache=None,
    stop: Callable[[list[int]], bool] | None = None,
) -> DecodeResult:
    """One token per forward, with the KV cache: the baseline every method is measured against.
    ``stop(tokens)``: ends the output early (a task's stop strings) once it says so."""
    runner, start = runner_for(model, cache), time.perf_counter()
    logits = runner.forward(prompt, all_logits=False)[-1]
    prompt_seconds = prompt_time(runner.device, start)
    tokens, forwards = [], 1
    while True:
        token = int(logits.argmax())
        tokens.append(token)
        if token in eos or len(tokens) >= max_new_tokens or (stop is not None and stop(tokens)):
            break
        logits = runner.forward([token])[-1]
        forwards += 1
    sync(runner.device)
    return DecodeResult(tokens, forwards, time.perf_counter() - start, prompt_seconds=prompt_seconds)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def prompt_time(device: torch.device, start: float) -> float:
    """Seconds since ``start`` once the prompt's forward is done: what steps after it are timed apart
    from (a prompt's forward is bound by arithmetic, a step's by weight reads)."""
    sync(device)
    return time.perf_counter() - start


def accept_greedy(candidates: list[int], target_logits: torch.Tensor) -> tuple[int, int]:
    """(accepted count, next token): candidates kept while they equal the target's argmax."""
    choices = target_logits.argmax(-1).tolist()
    n = common_prefix(candidates, choices)
    return n, choices[n]


def accept_sampled(
    candidates: list[int], target_probs: torch.Tensor, draft_probs: torch.Tensor | None, generator: torch.Generator
) -> tuple[int, int]:
    """The speculative rejection rule: keep candidate i with probability min(1, p_i / q_i); at the
    first rejection draw from normalize(max(0, p − q)); if all are kept, draw from the target.
    ``draft_probs`` None: deterministic candidates (q is one-hot)."""
    for i, token in enumerate(candidates):
        p = target_probs[i]
        q = draft_probs[i] if draft_probs is not None else torch.zeros_like(p).index_fill_(0, torch.tensor(token), 1.0)
        if torch.rand((), generator=generator).item() * q[token].item() < p[token].item():
            continue
        residual = (p - q).clamp(min=0)
        residual = residual / residual.sum() if residual.sum() > 0 else p
        return i, int(torch.multinomial(residual, 1, generator=generator))
    return len(candidates), int(torch.multinomial(target_probs[len(candidates)], 1, generator=generator))


@torch.no_grad()
def speculate(
    model: Runner | torch.nn.Module,
    prompt: torch.Tensor,
    max_new_tokens: int,
    proposer: Proposer,
    k: int = 8,
    sampling: Sampling = Sampling(),
    eos: set[int] = frozenset(),
    cache=None,
) -> DecodeResult:
    """Propose up to ``k`` tokens, verify them in one target forward, keep what the target accepts."""
    runner, start = runner_for(model, cache), time.perf_counter()
    asked, k = k, min(k, getattr(runner, "step_tokens", k + 1) - 1)  # a compiled engine's steps have fixed rows
    if k < 1 <= asked:
        print(
            "[decode: this engine's steps take one token (its kernels' cost grows with rows); "
            "nothing is drafted and this decodes as plain greedy]",
            file=sys.stderr,
        )
    generator = torch.Generator().manual_seed(sampling.seed)
    context = prompt.reshape(-1).tolist()
    logits = runner.forward(prompt, all_logits=False)[-1:]
    prompt_seconds = prompt_time(runner.device, start)
    if sampling.greedy:
        next_token = int(logits[-1].argmax())
    else:
        next_token = int(torch.multinomial(sampling.probs(logits[-1]).cpu(), 1, generator=generator))
    tokens, forwards, proposed, accepted = [], 1, 0, 0
    while not emit(tokens, context, [next_token], eos, max_new_tokens):
        room = min(k, max_new_tokens - len(tokens) - 1)  # the bonus token needs a place too
        candidates, draft_probs = proposer.propose(context, room) if room > 0 else ([], None)
        logits = runner.forward([next_token, *candidates])  # (1 + len(candidates), vocab)
        forwards += 1
        if sampling.greedy:
            n, next_token = accept_greedy(candidates, logits)
        else:
            n, next_token = accept_sampled(candidates, sampling.probs(logits).cpu(), draft_probs, generator)
        proposed, accepted = proposed + len(candidates), accepted + n
        if emit(tokens, context, candidates[:n], eos, max_new_tokens):
            break
        runner.crop(len(candidates) - n)  # forget the rejected candidates
    sync(runner.device)
    seconds = time.perf_counter() - start
    return DecodeResult(tokens[:max_new_tokens], forwards, seconds, proposed, accepted, prompt_seconds=prompt_seconds)


def emit(tokens: list[int], context: list[int], new: list[int], eos: set[int], max_new_tokens: int) -> bool:
    """Add accepted tokens to the output and the context, up to an end-of-sequence among them
    (it ends the output there); True when the output is complete."""
    stop = next((i for i, t in enumerate(new) if t in eos), None)
    new = list(new if stop is None else new[: stop + 1])
    tokens += new
    context += new
    return stop is not None or len(tokens) >= max_new_tokens


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def write_json(path: Path, payload, indent: int | None = None) -> None:
    """Write beside ``path``, then rename: a crash leaves the old file or the new one, never half of one."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(payload, indent=indent))
    os.replace(tmp, path)
