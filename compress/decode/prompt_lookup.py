"""Prompt lookup (Saxena 2023; REST-style datastore copying): candidates copied from the context or
from the model's own earlier outputs, sent only where they are expected to pay for their place."""

from __future__ import annotations

from .loop import common_prefix


def default_token_cost(target) -> float:
    """What one more token costs in a forward of ``target`` (a model or a runner), as a share of a
    one-token forward.

    Float linears on a CPU take more rows for little more than their weight reads (about 0.05).
    Our bf16 kernel reads a weight row once for all rows and pays arithmetic per row (about 0.25,
    from compiled steps of 2, 4 and 8 rows against one); the int4 and int8 kernels pay most of a
    step per row, priced at 0.7, so candidates are sent only where they are nearly sure. A GPU step
    and a padded compiled step compute a fixed number of rows (``Engine.step_rows``): more tokens
    are free. The measurements (``scripts/step_cost.py``): docs/decoder.md, "What a verify row costs".
    """
    padded = getattr(target, "compiled", None) is not None and not getattr(target, "rows_alone", False)
    if padded or target.device.type != "cpu":
        return 0.0
    matmuls = getattr(target, "matmuls", [])
    if all(m.rows_ride_along for m in matmuls):
        return 0.05
    return 0.25 if all(m.rows_ride_along or m.fmt == "bf16-avx2" for m in matmuls) else 0.7


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

    def __init__(
        self, max_ngram: int = 3, min_ngram: int = 1, token_cost: float = 0.0, memory: float = 0.95, store=None
    ):
        self.max_ngram, self.min_ngram, self.token_cost, self.memory = max_ngram, min_ngram, token_cost, memory
        self.store = store  # a ``Datastore`` of earlier outputs, consulted when it matches longer than the context
        keys = [
            (n, source)
            for n in range(1, max(max_ngram, store.max_ngram if store else 0) + 1)
            for source in ("context", "store")
        ]
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
