"""Does the order of float additions still decide how GPTQ rounds? Hessians in float32 and float64.

GPTQ W4 on SmolLM2 with the Hessian ``XᵀX`` accumulated in panels of different widths (the
same sum, added in another order) and in float32 or float64. Per row: the block sweep's time,
how many of the W4 integers differ from the first panel width's in the same dtype (0 would mean
the order no longer matters), and perplexity on the given windows. One row printed as soon as
it is measured. ``--seeds N`` repeats everything for calibration seeds 0..N-1 and then prints
each setting's mean ± standard deviation over the seeds: how far the seed moves the result in
each dtype (the spread before and after the float64 change).

    python scripts/bench_statistics.py [--samples 32] [--windows 8] [--panels 192 4096] [--seeds 1]
"""

from __future__ import annotations

import argparse
import copy
import shlex
import statistics
import sys
import time

import torch

from compress import data, hessian, machine, models
from compress.evaluate import evaluate, windows_of
from compress.passes import ModelPass
from compress.pipeline import run_passes
from compress.quant import quantized_of
from compress.recipe import parse


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--samples", type=int, default=32, help="calibration samples of 512 tokens")
    parser.add_argument("--windows", type=int, default=8, help="evaluation windows of 2048 tokens")
    parser.add_argument("--panels", type=int, nargs="+", default=[192, 4096], help="Hessian panel widths")
    parser.add_argument("--passes", default="  - gptq: {bits: 4, group_size: auto}\n")
    parser.add_argument("--seeds", type=int, default=1, help="calibration seeds 0..N-1, then mean ± std")
    args = parser.parse_args()
    if args.seeds < 1:
        sys.exit("--seeds: give 1 or more")

    loaded = models.load(args.model, torch.bfloat16)
    base, tokenizer = loaded.model, loaded.tokenizer
    windows = windows_of(tokenizer, "wikitext2", 2048, args.windows)
    reference = models.open_streamed(args.model, torch.bfloat16).model
    print(f"command: python {shlex.join(sys.argv)}")
    print(f"machine: {machine.describe()}")
    print(f"model: {args.model}; {args.samples} × 512 calibration tokens, {args.windows} × 2048 evaluation tokens\n")
    print("| seed | Hessian dtype | panel | sweep s | W4 integers unlike the first panel's | perplexity | KL |")
    print("|---|---|---|---|---|---|---|", flush=True)
    default_dtype, default_panel = hessian.statistics_dtype, hessian.Hessian.PANEL
    measured = {}  # (dtype, panel) -> [(seconds, perplexity, KL) per seed]
    try:
        for seed, dtype in ((seed, dtype) for seed in range(args.seeds) for dtype in (torch.float32, torch.float64)):
            ids, _ = data.calibration_batches(base, tokenizer, "wikitext2", args.samples, 512, seed=seed)
            first = None
            for panel in args.panels:
                hessian.statistics_dtype = lambda device, dtype=dtype: dtype
                hessian.Hessian.PANEL = panel
                model = copy.deepcopy(base)
                recipe = parse("passes:\n" + args.passes)
                for p in recipe.passes:
                    p.check(model)
                teacher = copy.deepcopy(base) if any(isinstance(p, ModelPass) for p in recipe.passes) else None
                start = time.perf_counter()
                run_passes(model, ids, recipe.passes, torch.device("cpu"), lambda teacher=teacher: teacher)
                seconds = time.perf_counter() - start
                codes = {n: quantized_of(m).q for n, m in model.named_modules() if quantized_of(m) is not None}
                first = first or codes
                differ = sum(int((codes[n] != first[n]).sum()) for n in codes)
                total = sum(q.numel() for q in codes.values())
                score = evaluate(
                    models.for_compute(model, torch.device("cpu")),
                    tokenizer,
                    seqlen=2048,
                    windows=args.windows,
                    reference=reference,
                    data=windows,
                    progress=False,
                )
                name = str(dtype).removeprefix("torch.")
                measured.setdefault((name, panel), []).append((seconds, score.ppl, score.kl))
                print(
                    f"| {seed} | {name} | {panel} | {seconds:.1f} | {differ:,} of {total:,} ({differ / total:.4%}) "
                    f"| {score.ppl:.3f} | {score.kl:.4f} |",
                    flush=True,
                )
    finally:
        hessian.statistics_dtype, hessian.Hessian.PANEL = default_dtype, default_panel
    if args.seeds > 1:
        print("\n| Hessian dtype | panel | seeds | sweep s | perplexity | KL |\n|---|---|---|---|---|---|")
        for (name, panel), runs in measured.items():
            (s_mean, s_std), (p_mean, p_std), (k_mean, k_std) = (
                (statistics.mean(column), statistics.stdev(column)) for column in zip(*runs)
            )
            print(
                f"| {name} | {panel} | {len(runs)} | {s_mean:.1f} ± {s_std:.1f} | {p_mean:.3f} ± {p_std:.3f} "
                f"| {k_mean:.4f} ± {k_std:.4f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
