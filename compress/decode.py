"""The decoder: plain greedy decoding, and one propose–verify loop for every speculative method.

Each step of ``speculate`` takes the token the target already chose, asks a proposer for up
to ``k`` candidates after it, and scores all of them in one target forward with the KV
cache. Greedy keeps the longest prefix the target agrees with, so the output is the target's
own greedy output; sampling uses the speculative rejection rule (Leviathan et al. 2023, Chen
et al. 2023), so the output distribution is the target's. The cache is then cropped back
past the rejected candidates, and the target's distribution after the last kept token picks
the next token (the "bonus" token): every target forward yields at least one token.

Proposers (``propose(context, k) -> (tokens, draft probabilities or None)``):

- ``PromptLookup``: the continuation of the latest earlier occurrence of the last n-gram, in
  the context or in a datastore of the model's earlier outputs.
- ``DraftModel``: a smaller model with the same tokenizer (a compressed checkpoint of the
  target works), drafting greedily while it is confident.
- Self-speculation: ``DraftModel(layer_subset(target, keep))``, the target itself with only
  some decoder layers run (Draft & Verify's layer skipping; the first ``n`` layers is
  early-exit drafting as in LayerSkip). ``search_layers`` picks ``keep`` by measured speed;
  ``save_layers`` keeps the choice with the checkpoint.
"""

from __future__ import annotations

import copy
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import DynamicCache


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

    @property
    def tokens_per_forward(self) -> float:
        """New tokens per target forward after the prompt's (1.0 for plain decoding)."""
        return len(self.tokens) / max(1, self.forwards - 1)


def _forward(model, ids: list[int] | torch.Tensor, cache, device, all_logits: bool = True) -> torch.Tensor:
    ids = torch.as_tensor(ids, device=device).reshape(1, -1)
    out = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=0 if all_logits else 1)
    return out.logits[0].float()


def _device(model) -> torch.device:
    return next(model.parameters()).device


@torch.no_grad()
def greedy(model, prompt: torch.Tensor, max_new_tokens: int, eos: set[int] = frozenset(), cache=None) -> DecodeResult:
    """One token per forward, with the KV cache: the baseline every method is measured against."""
    device, start = _device(model), time.perf_counter()
    cache = cache if cache is not None else DynamicCache(config=model.config)
    logits = _forward(model, prompt, cache, device, all_logits=False)[-1]
    tokens, forwards = [], 1
    while True:
        token = int(logits.argmax())
        tokens.append(token)
        if token in eos or len(tokens) >= max_new_tokens:
            break
        logits = _forward(model, [token], cache, device)[-1]
        forwards += 1
    _sync(device)
    return DecodeResult(tokens, forwards, time.perf_counter() - start)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def accept_greedy(candidates: list[int], target_logits: torch.Tensor) -> tuple[int, int]:
    """(accepted count, next token): candidates kept while they equal the target's argmax."""
    choices = target_logits.argmax(-1).tolist()
    n = common_prefix(candidates, choices)
    return n, choices[n]


