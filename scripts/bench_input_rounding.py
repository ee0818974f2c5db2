"""What rounding a linear's inputs costs by itself: the dense model with only its inputs rounded.

    python scripts/bench_input_rounding.py [--model smollm2-135m] [--windows 40] [--formats fp8 int8 ...]

Every W?A? recipe pays for its weights and for its activations; this measures the second part
alone: what a recipe with those inputs costs before any weight is rounded. Each linear but the
head sees its input as the serving kernel rounds it (``compress.quant.fake_quantize_activation``:
FP8 E4M3 or integers with a dynamic scale per token, MXFP4 per group of 32), the weights stay as
loaded, and the windows are those of ``compress eval`` (wikitext-2 test). NVFP4 inputs need a
calibrated global scale and are not among the formats. The formats share each window's dense
log-probabilities, so the table comes at the end; every window prints the perplexities so far.
"""

from __future__ import annotations

import argparse
import math
import shlex
import sys

import torch
import torch.nn.functional as F

from compress import machine, models
from compress.evaluate import windows_of
from compress.quant import ActivationScheme, fake_quantize_activation

FORMATS = {
    "fp8": ActivationScheme(format="fp8"),
    "int8": ActivationScheme(bits=8),
    "int4": ActivationScheme(bits=4),
    "mxfp4": ActivationScheme(bits=4, format="mxfp4", group_size=32),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--windows", type=int, default=40)
    parser.add_argument("--seqlen", type=int, default=2048)
    parser.add_argument("--formats", nargs="+", choices=list(FORMATS), default=list(FORMATS))
    args = parser.parse_args()

    print(f"command: python {shlex.join(sys.argv)}")
    print(f"machine: {machine.describe()}")
    loaded = models.load(args.model, torch.bfloat16)
    model = models.for_compute(loaded.model, torch.device("cpu")).eval()
    windows = windows_of(loaded.tokenizer, "wikitext2", args.seqlen, args.windows)
    rounding: list[ActivationScheme | None] = [None]  # what the hooks apply now

    def round_input(module, inputs):
        scheme = rounding[0]
        return None if scheme is None else (fake_quantize_activation(inputs[0], scheme), *inputs[1:])

    head = model.get_output_embeddings()
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and module is not head:
            module.register_forward_pre_hook(round_input)

    # Per window: the dense log-probabilities once, then every format against them.
    names = ["dense", *args.formats]
    nll = dict.fromkeys(names, 0.0)
    kl = dict.fromkeys(names, 0.0)
    count = 0
    with torch.no_grad():
        for index, window in enumerate(windows):
            targets = window[1:]
            dense = None
            for name in names:
                rounding[0] = FORMATS.get(name)
                log_probs = F.log_softmax(model(window[None]).logits[0, :-1].float(), -1)
                nll[name] -= log_probs.gather(1, targets[:, None]).sum().item()
                if dense is None:
                    dense = log_probs
                else:
                    kl[name] += (dense.exp() * (dense - log_probs)).sum().item()
            count += targets.numel()
            running = ", ".join(f"{name} {math.exp(nll[name] / count):.3f}" for name in names)
            print(f"window {index + 1}/{len(windows)}: perplexity so far {running}", file=sys.stderr, flush=True)

    print(f"{args.model}: {len(windows)} windows of {args.seqlen} tokens, only the linears' inputs rounded")
    print("| inputs | perplexity | increase over dense | KL to dense (nats/token) |")
    print("|---|---|---|---|")
    dense_ppl = math.exp(nll["dense"] / count)
    for name in names:
        ppl = math.exp(nll[name] / count)
        print(f"| {name} | {ppl:.3f} | {100 * (ppl / dense_ppl - 1):+.2f}% | {kl[name] / count:.4f} |")


if __name__ == "__main__":
    main()
