"""Screen KV-cache schemes on a few windows before a standard-protocol run.

    python scripts/screen_kv.py [--model smollm2-135m] [--windows 4] [SCHEME ...]

A SCHEME is ``KVScheme`` fields, e.g. ``bits=2,group_size=64,sinks=4,pre_rope=1``. Each row is
the perplexity of the first ``--windows`` wikitext-2 test windows (2048 tokens, fp32) with every
query reading the cache as a KIVI decoder would hold it (``kv_quant.simulating``, what the
evaluation of a ``kv_cache`` pass does), next to the dense cache's. A 4-window screen of SmolLM2
takes ~1.5 minutes a row on 2 cores where the standard protocol takes 15–30: use it to drop
ideas, and the standard protocol (``compress apply``) for the numbers you keep.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import shlex
import sys
import time

import torch
import torch.nn.functional as F

from compress import kv_quant, machine, models
from compress.evaluate import windows_of

ABLATION = [  # issue 31's steps from KIVI INT2 towards +10% at <= 4,500 bytes a token on SmolLM2
    "bits=2,group_size=32,residual=128",
    "bits=2,group_size=32,residual=128,sinks=4,pre_rope=1",
    "bits=2,group_size=32,residual=128,sinks=4,pre_rope=1,rotate_values=1",
    "bits=2,group_size=64,residual=128,sinks=4,pre_rope=1,key_group_size=16,fp8_key_scales=1",
    "bits=2,group_size=64,residual=128,sinks=4,pre_rope=1,key_group_size=16,fp8_key_scales=1,rotate_values=1",
]


def parse_scheme(text: str) -> kv_quant.KVScheme:
    types = {f.name: f.type for f in dataclasses.fields(kv_quant.KVScheme)}
    fields = {}
    for part in text.split(","):
        name, _, value = part.partition("=")
        if name not in types or not value:
            raise SystemExit(f"error: {part!r} in {text!r}: use NAME=VALUE with a KVScheme field ({', '.join(types)})")
        fields[name] = value in ("1", "true") if types[name] == "bool" else int(value)
    try:
        return kv_quant.KVScheme(**fields)
    except ValueError as e:
        raise SystemExit(f"error: {text}: {e}") from None


@torch.no_grad()
def perplexity(model, windows: torch.Tensor) -> float:
    nll = 0.0
    with kv_quant.simulating(model):
        for window in windows:
            logits = model(window[None]).logits[0, :-1].float()
            nll += F.cross_entropy(logits, window[1:], reduction="sum").item()
    return math.exp(nll / (windows.numel() - len(windows)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--windows", type=int, default=4)
    parser.add_argument("--seqlen", type=int, default=2048)
    parser.add_argument("schemes", nargs="*", default=ABLATION)
    args = parser.parse_args()
    schemes = [parse_scheme(s) for s in args.schemes]

    print(f"command: python {shlex.join(sys.argv)}")
    print(f"machine: {machine.describe()}")
    loaded = models.load(args.model, torch.float32)
    model = loaded.model.eval()
    windows = windows_of(loaded.tokenizer, "wikitext2", args.seqlen, args.windows)
    dims = kv_quant.cache_dims(model.config)
    dense_token = kv_quant.dense_bytes_per_token(*dims)
    print(f"{args.model}: first {args.windows} windows of {args.seqlen} tokens; bytes a token at {args.seqlen} tokens")
    print("| KV cache | bytes/token | ppl | vs dense | s |")
    print("|---|---|---|---|---|")
    start = time.time()
    dense = perplexity(model, windows)
    print(f"| dense | {dense_token:,} | {dense:.3f} | | {time.time() - start:.0f} |", flush=True)
    for scheme in schemes:
        kv_quant.install(model, scheme)
        start = time.time()
        ppl = perplexity(model, windows)
        per_token = scheme.bytes_per_token(*dims) + dense_token * min(scheme.sinks, args.seqlen) / args.seqlen
        seconds = time.time() - start
        print(
            f"| {scheme.describe()} | {per_token:,.0f} | {ppl:.3f} | {ppl / dense - 1:+.1%} | {seconds:.0f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
