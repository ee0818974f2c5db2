"""Lookahead decoding (Fu et al. 2024): no draft model, the target guesses its own future.

Every step is one target forward over three groups of tokens, separated by an attention mask:

- the token the target chose last (``next``, at position ``t``);
- the lookahead window: ``rows`` past Jacobi iterations (up to ``ngram - 1``) of guesses for
  the ``window`` positions after it. Row ``r``, column ``j`` sits at position ``t + 1 + j + r``
  and sees row 0 up to column ``j`` and rows ``1..r`` of its own column: one sequence with
  contiguous positions. Its prediction becomes row ``r + 1`` of the next step (a Jacobi
  update), and each full column plus the last row's prediction is an ``ngram``-gram for the pool;
- the verification branch: up to ``guesses`` (``ngram - 1``)-token continuations of ``next``
  from the pool, each seeing only itself. The longest one the target agrees with is kept
  (greedy, so the output is the target's greedy output); the KV cache keeps the entries of
  ``next`` and of the accepted tokens and drops the rest.

The prompt seeds the pool, so on text that repeats its input this is prompt lookup with
several candidates at once. With sampling, the candidates are verified by the rejection rule
for several deterministic drafts (``accept_candidates``), so the output follows the target's
distribution; the window keeps its greedy Jacobi updates (it only feeds the pool).
"""

from __future__ import annotations

import time
from collections import OrderedDict

import torch

from .loop import DecodeError, DecodeResult, Sampling, emit, sync
from .tree import pick, tree_runner


class NgramPool:
    """Continuations seen after each token, most recent last, at most ``size`` per token."""

    def __init__(self, size: int):
        self.size, self.table = size, {}

    def add(self, key: int, rest: tuple[int, ...]) -> None:
        entries = self.table.setdefault(key, OrderedDict())
        entries.pop(rest, None)
        entries[rest] = None
        if len(entries) > self.size:
            entries.popitem(last=False)

    def get(self, key: int) -> list[tuple[int, ...]]:
        return list(self.table.get(key, ()))

    def seed(self, tokens: list[int], ngram: int) -> None:
        for i in range(len(tokens) - ngram + 1):
            self.add(tokens[i], tuple(tokens[i + 1 : i + ngram]))