def accept_sampled(candidates: list[int], target_probs: torch.Tensor, draft_probs: torch.Tensor | None,
                   generator: torch.Generator) -> tuple[int, int]:
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
def speculate(model, prompt: torch.Tensor, max_new_tokens: int, proposer, k: int = 8,
              sampling: Sampling = Sampling(), eos: set[int] = frozenset(), cache=None) -> DecodeResult:
    """Propose up to ``k`` tokens, verify them in one target forward, keep what the target accepts."""
    device, start = _device(model), time.perf_counter()
    generator = torch.Generator().manual_seed(sampling.seed)
    cache = cache if cache is not None else DynamicCache(config=model.config)
    context = prompt.reshape(-1).tolist()
    logits = _forward(model, prompt, cache, device, all_logits=False)[-1:]
    if sampling.greedy:
        next_token = int(logits[-1].argmax())
    else:
        next_token = int(torch.multinomial(sampling.probs(logits[-1]).cpu(), 1, generator=generator))
    tokens, forwards, proposed, accepted = [], 1, 0, 0
    while True:
        tokens.append(next_token)
        context.append(next_token)
        if next_token in eos or len(tokens) >= max_new_tokens:
            break
        room = min(k, max_new_tokens - len(tokens) - 1)  # the bonus token needs a place too
        candidates, draft_probs = proposer.propose(context, room) if room > 0 else ([], None)
        logits = _forward(model, [next_token, *candidates], cache, device)  # (1 + len(candidates), vocab)
        forwards += 1
        if sampling.greedy:
            n, next_token = accept_greedy(candidates, logits)
        else:
            n, next_token = accept_sampled(candidates, sampling.probs(logits).cpu(), draft_probs, generator)
        proposed, accepted = proposed + len(candidates), accepted + n
        kept = candidates[:n]
        stop = next((i for i, t in enumerate(kept) if t in eos), None)
        if stop is not None:  # an accepted end-of-sequence ends the output there
            tokens += kept[: stop + 1]
            break
        tokens += kept
        context += kept
        if len(candidates) > n:
            cache.crop(-(len(candidates) - n))  # forget the rejected candidates
    _sync(device)
    return DecodeResult(tokens[:max_new_tokens], forwards, time.perf_counter() - start, proposed, accepted)


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def default_token_cost(device: torch.device) -> float:
    """What one more token costs in a target forward, as a share of a one-token forward.

    Measured on this CPU (SmolLM2, fp32 linears on oneDNN, after a 300-token prompt): 68 ms
    for 1 token, 105 ms for 11, 126 ms for 17, so about 0.05 per token. On a GPU a few more
    tokens ride along with the weight reads, so they are taken as free.
    """
    return 0.05 if device.type == "cpu" else 0.0


class PromptLookup:
    """Candidates copied from the context: after the latest earlier occurrence of its last
    ``n`` tokens (``n`` from ``max_ngram`` down to ``min_ngram``), take what followed.

    Each candidate widens the target's forward, which a CPU charges for, so sending every
    guess makes decoding slower where guesses are usually wrong. Every proposal, sent or not,
    is scored against the tokens that really followed it. For each match length this gives
    two running rates: ``first``, how often a match's first candidate is right, and ``rest``,
    how often each later one is right once those before it were (a copied passage tends to
    stay right). The proposer sends the L candidates that maximise expected tokens per unit of
    forward cost, (1 + first·(1 + rest + … + rest^(L−1))) / (1 + token_cost·L), possibly none;
    ``token_cost`` 0 sends every candidate, as plain prompt lookup does. Greedy output is the
    same either way: only the speed differs.

    With a ``store`` (``compress.datastore.Datastore``: the model's outputs on earlier
    requests), a longer match there beats the context's; its matches keep rates of their own.
    """

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, token_cost: float = 0.0, memory: float = 0.95,
                 store=None):
        self.max_ngram, self.min_ngram, self.token_cost, self.memory = max_ngram, min_ngram, token_cost, memory
        self.store = store  # a ``Datastore`` of earlier outputs, consulted when it matches longer than the context
        keys = [(n, source) for n in range(1, max(max_ngram, store.max_ngram if store else 0) + 1)
                for source in ("context", "store")]
        self.hits = {key: [1.0, 1.0] for key in keys}  # [first, rest]; prior: both 1/2
        self.tries = {key: [2.0, 2.0] for key in keys}
        self.pending = []  # (context position, candidates, key) not yet scored

    def rates(self, n: int, source: str = "context") -> tuple[float, float]:
        """(first, rest): the running shares of ``n``-token matches' candidates the output confirmed."""
        key = (n, source)
        return self.hits[key][0] / self.tries[key][0], self.hits[key][1] / self.tries[key][1]

    def worth_sending(self, n: int, available: int, source: str = "context") -> int:
        """How many of ``available`` candidates from an ``n``-token match pay for their forward cost."""
        first, rest = self.rates(n, source)
        tokens, best, best_value = 1.0, 0, 1.0
        for length in range(1, available + 1):
            tokens += first * rest ** (length - 1)
            value = tokens / (1 + self.token_cost * length)
            if value > best_value:
                best, best_value = length, value
        return best

    def _score(self, context: list[int]) -> None:
        """Score pending proposals against what followed them: hits up to the first mismatch."""
        waiting = []
        for position, candidates, key in self.pending:
            followed = context[position : position + len(candidates)]
            hits = common_prefix(candidates, followed)
            if hits == len(followed) < len(candidates):  # all that followed so far agrees: wait for more
                waiting.append((position, candidates, key))
                continue
            judged_later = min(hits + 1, len(candidates)) - 1  # candidates after the first that were judged
            for i, (h, t) in enumerate([(min(hits, 1), 1), (max(hits - 1, 0), judged_later)]):  # [first, rest]
                self.hits[key][i] = self.memory * self.hits[key][i] + h
                self.tries[key][i] = self.memory * self.tries[key][i] + t
        self.pending = waiting

    def propose(self, context: list[int], k: int) -> tuple[list[int], None]:
        self._score(context)
        candidates, n = self._from_context(context, k)
        source = "context"
        if self.store is not None:
            stored, m = self.store.lookup(context, k)
            if m > n:  # the context wins ties: it knows this request
                candidates, n, source = stored, m, "store"
        if not n:
            return [], None
        self.pending.append((len(context), candidates, (n, source)))
        return candidates[: self.worth_sending(n, len(candidates), source)], None

    def _from_context(self, context: list[int], k: int) -> tuple[list[int], int]:
        """What followed the latest earlier occurrence of the longest matching n-gram, and n."""
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            if len(context) <= n:
                continue
            tail = context[-n:]
            for start in range(len(context) - n - 1, -1, -1):
                if context[start : start + n] == tail:
                    return context[start + n : start + n + k], n
        return [], 0


