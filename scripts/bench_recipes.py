"""Benchmark recipes on the bundled models under the standard protocol; print a markdown table.

    python scripts/bench_recipes.py --models smollm2-135m gemma3-270m --recipes rtn-w8 rtn-w4

Each recipe runs as its own `compress apply` process, so peak RSS is per run.
The dense row is the reference model the runs are compared against.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def machine() -> str:
    import torch

    cpu = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    return f"{cpu}, {torch.get_num_threads()} threads, {gpu}, torch {torch.__version__}, {platform.python_version()}"


def run(recipe: str, model: str, args, out: Path) -> dict:
    cmd = [sys.executable, "-m", "compress.cli", "apply", recipe, "--model", model, "--output", str(out),
           "--overwrite", "--windows", str(args.windows), "--seqlen", str(args.seqlen), "--dtype", args.dtype]
    if args.samples:
        cmd += ["--samples", str(args.samples)]
    start = time.perf_counter()
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{result.stderr[-3000:]}")
    report = json.loads((out / "report.json").read_text())
    report["wall_s"] = time.perf_counter() - start
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["smollm2-135m", "gemma3-270m"])
    parser.add_argument("--recipes", nargs="+", default=["rtn-w8", "rtn-w4"])
    parser.add_argument("--windows", type=int, default=40)
    parser.add_argument("--seqlen", type=int, default=2048)
    parser.add_argument("--samples", type=int, help="calibration samples (default: each recipe's)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--json", help="also write the raw reports here")
    args = parser.parse_args()

    print(f"command: python {' '.join(sys.argv)}")
    print(f"machine: {machine()}")
    print(f"protocol: wikitext-2-raw test, {args.windows} windows × {args.seqlen} tokens, dtype {args.dtype}\n")
    rows, raw = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models:
            dense = None
            for recipe in args.recipes:
                r = run(recipe, model, args, Path(tmp) / f"{model}-{recipe}")
                raw.append(r)
                e = r["eval"]
                if dense is None:
                    dense = e["ref_ppl"]
                    rows.append([model, "dense (bf16)", "16", "", f"{dense:.3f}", "0", "1.000", "", ""])
                rows.append([model, r["method"], f"{r['bits_per_weight']:.2f}", f"{r['size_mb']:.1f}",
                             f"{e['ppl']:.3f}", f"{e['kl']:.4f}", f"{e['top1']:.3f}", f"{r['compress_s']:.1f}",
                             f"{r['peak_rss_gb']:.2f}"])
                print(f"done: {model} {recipe} ({r['wall_s']:.0f} s with evaluation)", file=sys.stderr, flush=True)
    head = ["model", "method", "bits/w", "size MB", "ppl", "KL", "top-1", "compress s", "peak RSS GB"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for row in rows:
        print("| " + " | ".join(row) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps(raw, indent=2))


if __name__ == "__main__":
    main()