def _layout(rows: int, window: int, candidates: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(position offsets from ``t``, which new token may attend to which) for one step."""
    offsets, allowed = [0], [[0]]
    for r in range(rows):
        for j in range(window):
            offsets.append(1 + j + r)
            sees = [1 + c for c in range(j + 1)] + [1 + q * window + j for q in range(1, r + 1)]
            allowed.append([0, *sees])
    start = 1 + rows * window
    for length in candidates:
        for i in range(length):
            offsets.append(1 + i)
            allowed.append([0, *range(start, start + i + 1)])
        start += length
    size = len(offsets)
    mask = torch.zeros(size, size, dtype=torch.bool)
    for row, cols in enumerate(allowed):
        mask[row, cols] = True
    return torch.tensor(offsets), mask


def accept_candidates(
    candidates: list[list[int]], begins: list[int], logits: torch.Tensor, sampling: Sampling, generator: torch.Generator
) -> tuple[int | None, int, int]:
    """Verify several candidates at once, walking them as a tree.

    At depth ``n`` the alive candidates share the accepted prefix, so any one's logits row is
    the target's distribution there (row 0 before any token; row ``begin + n - 1`` after ``n``).
    Greedy keeps the offered token equal to the argmax. Sampling tries the distinct offered
    tokens in turn, keeping token ``t`` with probability ``p(t)`` and otherwise removing ``t``
    from ``p`` and renormalising: the rejection rule for deterministic drafts, applied to
    several, so the token kept or drawn follows ``p``.
    Returns (a candidate holding the accepted prefix, or None; its length; the next token).
    """
    alive, n, row = list(range(len(candidates))), 0, 0
    while True:
        offered = [i for i in alive if len(candidates[i]) > n]
        token = pick(logits[row], list(dict.fromkeys(candidates[i][n] for i in offered)), sampling, generator)
        kept = [i for i in offered if candidates[i][n] == token]
        if not kept:
            return (alive[0] if n else None), n, token
        alive, n = kept, n + 1
        row = begins[alive[0]] + n - 1


@torch.no_grad()
def lookahead(
    model,
    prompt: torch.Tensor,
    max_new_tokens: int,
    window: int = 3,
    ngram: int = 3,
    guesses: int = 5,
    eos: set[int] = frozenset(),
    sampling: Sampling = Sampling(),
) -> DecodeResult:
    """Decoding with a ``window`` × ``ngram - 1`` Jacobi window and up to ``guesses`` pool
    candidates verified per forward, on the decode engine or a transformers model: greedy
    (token-identical to greedy decoding) or sampled (the target's distribution). The paper's
    defaults are 15, 5, 15 (for GPUs); 3, 3, 5 was fastest of six shapes tried for SmolLM2-135M
    on a 2-core CPU. On the engine a step holds at most ``kernels.VERIFY_ROWS`` tokens, so that
    its matmuls score each candidate as a one-token step would: fewer guesses are sent where the
    shape asks for more (``extra["guesses"]`` says how many)."""
    if window < 1 or ngram < 2 or guesses < 0:
        raise DecodeError("lookahead needs --window ≥ 1, --ngram ≥ 2 and --guesses ≥ 0")
    runner, limit, most_rows = tree_runner(model)
    guesses = max(0, min(guesses, (most_rows - 1) // (ngram - 1) - window))
    if 1 + window * (ngram - 1) > most_rows:
        raise DecodeError(
            f"a lookahead step of --window {window} and --ngram {ngram} holds more than {most_rows} "
            "tokens, the most the engine scores exactly: make them smaller"
        )
    start = time.perf_counter()
    context = prompt.reshape(-1).tolist()
    if len(context) + max_new_tokens + window * (ngram - 1) + guesses * (ngram - 1) >= limit:
        raise DecodeError(
            f"lookahead decoding needs the whole context inside the model's sliding window ({limit} "
            "tokens): shorten the prompt or --max-new-tokens, or use --method prompt-lookup"
        )
    pool = NgramPool(guesses)
    pool.seed(context, ngram)
    generator = torch.Generator().manual_seed(sampling.seed)  # the window's first guesses, and sampling
    rows = [[context[int(i)] for i in torch.randint(len(context), (window,), generator=generator)]]
    last_logits = runner.forward(prompt, all_logits=False)[-1:]
    _, _, next_token = accept_candidates([], [], last_logits, sampling, generator)
    tokens, forwards, proposed, accepted = [], 1, 0, 0
    while not emit(tokens, context, [next_token], eos, max_new_tokens):
        room = max_new_tokens - len(tokens) - 1  # the bonus token needs a place too
        candidates = [c[:room] for c in pool.get(next_token)] if room > 0 else []
        t = runner.length
        offsets, block = _layout(len(rows), window, [len(c) for c in candidates])
        ids = [next_token, *(tok for row in rows for tok in row), *(tok for c in candidates for tok in c)]
        logits = runner.forward_tree(ids, offsets, block)
        forwards += 1

        # Jacobi update of the window (greedy: it only feeds the pool); a full window yields one n-gram per column
        first = 1 + (len(rows) - 1) * window
        last = logits[first : first + window].argmax(-1).tolist()
        if len(rows) == ngram - 1:
            for j in range(window):
                pool.add(rows[0][j], tuple(row[j] for row in rows[1:]) + (last[j],))
            rows = rows[1:]
        rows.append(last)

        begins = [len(ids) - sum(map(len, candidates))]
        for c in candidates[:-1]:
            begins.append(begins[-1] + len(c))
        best, n, next_token = accept_candidates(candidates, begins, logits, sampling, generator)
        proposed, accepted = proposed + (len(candidates[0]) if candidates else 0), accepted + n
        kept = list(candidates[best][:n]) if n else []
        runner.keep(t + 1, [t + begins[best] + i for i in range(n)] if n else [])
        if emit(tokens, context, kept, eos, max_new_tokens):
            break
        for i in range(max(0, len(context) - len(kept) - ngram + 1), len(context) - ngram + 1):
            pool.add(context[i], tuple(context[i + 1 : i + ngram]))  # the output seeds the pool too
    sync(runner.device)
    return DecodeResult(
        tokens[:max_new_tokens], forwards, time.perf_counter() - start, proposed, accepted, extra={"guesses": guesses}
    )