class DraftModel:
    """A smaller model drafts greedily (or samples, for sampled decoding) until its top
    probability falls below ``threshold``; its own cache follows the context, cropped back to
    the prefix it shares with it."""

    def __init__(self, draft, threshold: float = 0.4, sampling: Sampling = Sampling()):
        self.draft, self.threshold, self.sampling = draft, threshold, sampling
        self.cache, self.seen = DynamicCache(config=draft.config), []
        self.generator = torch.Generator().manual_seed(sampling.seed + 1)

    def _catch_up(self, context: list[int]) -> torch.Tensor:
        """Logits after ``context``: crop the cache to the common prefix, feed the rest."""
        common = 0
        for a, b in zip(self.seen, context[:-1]):
            if a != b:
                break
            common += 1
        if len(self.seen) > common:
            self.cache.crop(-(len(self.seen) - common))
        self.seen = context[:]
        return _forward(self.draft, context[common:], self.cache, _device(self.draft), all_logits=False)[-1]

    def propose(self, context: list[int], k: int):
        logits = self._catch_up(context)
        tokens, probs = [], []
        for _ in range(k):
            if self.sampling.greedy:
                p = torch.softmax(logits, -1)
                token = int(p.argmax())
            else:
                p = self.sampling.probs(logits).cpu()
                token = int(torch.multinomial(p, 1, generator=self.generator))
            if tokens and p[token] < self.threshold:
                break
            tokens.append(token)
            probs.append(p)
            if len(tokens) == k:
                break
            logits = _forward(self.draft, [token], self.cache, _device(self.draft))[-1]
            self.seen.append(token)
        return tokens, (None if self.sampling.greedy else torch.stack(probs))


