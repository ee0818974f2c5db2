"""Drafting with an EAGLE head (``compress.eagle``): a proposer for ``loop.speculate``.

The head reads the target's final-normed states, which the runner keeps from its last forward
(``features``, from ``features_start`` on): after a verify step the states of the tokens the
target accepted are its own, the head appends them to its cache, and drafts from there, feeding
its own predicted states back for each further token. ``propose`` drafts a chain for
``loop.speculate``: the head's most likely token (or a sample, when decoding samples) while its
probability stays above ``threshold``. ``propose_tree`` drafts a tree for ``tree.speculate_tree``
(EAGLE-2's dynamic tree: the likeliest paths by the head's own probabilities). The target
verifies either, so greedy output is the target's greedy output.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..eagle import EagleHead, HeadCache, head_logits
from .loop import DecodeError, Sampling, common_prefix
from .tree import TokenTree


class EagleDraft:
    """``model``: the transformers model the target runs (its embedding and lm_head are shared with
    the head); ``runner``: the runner ``speculate`` decodes with, whose states the head reads."""

    def __init__(
        self,
        head: EagleHead,
        model,
        runner,
        threshold: float = 0.1,
        sampling: Sampling = Sampling(),
        branch: int = 4,
    ):
        if (why := head.config.problem(model.config)) is not None:
            raise DecodeError(f"this EAGLE head was trained for another model: it has {why}")
        embed = model.get_input_embeddings()
        head = head.to(embed.weight.device)  # (a head loads on the CPU; the target may be on a GPU)
        self.head, self.runner, self.threshold, self.sampling = head, runner, threshold, sampling
        self.branch = branch  # a tree's: paths expanded per level, next tokens drafted per path
        self.dtype = head.fc.weight.dtype
        self.embed_table = embed.weight.detach().to(self.dtype)
        self.embed_scale = float(getattr(embed, "scalar_embed_scale", 1.0))
        self.rows = (
            model.get_output_embeddings().weight.detach()[head.draft_tokens.to(embed.weight.device)].to(self.dtype)
        )
        self.softcap = getattr(model.config, "final_logit_softcapping", None)
        self.vocab = model.config.vocab_size
        self.cache = HeadCache()
        self.seen: list[int] = []  # the context whose target states the head has: pairs 0..len - 2 cached
        self.states = torch.empty(0, head.config.hidden_size, dtype=self.dtype, device=embed.weight.device)
        self.generator = torch.Generator().manual_seed(sampling.seed + 1)
        if hasattr(runner, "track_features"):
            runner.track_features = True

    def _embed(self, tokens: list[int]) -> torch.Tensor:
        ids = torch.tensor(tokens, device=self.embed_table.device)
        return F.embedding(ids, self.embed_table) * self.embed_scale

    def _catch_up(self, context: list[int]) -> torch.Tensor:
        """The head's predicted state after ``context``, its cache holding every pair it has the
        target's states for (positions 0 .. len(context) - 2)."""
        known = common_prefix(self.seen, context[:-1]) if self.seen else 0
        need = len(context) - 1  # states of context[:-1]: the last token is not through the target yet
        fresh = self.runner.features
        start = self.runner.features_start
        if fresh is None or start > known or start + len(fresh) < need:
            raise DecodeError(
                "the EAGLE head needs the target's states of every verified token; decode through speculate"
            )
        self.states = torch.cat([self.states[:known], fresh[known - start : need - start].to(self.dtype)])
        self.seen = context[:need]
        pairs = max(0, known - 1)  # pair t = (state t, token t + 1); t up to need - 1
        self.cache.crop(pairs)
        positions = torch.arange(pairs, need, device=self.states.device)
        out = self.head(self._embed(context[pairs + 1 : need + 1]), self.states[pairs:need], positions, self.cache)
        return out[-1:]

    def follow(self, context: list[int]) -> None:
        """Take in the target's states of ``context`` without drafting (another proposer drafts
        this step; the states of the tokens it verifies are in the runner only until the next)."""
        self._catch_up(context)

    def propose(self, context: list[int], k: int):
        state = self._catch_up(context)
        tokens, probs = [], []
        for i in range(k):
            logits = head_logits(state, self.rows, self.softcap)[0].float()
            if self.sampling.greedy:
                p = torch.softmax(logits, -1)
                choice = int(p.argmax())
            else:
                p = self.sampling.probs(logits)
                choice = int(torch.multinomial(p.cpu(), 1, generator=self.generator))
            if tokens and p[choice] < self.threshold:
                break
            token = int(self.head.draft_tokens[choice])
            tokens.append(token)
            if not self.sampling.greedy:
                full = torch.zeros(self.vocab, dtype=p.dtype, device=p.device)
                probs.append(full.index_copy_(0, self.head.draft_tokens.to(p.device), p))
            if len(tokens) == k:
                break
            position = torch.tensor([len(context) - 1 + i], device=state.device)
            state = self.head(self._embed([token]), state, position, self.cache)
        self.cache.crop(len(context) - 1)  # drafted pairs are guesses: the verified states replace them
        return tokens, (None if self.sampling.greedy else torch.stack(probs).cpu())

    def propose_tree(self, context: list[int], nodes: int, depth: int) -> TokenTree:
        """A tree of up to ``nodes`` drafted tokens after ``context`` (its root: ``context[-1]``), at
        most ``depth`` deep. Each level drafts the ``branch`` likeliest next tokens of each of the
        ``branch`` likeliest paths the last level drafted, and the tree keeps the ``nodes`` likeliest
        of every drafted path (a path's likelihood: the product of the head's probabilities along
        it; a child is never likelier than its parent, so the kept paths form a tree). Levels stop
        once no child of the paths expanded now could enter it."""
        root_state = self._catch_up(context)
        past, device = self.cache.length, root_state.device
        pool: list[tuple[float, int, int]] = []  # drafted: (path likelihood, parent (-1: the root), token)
        state_of, row_of = {-1: root_state}, {}  # of expanded ones: predicted state, row in the head's cache
        frontier, states = [-1], root_state
        for level in range(min(depth, nodes)):
            probs = torch.softmax(head_logits(states, self.rows, self.softcap).float(), -1)
            top_p, top_i = probs.topk(min(self.branch, probs.shape[-1]), -1)
            first = len(pool)
            for parent, ps, ids in zip(frontier, top_p.tolist(), top_i.tolist()):
                base = 1.0 if parent < 0 else pool[parent][0]
                pool += [(base * q, parent, int(self.head.draft_tokens[i])) for q, i in zip(ps, ids)]
            frontier = sorted(range(first, len(pool)), key=lambda c: -pool[c][0])[: self.branch]
            kept_floor = sorted(p for p, _, _ in pool)[-nodes] if len(pool) >= nodes else 0.0
            if level + 1 == min(depth, nodes) or pool[frontier[0]][0] <= kept_floor:
                break
            length, count = self.cache.length, len(frontier)
            allowed = torch.zeros(count, length + count, dtype=torch.bool, device=device)
            allowed[:, :past] = True
            for r, c in enumerate(frontier):
                allowed[r, length + r] = True
                ancestor = pool[c][1]
                while ancestor >= 0:
                    allowed[r, row_of[ancestor]] = True
                    ancestor = pool[ancestor][1]
            parents = torch.cat([state_of[pool[c][1]] for c in frontier])
            positions = torch.full((count,), len(context) - 1 + level, device=device)
            states = self.head(self._embed([pool[c][2] for c in frontier]), parents, positions, self.cache, allowed)
            for r, c in enumerate(frontier):
                state_of[c], row_of[c] = states[r : r + 1], length + r
        self.cache.crop(len(context) - 1)  # drafted rows are guesses: the verified states replace them
        kept = sorted(sorted(range(len(pool)), key=lambda c: (-pool[c][0], c))[:nodes])  # parents first
        index = {-1: 0} | {c: i + 1 for i, c in enumerate(kept)}
        return TokenTree([context[-1]] + [pool[c][2] for c in kept], [-1] + [index[pool[c][1]] for c in kept])
