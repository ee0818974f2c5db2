"""Drafting with a model: a smaller model with the same tokenizer (a compressed copy of the target
works), or the target itself with only some decoder layers run (self-speculation: Draft & Verify's
layer skipping; the first ``n`` layers is early-exit drafting as in LayerSkip)."""

from __future__ import annotations

import copy
import json
import os
import sys
from pathlib import Path

import torch

from ..arch import arch_of, decoder_layers
from ..data import calibration_batches
from .loop import DecodeError, Sampling, runner_for, speculate, write_json


class DraftModel:
    """A smaller model drafts greedily (or samples, for sampled decoding) until its top
    probability falls below ``threshold``; its own cache follows the context, cropped back to
    the prefix it shares with it. ``draft`` is a transformers model or a runner (an ``Engine``)."""

    def __init__(self, draft, threshold: float = 0.4, sampling: Sampling = Sampling()):
        self.runner, self.threshold, self.sampling = runner_for(draft), threshold, sampling
        self.seen = []
        self.generator = torch.Generator().manual_seed(sampling.seed + 1)

    def _catch_up(self, context: list[int]) -> torch.Tensor:
        """Logits after ``context``: crop the cache to the common prefix, feed the rest."""
        common = 0
        for a, b in zip(self.seen, context[:-1]):
            if a != b:
                break
            common += 1
        self.runner.crop(len(self.seen) - common)
        self.seen = context[:]
        return self.runner.forward(context[common:], all_logits=False)[-1]

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
            logits = self.runner.forward([token])[-1]
            self.seen.append(token)
        return tokens, (None if self.sampling.greedy else torch.stack(probs))


class LookupThenDraft:
    """Prompt lookup's candidates where it finds a match, else the draft's: copying is free,
    drafting costs draft forwards, so the draft works only where copying cannot. A draft that
    must see every verified token (an EAGLE head reads the target's states, which only the last
    forward holds) is told of them (``follow``) when lookup proposes instead."""

    def __init__(self, lookup, draft):
        self.lookup, self.draft = lookup, draft

    def propose(self, context: list[int], k: int):
        tokens, probs = self.lookup.propose(context, k)
        if not tokens:
            return self.draft.propose(context, k)
        if hasattr(self.draft, "follow"):
            self.draft.follow(context)
        return tokens, probs


def layer_subset(model, keep: list[int]):
    """A view of ``model`` that runs only the decoder layers ``keep`` (the same weights, no copy).

    Layer 0 must stay: the KV cache reads the sequence length from its first layer. Kept
    layers keep their index, so a cache built from the model's config serves the view. An
    ``Engine`` gives its own view, with a cache of its own.
    """
    if hasattr(model, "subset"):
        return model.subset(keep)
    path = arch_of(model).layers.split(".")  # e.g. model.layers
    count = len(model.get_submodule(".".join(path)))
    keep = sorted(set(keep))
    if not keep or keep[0] != 0 or keep[-1] >= count:
        raise DecodeError(f"--layers must include layer 0 and stay within 0-{count - 1}")

    def rebuilt(module, rest):  # shallow copies down the path; the original model is untouched
        clone = copy.copy(module)
        clone._modules = dict(module._modules)
        child = module._modules[rest[0]]
        clone._modules[rest[0]] = (
            torch.nn.ModuleList([child[i] for i in keep]) if len(rest) == 1 else rebuilt(child, rest[1:])
        )
        return clone

    return rebuilt(model, path)


def layer_count(model) -> int:
    """Decoder layers of a transformers model or an ``Engine``."""
    return model.layer_count if hasattr(model, "layer_count") else len(decoder_layers(model))


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


@torch.no_grad()
def search_layers(
    model, prompts: list[torch.Tensor], max_new_tokens: int = 32, k: int = 8, threshold: float = 0.4
) -> tuple[list[int], list[dict]]:
    """The candidate subset with the most tokens per second on ``prompts`` (greedy, measured)."""
    trials = []
    for keep in candidate_subsets(layer_count(model)):
        tokens, seconds, per_forward = 0, 0.0, []
        for prompt in prompts:
            result = speculate(model, prompt, max_new_tokens, DraftModel(layer_subset(model, keep), threshold), k)
            tokens, seconds = tokens + len(result.tokens), seconds + result.seconds
            per_forward.append(result.tokens_per_forward)
        trials.append(
            {
                "layers": keep,
                "tokens_per_s": tokens / seconds,
                "tokens_per_forward": sum(per_forward) / len(per_forward),
            }
        )
    best = max(trials, key=lambda t: t["tokens_per_s"])
    return best["layers"], trials


def format_layers(layers: list[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> "0-2,5,7-8" (what ``--layers`` takes)."""
    parts, start = [], layers[0]
    for a, b in zip(layers, layers[1:] + [None]):
        if b != a + 1:
            parts.append(f"{start}-{a}" if a > start else str(a))
            start = b
    return ",".join(parts)


def choose_layers(model, tokenizer, checkpoint: str, spec: str, k: int, threshold: float) -> list[int]:
    """Self-speculation's draft layers: ``spec`` as given (``0-14,16``), or (``auto``) the subset
    saved with ``checkpoint``, else searched on two wikitext calibration prompts and saved next to
    the checkpoint's weights for next time. Says what it chose on stderr."""
    count = layer_count(model)
    if spec != "auto":
        return parse_layers(spec, count)
    if (keep := saved_layers(checkpoint, count)) is not None:
        print(f"[self-spec: drafting with layers {format_layers(keep)}, saved with {checkpoint}]", file=sys.stderr)
        return keep
    ids, _ = calibration_batches(model, tokenizer, "wikitext2", 2, 64, seed=0)
    keep, trials = search_layers(model, [row.unsqueeze(0).to(model.device) for row in ids], k=k, threshold=threshold)
    for t in trials:
        print(
            f"[self-spec search: {len(t['layers'])}/{count} layers {format_layers(t['layers'])}: "
            f"{t['tokens_per_s']:.1f} tokens/s, {t['tokens_per_forward']:.2f} tokens per forward]",
            file=sys.stderr,
        )
    saved = save_layers(checkpoint, keep, trials)
    where = f"saved in {saved}" if saved else f"pass --layers {format_layers(keep)} to skip the search"
    print(f"[self-spec: drafting with layers {format_layers(keep)}; {where}]", file=sys.stderr)
    return keep
