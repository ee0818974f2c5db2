"""Token trees: several continuations drafted at once and verified in one target step.

Node 0 of a tree is the token the target chose last (the root); every other node holds a token
and its parent, parents before children. The target scores every node in one forward under a
tree mask: a node sits at position ``length + depth`` and sees the cache and its own ancestors.
The walk from the root keeps, at each node, the child holding the token the target picks there
(greedy: its argmax; sampling: the rejection rule for several deterministic candidates, so the
output follows the target's distribution), and the cache keeps the accepted path's keys and
values. Lookahead's guesses and an EAGLE head's drafts (``eagle``) are verified this way.

On the engine a tree step runs eager: each node attends over exactly its ancestors (and the
cache, within a sliding-window layer's window) gathered in order, and its matmuls are a verify
step's (``Engine.body``'s ``tree``), so a node gets the logits that a one-token step after its
ancestors gives; a compiled engine runs its tree steps eager too.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from . import kernels
from .engine import Engine
from .loop import DecodeError, DecodeResult, HFRunner, Sampling, emit, sync, with_cache


@dataclass
class TokenTree:
    tokens: list[int]
    parents: list[int]  # parents[0] == -1 (the root); parents[i] < i

    @property
    def depths(self) -> torch.Tensor:
        depth = [0] * len(self.tokens)
        for i in range(1, len(self.tokens)):
            depth[i] = depth[self.parents[i]] + 1
        return torch.tensor(depth)

    @property
    def visible(self) -> torch.Tensor:
        """``visible[i, j]``: node ``j`` is ``i`` or one of its ancestors."""
        n = len(self.tokens)
        mask = torch.eye(n, dtype=torch.bool)
        for i in range(1, n):
            mask[i] |= mask[self.parents[i]]
        return mask

    def children(self, node: int) -> list[int]:
        return [i for i in range(node + 1, len(self.tokens)) if self.parents[i] == node]


def pick(logits: torch.Tensor, offered: list[int], sampling: Sampling, generator: torch.Generator) -> int:
    """The token the target takes at one node: greedy, its argmax; sampling, each distinct ``offered``
    token in turn kept with probability ``p(t)``, else removed from ``p`` and ``p`` renormalised (the
    rejection rule for deterministic drafts, applied to several), and a draw from what is left."""
    if sampling.greedy:
        return int(logits.argmax())
    p = sampling.probs(logits).cpu()
    for token in offered:
        if torch.rand((), generator=generator).item() < p[token].item() or p[token] >= p.sum():
            return token
        p[token] = 0
        p /= p.sum()
    return int(torch.multinomial(p, 1, generator=generator))


def walk(tree: TokenTree, logits: torch.Tensor, sampling: Sampling, generator: torch.Generator):
    """(the accepted nodes from the root down, the next token): the path the target agrees with."""
    node, path = 0, []
    while True:
        kids = tree.children(node)
        token = pick(logits[node], [tree.tokens[c] for c in kids], sampling, generator)
        child = next((c for c in kids if tree.tokens[c] == token), None)
        if child is None:
            return path, token
        path.append(child)
        node = child


def _kept_features(features, start: int, length: int, extra: list[int]):
    """The last forward's states of the tokens ``keep`` keeps, in their new order."""
    if features is None:
        return None
    rows = list(range(max(0, length - start))) + [slot - start for slot in extra]
    return features[torch.tensor(rows, device=features.device)]


