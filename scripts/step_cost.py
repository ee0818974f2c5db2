"""What one engine step of k tokens costs, and whether it rounds like k one-token steps.

    python scripts/step_cost.py [--model smollm2-135m] [--prompt-tokens 300] [--counts 1 2 4 8 16]
        [--kernel auto] [--no-graphs] [--step-rows R] [--repeats 20] [--compile]

Speculation lives on two facts this prints per token count k, after a wikitext prompt: the
median milliseconds of a k-token forward (a verify step; k = 1 is the plain step), and whether
its logits equal, bitwise, those of k one-token forwards of the same tokens (lossless greedy
speculation needs them equal: a near-tie decided differently changes the output). On a GPU the
engine replays CUDA graphs unless ``--no-graphs``. One markdown row per k as soon as measured.
``--compile`` then prints the same table for the compiled engine (CPU; its steps of up to
``step_rows`` tokens run one graph), times its one-token step against the eager one, and says how
far its logits are from the eager step's over 64 greedy steps.
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time

import torch

from compress import data, machine, models
from compress.decode.engine import Engine
from compress.decode.loop import sync


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--prompt-tokens", type=int, default=300)
    parser.add_argument("--counts", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--kernel", default="auto")
    parser.add_argument("--no-graphs", action="store_true", help="on a GPU, run the steps without CUDA graphs")
    parser.add_argument(
        "--step-rows", type=int, help="rows every graph or compiled step is padded to (the engine's step_rows)"
    )
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--quantize", choices=["w4"], help="round the block linears to W4 in memory (lossy)")
    parser.add_argument(
        "--lm-head",
        choices=["int4", "int8", "argmax"],
        help="quantize lm_head for decoding (lossy), or argmax: its largest logit exact, the others int8",
    )
    parser.add_argument(
        "--compile", action="store_true", help="also the compiled engine's table, and its one-token step against eager"
    )
    args = parser.parse_args()

    device = models.pick_device("auto")
    loaded = models.load(args.model, torch.bfloat16)
    model = models.for_compute(loaded.model, device)
    text = data.tokenize(loaded.tokenizer, data.load_text("wikitext2", "test"))
    prompt = text[5000 : 5000 + args.prompt_tokens].reshape(1, -1).to(device)
    following = text[5000 + args.prompt_tokens :][: max(args.counts)].tolist()
    options = dict(kernel=args.kernel, quantize=args.quantize, lm_head=args.lm_head)
    engine = Engine(model, graphs=False if args.no_graphs else None, step_rows=args.step_rows, **options)
    print(f"command: python {shlex.join(sys.argv)}")
    print(f"machine: {machine.describe()}")
    print(
        f"engine: {engine.describe()}; stream {str(engine.dtype).removeprefix('torch.')}; "
        f"CUDA graphs {'on' if engine.graphs else 'off'}; steps of {engine.step_rows} rows\n"
    )
    table(engine, prompt, following, args)
    if args.compile:
        compare_compiled(engine, model, prompt, following, args)


def table(engine: Engine, prompt: torch.Tensor, following: list[int], args) -> None:
    """One row per token count: ms of a k-token step, and whether it rounds as k one-token steps."""
    print(
        "| tokens k | ms per step (median) | ms per token | × one-token step | logits = k one-token steps | "
        "max abs difference | argmax agrees |"
    )
    print("|---|---|---|---|---|---|---|", flush=True)
    one_token_ms = None
    for k in args.counts:
        ids = following[:k]
        engine.reset()
        engine.forward(prompt, all_logits=False)
        together = engine.forward(ids)
        engine.crop(k)
        one_by_one = torch.cat([engine.forward([t]) for t in ids])
        engine.crop(k)
        ms = median_step_ms(engine, ids, args.repeats, engine.device)
        one_token_ms = one_token_ms or (ms if k == 1 else None)
        ratio = f"{ms / one_token_ms:.2f}×" if one_token_ms else ""
        difference = (together - one_by_one).abs().max().item()
        agrees = (together.argmax(-1) == one_by_one.argmax(-1)).sum().item()
        where = (
            " (eager: longer than the compiled step)" if engine.compiled is not None and k > engine.step_rows else ""
        )
        print(
            f"| {k}{where} | {ms:.2f} | {ms / k:.2f} | {ratio} | "
            f"{'yes' if torch.equal(together, one_by_one) else 'no'} | {difference:.2e} | {agrees}/{k} |",
            flush=True,
        )


def median_step_ms(engine: Engine, ids: list[int], repeats: int, device: torch.device) -> float:
    """Median ms of a forward of ``ids``, each one rolled back."""
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        engine.forward(ids)
        sync(device)
        times.append((time.perf_counter() - start) * 1e3)
        engine.crop(len(ids))
    return statistics.median(times)


def compare_compiled(eager: Engine, model, prompt: torch.Tensor, following: list[int], args) -> None:
    """The compiled steps' table, then the compiled one-token step against the eager one: ms, and
    logits along eager's greedy path."""
    compiled = Engine(model, compile=True, kernel=args.kernel, quantize=args.quantize, lm_head=args.lm_head)
    compiled.forward(prompt, all_logits=False)
    compiled.forward(following[:1])  # compiles, or loads the package an earlier run left
    if compiled.compiled is None:
        sys.exit(f"the compiled engine fell back to eager: {compiled.note}")
    how = "compiled" if compiled.compiled.built else "loaded its compiled package"
    print(
        f"\ncompiled engine: {compiled.describe()}; stream {str(compiled.dtype).removeprefix('torch.')}; "
        f"{compiled.step_rows}-token steps; {how} in {compiled.compile_seconds:.0f} s\n"
    )
    table(compiled, prompt, following, args)
    compiled.reset()
    compiled.forward(prompt, all_logits=False)
    eager.reset()
    token = int(eager.forward(prompt, all_logits=False).argmax())
    eager_ms, compiled_ms = (median_step_ms(e, [token], args.repeats, eager.device) for e in (eager, compiled))
    differences, agree = [], 0
    for _ in range(64):
        expected, got = eager.forward([token]), compiled.forward([token])
        differences.append((expected - got).abs().max().item())
        agree += int(expected.argmax() == got.argmax())
        token = int(expected.argmax())
    print(
        f"\none-token step: compiled {compiled_ms:.2f} ms, eager {eager_ms:.2f} ms ({eager_ms / compiled_ms:.2f}×); "
        f"over 64 greedy steps the logits differ by at most {max(differences):.2f} "
        f"(median {statistics.median(differences):.2f}), argmax agrees {agree}/64",
        flush=True,
    )


if __name__ == "__main__":
    main()
