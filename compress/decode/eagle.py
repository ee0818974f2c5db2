"""Drafting with an EAGLE head (``compress.eagle``): a proposer for ``loop.speculate``.

The head reads the target's final-normed states, which the runner keeps from its last forward
(``features``, from ``features_start`` on): after a verify step the states of the tokens the
target accepted are its own, the head appends them to its cache, and drafts from there, feeding
its own predicted states back for each further token. Drafting is a chain: the head's most likely
token (or a sample, when decoding samples) while its probability stays above ``threshold``.
The target verifies as for any proposer, so greedy output is the target's greedy output.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..eagle import EagleHead, HeadCache, head_logits
from .loop import DecodeError, Sampling, common_prefix


class EagleDraft:
    """``model``: the transformers model the target runs (its embedding and lm_head are shared with
    the head); ``runner``: the runner ``speculate`` decodes with, whose states the head reads."""

    def __init__(self, head: EagleHead, model, runner, threshold: float = 0.1, sampling: Sampling = Sampling()):
        if (why := head.config.problem(model.config)) is not None:
            raise DecodeError(f"this EAGLE head was trained for another model: it has {why}")
        embed = model.get_input_embeddings()
        head = head.to(embed.weight.device)  # (a head loads on the CPU; the target may be on a GPU)
        self.head, self.runner, self.threshold, self.sampling = head, runner, threshold, sampling
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