class EngineTree:
    """A tree step on the decode engine (``forward``, ``forward_tree``, ``keep``, ``length``,
    ``features``): the runner lookahead and tree drafting decode with."""

    def __init__(self, engine: Engine):
        self.engine, self.device, self.forward = engine, engine.device, engine.forward
        engine.reset()

    @property
    def length(self) -> int:
        return self.engine.length

    @property
    def features(self):
        return self.engine.features

    @property
    def features_start(self) -> int:
        return self.engine.features_start

    @torch.no_grad()
    def forward_tree(self, ids: list[int], offsets: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """Float32 logits of tokens that are not one sequence: token ``i`` sits at position
        ``length + offsets[i]`` and sees the cache and the new tokens ``visible[i]`` marks. Their keys
        and values take the next ``len(ids)`` slots (``keep`` then keeps the accepted ones)."""
        engine = self.engine
        ids = torch.as_tensor(ids, device=self.device).reshape(-1)
        count = ids.numel()
        start = engine.cache.make_room(count)
        positions = start + torch.as_tensor(offsets, device=self.device)
        slot_positions = torch.cat([torch.arange(start, device=self.device), positions])  # of every slot it may see
        seen = {}
        for window in {layer.window for layer in engine.layers}:
            seen[window] = []
            for i, row in enumerate(visible.to(self.device)):
                slots = torch.cat([torch.ones(start, dtype=torch.bool, device=self.device), row])
                if window is not None:  # a sliding-window layer: keys fewer than ``window`` positions back
                    slots &= positions[i] - slot_positions < window
                seen[window].append(slots.nonzero()[:, 0])
        engine.features = engine.final_norm(engine.body(ids, positions, start + count, tree=seen))
        engine.features_start = start
        engine.cache.length = start + count
        return engine.head_logits(engine.features)

    def keep(self, length: int, extra: list[int]) -> None:
        """Keep the first ``length`` cached tokens and those at slots ``extra`` (``KVCache.keep``)."""
        engine = self.engine
        engine.cache.keep(length, extra)
        engine.features = _kept_features(engine.features, engine.features_start, length, extra)


class TransformersTree(HFRunner):
    """A tree step (as ``EngineTree``) for a transformers model and its dynamic cache."""

    def __init__(self, model):
        super().__init__(model)
        self.window = min((getattr(layer, "sliding_window", None) or 1 << 62) for layer in self.cache.layers)

    @property
    def length(self) -> int:
        return self.cache.get_seq_length()

    def forward_tree(self, ids: list[int], offsets: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        t, dtype = self.length, next(self.model.parameters()).dtype
        mask = torch.cat([torch.ones(len(ids), t, dtype=torch.bool), visible], 1)
        mask = torch.zeros(mask.shape, dtype=dtype).masked_fill_(~mask, torch.finfo(dtype).min)

        def run():
            return (
                self.model(
                    input_ids=torch.tensor([ids], device=self.device),
                    position_ids=(t + offsets).unsqueeze(0).to(self.device),
                    attention_mask=mask[None, None].to(self.device),
                    **with_cache(self.model, self.cache),
                    use_cache=True,
                )
                .logits[0]
                .float()
            )

        return self.tracking(run)

    def keep(self, length: int, extra: list[int]) -> None:
        """Cut every cache layer back to its first ``length`` entries plus the entries at ``extra``."""
        for layer in self.cache.layers:
            index = torch.tensor(extra, device=layer.keys.device, dtype=torch.long)
            layer.keys = torch.cat([layer.keys[:, :, :length], layer.keys.index_select(2, index)], 2)
            layer.values = torch.cat([layer.values[:, :, :length], layer.values.index_select(2, index)], 2)
            if hasattr(layer, "cumulative_length"):
                layer.cumulative_length = layer.keys.shape[-2]
        self.features = _kept_features(self.features, self.features_start, length, extra)


def tree_runner(model):
    """(a tree runner over ``model``, the sliding window its context must stay inside, the most
    tokens a step may hold and still score each as a one-token step would)."""
    if isinstance(model, Engine):  # its tree steps keep to each layer's window
        return EngineTree(model), 1 << 62, kernels.VERIFY_ROWS
    runner = TransformersTree(model)
    return runner, runner.window, 1 << 62


@torch.no_grad()
def speculate_tree(
    runner,
    prompt: torch.Tensor,
    max_new_tokens: int,
    proposer,
    nodes: int = 8,
    sampling: Sampling = Sampling(),
    eos: set[int] = frozenset(),
    limits: tuple[int, int] = (1 << 62, kernels.VERIFY_ROWS),
) -> DecodeResult:
    """Each step: a tree of up to ``nodes`` drafted tokens after the last chosen one
    (``proposer.propose_tree(context, nodes, depth)``), verified in one forward of ``runner`` (a
    tree runner), its accepted path kept. ``limits``: ``tree_runner``'s window and rows."""
    window, most_rows = limits
    if nodes + 1 > most_rows:
        raise DecodeError(
            f"a tree of {nodes} drafted tokens and the root is larger than the {most_rows} tokens this engine's "
            f"step scores exactly: give --k {most_rows - 1} or fewer"
        )
    context = prompt.reshape(-1).tolist()
    if len(context) + max_new_tokens + nodes >= window:
        raise DecodeError(
            f"tree drafting needs the whole context inside the model's sliding window ({window} tokens): "
            "shorten the prompt or --max-new-tokens, or run it on the decode engine"
        )
    start, generator = time.perf_counter(), torch.Generator().manual_seed(sampling.seed)
    logits = runner.forward(prompt, all_logits=False)[-1]
    next_token = pick(logits, [], sampling, generator)
    tokens, forwards, proposed, accepted = [], 1, 0, 0
    while not emit(tokens, context, [next_token], eos, max_new_tokens):
        room = max_new_tokens - len(tokens) - 1  # the bonus token needs a place too
        tree = proposer.propose_tree(context, nodes, room) if room > 0 else TokenTree([next_token], [-1])
        length = runner.length
        logits = runner.forward_tree(tree.tokens, tree.depths, tree.visible)
        forwards += 1
        path, next_token = walk(tree, logits, sampling, generator)
        proposed, accepted = proposed + len(tree.tokens) - 1, accepted + len(path)
        runner.keep(length + 1, [length + node for node in path])
        if emit(tokens, context, [tree.tokens[node] for node in path], eos, max_new_tokens):
            break
    sync(runner.device)
    seconds = time.perf_counter() - start
    return DecodeResult(tokens[:max_new_tokens], forwards, seconds, proposed, accepted)
