"""What each decode weight format costs in accuracy: perplexity of the engine's own decode steps.

    python scripts/bench_kernel_accuracy.py [--model smollm2-135m] [--windows 4] [--seqlen 512]

The evaluation scores the weights an export holds; the decoder computes them with a kernel, and
a lossy kernel (``int4-a8`` rounds each step's activations to int8, ``int4-a16`` to 16 bits, an
int4 lm_head rounds the output layer) changes what it computes. Here wikitext-2 test windows are fed through the engine
in verify steps of 16 tokens (each row is computed as a one-token step computes it), and the
next-token log-likelihoods give a perplexity per format, and the KL to the dense engine's
distribution. W4 rows round the model's linears in memory (RTN, symmetric, group 128/64), so
W4 and W4A8 read the same integers and differ only in the activations. One row per format, as
soon as it is measured.
"""

from __future__ import annotations

import argparse
import math
import shlex
import sys

import torch
import torch.nn.functional as F

from compress import data, machine, models
from compress.decode import native
from compress.decode.engine import Engine

STEP = 16  # tokens per verify step: every row on the formats' step kernels


@torch.no_grad()
def step_log_probs(engine: Engine, ids: torch.Tensor) -> torch.Tensor:
    """Log-probabilities [len - 1, vocab] of each next token, computed in steps of ``STEP`` tokens."""
    engine.reset()
    rows = [engine.forward(ids[i : i + STEP]) for i in range(0, ids.numel() - 1, STEP)]
    return F.log_softmax(torch.cat(rows)[: ids.numel() - 1].float(), -1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--windows", type=int, default=4)
    parser.add_argument("--seqlen", type=int, default=512)
    args = parser.parse_args()

    print(f"command: python {shlex.join(sys.argv)}")
    print(f"machine: {machine.describe()}")
    loaded = models.load(args.model, torch.bfloat16)
    model = models.for_compute(loaded.model, torch.device("cpu"))
    ids = data.tokenize(loaded.tokenizer, data.load_text("wikitext2", "test"))
    windows = [ids[i * args.seqlen : (i + 1) * args.seqlen] for i in range(args.windows)]
    formats = {
        "dense (auto)": dict(),
        "dense, bf16 KV cache": dict(cache_dtype=torch.bfloat16),
        "W4 (RTN in memory), int4-avx2": dict(quantize="w4", kernel="int4-avx2"),
        "W4, int4-avx2 + int4 lm_head": dict(quantize="w4", kernel="int4-avx2", lm_head="int4"),
        "W4A16, int4-a16": dict(quantize="w4", kernel="int4-a16"),
        "W4A16, int4-a16 + int4 lm_head": dict(quantize="w4", kernel="int4-a16", lm_head="int4"),
        "W4A16, int4-a16 + int4 lm_head, bf16 KV cache": dict(
            quantize="w4", kernel="int4-a16", lm_head="int4", cache_dtype=torch.bfloat16
        ),
        "W4A8, int4-a8": dict(quantize="w4", kernel="int4-a8"),
        "W4A8, int4-a8 + int4 lm_head": dict(quantize="w4", kernel="int4-a8", lm_head="int4"),
    }
    if not native.available():
        formats = {k: v for k, v in formats.items() if "kernel" not in v}
        print("(our native kernels are not available here: dense only)")
    print(f"{args.windows} windows of {args.seqlen} tokens, steps of {STEP}")
    print("| format | kernels | perplexity | KL to dense (nats/token) |")
    print("|---|---|---|---|")
    reference = None  # the first format's (dense) log-probabilities per window
    for name, kw in formats.items():
        engine = Engine(model, max_len=args.seqlen + STEP, **kw)
        nll, kl, count, computed = 0.0, 0.0, 0, []
        for window_index, window in enumerate(windows):
            log_probs = step_log_probs(engine, window)
            computed.append(log_probs)
            nll -= log_probs.gather(1, window[1:, None]).sum().item()
            count += window.numel() - 1
            if reference is not None:
                ref = reference[window_index]
                kl += (ref.exp() * (ref - log_probs)).sum().item()
        reference = reference or computed
        kinds = ", ".join(sorted(set(engine.formats.values())))
        print(f"| {name} | {kinds} | {math.exp(nll / count):.3f} | {kl / count:.4f} |", flush=True)


if __name__ == "__main__":
    main()
