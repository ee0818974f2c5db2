"""One process against several (torchrun, gloo on the CPU) on the same recipes: wall time, the
export's difference, and both perplexities.

For each recipe, `compress apply` runs once as one process with every core's thread, then as
``torchrun --standalone --nproc-per-node N`` with one thread per process (torchrun's default).
A row prints as soon as its run ends; the second row of a recipe compares its export with the
first's: tensors bit-identical, and the largest difference of a reloaded weight.

    python scripts/bench_distributed.py --recipes rtn-w4 gptq-w4 awq-w4 sparsegpt-2of4 smoothquant-w8a8 \
        --samples 32 --windows 8 --root DIR
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

import torch
from safetensors.torch import load_file

from compress import machine, models


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def compare(one: Path, other: Path) -> tuple[str, float]:
    """``identical/total`` stored tensors, and the largest difference between the reloaded weights."""
    a, b = _weights(one), _weights(other)
    same = sum(k in b and a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)
    wa = models.load(str(one), torch.float32).model.state_dict()
    wb = models.load(str(other), torch.float32).model.state_dict()
    diff = max((wa[k] - wb[k]).abs().max().item() for k in wa)
    return f"{same}/{len(a)}", diff


def run(recipe: str, processes: int, out: Path, args) -> tuple[float, dict, str]:
    cli = ["-m", "compress", "apply", recipe, "--output", str(out), "--overwrite", "--device", "cpu"]
    cli += ["--samples", str(args.samples), "--windows", str(args.windows)] + (
        ["--model", args.model] if args.model else []
    )
    env = dict(os.environ)
    if processes > 1:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={processes}"] + cli
        env["OMP_NUM_THREADS"] = "1"
    else:
        command = [sys.executable] + cli
        env.pop("OMP_NUM_THREADS", None)
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        return wall, {}, (done.stderr.strip().splitlines() or ["?"])[-1][:200]
    return wall, json.loads((out / "report.json").read_text()), ""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--recipes", nargs="+", default=["rtn-w4", "gptq-w4", "awq-w4", "sparsegpt-2of4", "smoothquant-w8a8"]
    )
    ap.add_argument("--processes", type=int, default=os.cpu_count())
    ap.add_argument("--samples", type=int, default=128)
    ap.add_argument("--windows", type=int, default=40)
    ap.add_argument("--model", help="default: each recipe's")
    ap.add_argument("--root", type=Path, default=Path("out/bench-distributed"))
    args = ap.parse_args()
    print(f"command: python {' '.join(shlex.quote(a) for a in sys.argv)}")
    print(f"machine: {machine.describe()}; {os.cpu_count()} cores; date {date.today()}")
    print(f"one process: {torch.get_num_threads()} threads; {args.processes} processes: 1 thread each, gloo")
    print()
    print("| recipe | processes | wall s | compress s | ppl | KL | tensors identical | max weight difference |")
    print("|---|---|---|---|---|---|---|---|", flush=True)
    for recipe in args.recipes:
        folders = {}
        for processes in (1, args.processes):
            out = args.root / f"{recipe}-{processes}p"
            wall, report, error = run(recipe, processes, out, args)
            if error:
                print(f"| {recipe} | {processes} | {wall:.0f} | failed: {error} |  |  |  |  |", flush=True)
                continue
            folders[processes] = out
            same, diff = compare(folders[1], out) if processes > 1 and 1 in folders else ("", None)
            ev = report.get("eval", {})
            cells = [
                recipe,
                str(processes),
                f"{wall:.0f}",
                f"{report['compress_s']:.0f}",
                f"{ev['ppl']:.3f}" if ev else "",
                f"{ev['kl']:.4f}" if ev.get("kl") is not None else "",
                same,
                "" if diff is None else f"{diff:.3g}",
            ]
            print("| " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
