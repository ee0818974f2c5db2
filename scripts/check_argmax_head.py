"""How many vocabulary rows the argmax lm_head recomputes, and whether its largest logit is the exact head's.

    python scripts/check_argmax_head.py [--models smollm2-135m gemma3-270m] [--prompts 4] [--new-tokens 48]

``--lm-head argmax`` (``kernels.Int8Argmax``) scores every row with an int8 copy of the lm_head and
recomputes from the bf16 weight the rows whose score could still be the largest. Its speed rests
on how few those rows are, and its exactness on the error bound. Per model this decodes greedily
on the exact head from wikitext-2 test passages, feeds the argmax head the same tokens, and
prints one row as soon as it is measured: the steps, the rows recomputed (a row is counted where
both heads' logits are bitwise equal: an int8 score equal to the exact value is rare), the steps
whose largest logit (position and value) equals the exact head's, and how far the other logits are.
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys

import torch

from compress import data, machine, models
from compress.decode import kernels, native
from compress.decode.engine import Engine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["smollm2-135m", "gemma3-270m"])
    parser.add_argument("--prompts", type=int, default=4, help="wikitext-2 test passages of 200 tokens")
    parser.add_argument("--new-tokens", type=int, default=48)
    args = parser.parse_args()
    if not native.available():
        sys.exit("the argmax lm_head runs on our AVX2 kernels, which are not available here")
    print(f"command: python {shlex.join(sys.argv)}")
    print(f"machine: {machine.describe()}\n")
    print(
        "| model | vocabulary | steps | rows recomputed: mean | p99 | max | largest logit = exact head's "
        "| max other-logit error |"
    )
    print("|---|---|---|---|---|---|---|---|", flush=True)
    for name in args.models:
        loaded = models.load(name, torch.bfloat16)
        model = models.for_compute(loaded.model, torch.device("cpu"))
        text = data.tokenize(loaded.tokenizer, data.load_text("wikitext2", "test"))
        exact, argmax = Engine(model, kernel="bf16-avx2"), Engine(model, kernel="bf16-avx2", lm_head="argmax")
        if argmax.formats["lm_head"] != kernels.ARGMAX:
            print(f"| {name} | the argmax head does not fit this lm_head ({argmax.formats['lm_head']}) |||||||")
            continue
        recomputed, same, error = [], 0, 0.0
        for i in range(args.prompts):
            prompt = text[5000 + 1500 * i : 5200 + 1500 * i]
            exact.reset()
            argmax.reset()
            want, got = exact.forward(prompt, all_logits=False)[-1], argmax.forward(prompt, all_logits=False)[-1]
            for _ in range(args.new_tokens):
                recomputed.append(int((want == got).sum()))
                same += int(want.argmax() == got.argmax() and want.max() == got.max())
                error = max(error, float((want - got).abs().max()))
                token = want.argmax().reshape(1)
                want, got = exact.forward(token)[-1], argmax.forward(token)[-1]
        ordered = sorted(recomputed)
        print(
            f"| {name} | {want.numel()} | {len(recomputed)} | {statistics.mean(recomputed):.1f} | "
            f"{ordered[int(0.99 * (len(ordered) - 1))]} | {ordered[-1]} | {same}/{len(recomputed)} | {error:.3f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
