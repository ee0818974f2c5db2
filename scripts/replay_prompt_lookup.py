"""How fast could prompt lookup be on this machine? Replay proposers against greedy outputs.

    python scripts/replay_prompt_lookup.py [--prompts 8] [--new-tokens 128] [--datastore FILE.json]

Greedy output is what every lossless method must reproduce, so once it is known, the
propose–verify loop of ``decode.speculate`` can be replayed without the model: each step's
candidates are checked against the output, and the step costs one target forward as wide as
the candidates plus one. This script decodes the benchmark prompts of ``bench_decode.py``
greedily once, measures what a forward of each width and each prompt's prefill cost here,
and prices every replayed run with those times. Besides our proposers it replays two that
know the output, which bound what copying from the context can reach on this machine:
"oracle length" sends exactly the right prefix of the usual match (the latest occurrence of
the longest matching 3/2/1 tokens), "oracle match" also picks the best of every occurrence.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time

import torch
from bench_decode import datastore, prompts  # this script's folder is on the path when run
from transformers import DynamicCache

from compress import machine, models
from compress.decode import PromptLookup, common_prefix, default_token_cost, greedy, onednn
from compress.decode.loop import forward_logits

WIDTHS = (1, 2, 3, 5, 9, 11, 17)


class Oracle:
    """Candidates of the usual match (or, with ``any_match``, of whichever earlier occurrence of
    the last 1–3 tokens the output follows longest), cut exactly where the output departs."""

    def __init__(self, output: list[int], prompt_length: int, any_match: bool, max_ngram: int = 3):
        self.output, self.prompt_length, self.any_match, self.max_ngram = output, prompt_length, any_match, max_ngram

    def propose(self, context: list[int], k: int) -> tuple[list[int], None]:
        truth = self.output[len(context) - self.prompt_length :]
        best = []
        for n in range(self.max_ngram, 0, -1):
            starts = [s for s in range(len(context) - n - 1, -1, -1) if context[s : s + n] == context[-n:]]
            for start in starts if self.any_match else starts[:1]:
                right = common_prefix(context[start + n : start + n + k], truth)
                best = max(best, context[start + n : start + n + right], key=len)
            if starts and not self.any_match:
                break
        return best, None


def replay(prompt: list[int], output: list[int], proposer, max_new_tokens: int, eos: set[int], k: int = 10):
    """``decode.speculate``'s greedy loop against a known output: the forward widths it would run."""
    context, tokens, widths, next_token = list(prompt), [], [], output[0]
    while True:
        tokens.append(next_token)
        context.append(next_token)
        if next_token in eos or len(tokens) >= max_new_tokens:
            break
        room = min(k, max_new_tokens - len(tokens) - 1)
        candidates, _ = proposer.propose(context, room) if room > 0 else ([], None)
        widths.append(1 + len(candidates))
        truth = output[len(tokens) :]
        kept = candidates[: common_prefix(candidates, truth)]
        if any(t in eos for t in kept):
            break
        tokens += kept
        context += kept
        next_token = truth[len(kept)]
    assert tokens == output[: len(tokens)], "the replay left the greedy output"
    return widths


def forward_ms(model, prompt: torch.Tensor, rounds: int = 15) -> dict[int, float]:
    """Median ms of a target forward of each width after ``prompt``, the cache cropped back each
    time; the widths take turns, so a machine that drifts slows them all alike."""
    cache = DynamicCache(config=model.config)
    forward_logits(model, prompt, cache, all_logits=False)
    times = {width: [] for width in WIDTHS}
    for _ in range(rounds):
        for width in WIDTHS:
            ids = torch.randint(100, 20000, (width,), generator=torch.Generator().manual_seed(width))
            start = time.perf_counter()
            forward_logits(model, ids, cache)
            times[width].append(time.perf_counter() - start)
            cache.crop(-width)
    return {width: 1e3 * statistics.median(t[1:]) for width, t in times.items()}


def interpolate(points: dict[int, float], x: int) -> float:
    """Piecewise-linear through the measured widths (held flat beyond the last)."""
    below = max(w for w in points if w <= x)
    above = min((w for w in points if w >= x), default=below)
    if above == below:
        return points[below]
    return points[below] + (points[above] - points[below]) * (x - below) / (above - below)


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--prompts", type=int, default=8, help="prompts per set")
    parser.add_argument(
        "--datastore",
        metavar="FILE.json",
        help="also replay prompt lookup with this datastore (as bench_decode.py builds it)",
    )
    args = parser.parse_args()

    device = models.pick_device("auto")
    loaded = models.load(args.model, torch.bfloat16)
    model, tokenizer = models.for_compute(loaded.model, device), loaded.tokenizer
    if device.type == "cpu":
        onednn.use_onednn(model)
    eos = {tokenizer.eos_token_id}
    store = datastore(args.datastore, model, tokenizer, args.new_tokens, eos, device) if args.datastore else None
    sets = {name: [p.to(device) for p in ps[: args.prompts]] for name, ps in prompts(tokenizer).items()}
    greedy(model, sets["open"][0][:, :32], 8)  # warm-up
    cost_ms = forward_ms(model, sets["grounded"][0])
    price = functools.partial(interpolate, cost_ms)
    cost = default_token_cost(model)
    print(f"command: python {' '.join(sys.argv)}")
    print(f"machine: {machine.describe()}")
    print(
        "target forward, ms by width after a grounded prompt: "
        + ", ".join(f"{w}: {ms:.1f}" for w, ms in cost_ms.items())
        + "\n"
    )
    print("| prompts | proposer | est. vs greedy | tokens/forward |\n|---|---|---|---|")
    for set_name, ps in sets.items():
        runs = []  # (prompt ids, greedy output, prefill ms)
        for p in ps:
            start = time.perf_counter()
            forward_logits(model, p, DynamicCache(config=model.config), all_logits=False)
            prefill = 1e3 * (time.perf_counter() - start)
            runs.append((p[0].tolist(), greedy(model, p, args.new_tokens, eos).tokens, prefill))
        proposers = {
            "every match (ours, k=10)": lambda out, n: PromptLookup(),
            f"token cost {cost} (ours, k=10)": lambda out, n: PromptLookup(token_cost=cost),
            **(
                {
                    f"token cost {cost} + datastore of {len(store)} (ours, k=10)": lambda out, n: PromptLookup(
                        token_cost=cost, store=store
                    )
                }
                if store
                else {}
            ),
            "oracle length (k=10)": lambda out, n: Oracle(out, n, any_match=False),
            "oracle match and length (k=10)": lambda out, n: Oracle(out, n, any_match=True),
        }
        for name, make in proposers.items():
            greedy_ms = spec_ms = tokens = forwards = 0.0
            for prompt, output, prefill in runs:
                widths = replay(prompt, output, make(output, len(prompt)), args.new_tokens, eos)
                greedy_ms += prefill + (len(output) - 1) * price(1)
                spec_ms += prefill + sum(map(price, widths))
                tokens, forwards = tokens + len(output), forwards + len(widths)
            print(f"| {set_name} | {name} | {greedy_ms / spec_ms:.2f}× | {tokens / max(1, forwards):.2f} |", flush=True)


if __name__ == "__main__":
    main()