def layer_subset(model, keep: list[int]):
    """A view of ``model`` that runs only the decoder layers ``keep`` (the same weights, no copy).

    Layer 0 must stay: the KV cache reads the sequence length from its first layer. Kept
    layers keep their index, so a cache built from the model's config serves the view.
    """
    from .arch import arch_of

    path = arch_of(model).layers.split(".")  # e.g. model.layers
    count = len(model.get_submodule(".".join(path)))
    keep = sorted(set(keep))
    if not keep or keep[0] != 0 or keep[-1] >= count:
        raise DecodeError(f"--layers must include layer 0 and stay within 0-{count - 1}")

    def rebuilt(module, rest):  # shallow copies down the path; the original model is untouched
        clone = copy.copy(module)
        clone._modules = dict(module._modules)
        child = module._modules[rest[0]]
        clone._modules[rest[0]] = torch.nn.ModuleList([child[i] for i in keep]) if len(rest) == 1 else \
            rebuilt(child, rest[1:])
        return clone

    return rebuilt(model, path)


def parse_layers(spec: str, count: int) -> list[int]:
    """``0-11`` or ``0,1,2,5-8`` -> layer indices."""
    out = []
    try:
        for part in spec.split(","):
            a, _, b = part.partition("-")
            out += list(range(int(a), int(b or a) + 1))
    except ValueError:
        raise DecodeError(f"--layers {spec!r}: write ranges and indices like 0-11 or 0,1,2,5-8") from None
    if any(i < 0 or i >= count for i in out):
        raise DecodeError(f"--layers {spec!r}: the model has layers 0-{count - 1}")
    return out


def candidate_subsets(count: int) -> list[list[int]]:
    """Early exits after a quarter to two thirds of the layers, and skipping every second layer
    of the second half or of the last two thirds (Draft & Verify finds later layers cheapest to skip)."""
    exits = sorted({max(1, round(count * f)) for f in (1 / 4, 1 / 3, 1 / 2, 2 / 3)})
    subsets = [list(range(n)) for n in exits]
    for start in (count // 2, count // 3):
        subsets.append([i for i in range(count) if i < start or (i - start) % 2 == 0])
    return subsets


SAVED_LAYERS = "self_spec_layers.json"  # next to a checkpoint's weights: the searched subset


def saved_layers(folder: str | Path, count: int) -> list[int] | None:
    """The layer subset a search saved with this checkpoint, if any."""
    path = Path(folder) / SAVED_LAYERS
    return parse_layers(json.loads(path.read_text())["layers"], count) if path.is_file() else None


def save_layers(folder: str | Path, keep: list[int], trials: list[dict]) -> Path | None:
    """Write the searched subset (and what each candidate measured) next to the checkpoint,
    atomically; None when ``folder`` is not a writable folder (e.g. a model alias)."""
    folder = Path(folder)
    if not folder.is_dir() or not os.access(folder, os.W_OK):
        return None
    write_json(folder / SAVED_LAYERS, {"layers": ",".join(map(str, keep)), "trials": trials}, indent=1)
    return folder / SAVED_LAYERS


def write_json(path: Path, payload, indent: int | None = None) -> None:
    """Write beside ``path``, then rename: a crash leaves the old file or the new one, never half of one."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(payload, indent=indent))
    os.replace(tmp, path)


@torch.no_grad()
def search_layers(model, prompts: list[torch.Tensor], max_new_tokens: int = 32, k: int = 8,
                  threshold: float = 0.4) -> tuple[list[int], list[dict]]:
    """The candidate subset with the most tokens per second on ``prompts`` (greedy, measured)."""
    from .arch import decoder_layers

    trials = []
    for keep in candidate_subsets(len(decoder_layers(model))):
        tokens, seconds, per_forward = 0, 0.0, []
        for prompt in prompts:
            result = speculate(model, prompt, max_new_tokens, DraftModel(layer_subset(model, keep), threshold), k)
            tokens, seconds = tokens + len(result.tokens), seconds + result.seconds
            per_forward.append(result.tokens_per_forward)
        trials.append({"layers": keep, "tokens_per_s": tokens / seconds,
                       "tokens_per_forward": sum(per_forward) / len(per_forward)})
    best = max(trials, key=lambda t: t["tokens_per_s"])
    return best["layers"], trials
