"""Benchmark recipes on the bundled models under the standard protocol; print a markdown table.

    python scripts/bench_recipes.py --models smollm2-135m gemma3-270m --recipes rtn-w8 rtn-w4
    python scripts/bench_recipes.py --models smollm2-135m --recipes best-w3 best-w4 --target-bpw 3 3.5 4 --seeds 3

Each recipe compresses in its own `compress apply --no-eval` process, so the time and peak RSS
are per run. Then every export of a model is reloaded from disk (so what is scored is what was
written) and scored on the same windows in one pass, with the dense reference run once.
With ``--seeds N`` each recipe is compressed with calibration seeds 0..N-1 and its row gives
mean ± standard deviation over them: single runs cannot rank two methods closer than that.
With ``--target-bpw`` each recipe also runs allocated to each budget (``allocate``), a row each;
the layer costs are measured once per model and seed and read back for the other budgets.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from compress import machine


def compress(recipe: str, model: str, args, out: Path, seed: int | None, budget: str | None = None) -> dict | None:
    if args.reuse and (out / "report.json").exists():  # compressed by an earlier run into --keep
        return {**json.loads((out / "report.json").read_text()), "output": str(out)}  # where it is now
    cmd = [
        sys.executable,
        "-m",
        "compress.cli",
        "apply",
        recipe,
        "--model",
        model,
        "--output",
        str(out),
        "--overwrite",
        "--no-eval",
        "--dtype",
        args.dtype,
    ]
    if args.samples:
        cmd += ["--samples", str(args.samples)]
    if args.calibration_dtype:
        cmd += ["--calibration-dtype", args.calibration_dtype]
    if seed is not None:
        cmd += ["--seed", str(seed)]
    if budget is not None:
        cmd += ["--target-bpw", budget]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:  # one broken recipe should not cost the rest of the table
        print(f"FAILED: {' '.join(cmd)}\n{result.stderr[-3000:]}", file=sys.stderr, flush=True)
        return None
    return json.loads((out / "report.json").read_text())


def score(model: str, reports: list[dict], args) -> None:
    """Fill each report's ``eval`` from one shared pass over the evaluation windows."""
    import torch

    from compress import export, models
    from compress.evaluate import evaluate_many

    device = models.pick_device(args.device)
    dtype = models.parse_dtype(args.dtype)
    loaded = models.load(model, dtype)
    reference = None if args.no_kl else models.for_compute(loaded.model, device)
    candidates = {r["output"]: models.for_compute(models.load(r["output"], dtype).model, device) for r in reports}
    start = time.perf_counter()
    results = evaluate_many(candidates, loaded.tokenizer, "wikitext2", args.seqlen, args.windows, reference)
    print(f"scored {len(reports)} exports of {model} in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    for r in reports:
        r["eval"] = results[r["output"]].as_dict()
        if args.report:  # kept exports carry their score, for `compress report`
            export.add_evaluation(Path(r["output"]), r["eval"])
    del candidates, reference
    torch.cuda.empty_cache() if torch.cuda.is_available() else None


def _row_key(report: dict) -> tuple:
    return report["recipe"], (report.get("allocation") or {}).get("target_bpw")


def fmt(value, spec: str) -> str:
    return "" if value is None else format(value, spec)


def spread(values: list, spec: str) -> str:
    """``mean`` of one run, ``mean ± std`` (sample standard deviation) of several."""
    if any(v is None for v in values):
        return ""
    if len(values) == 1:
        return format(values[0], spec)
    return f"{format(statistics.mean(values), spec)} ± {format(statistics.stdev(values), spec)}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["smollm2-135m", "gemma3-270m"])
    parser.add_argument("--recipes", nargs="+", default=["rtn-w8", "rtn-w4"])
    parser.add_argument("--windows", type=int, default=40)
    parser.add_argument("--seqlen", type=int, default=2048)
    parser.add_argument("--samples", type=int, help="calibration samples (default: each recipe's)")
    parser.add_argument("--seeds", type=int, default=1, help="calibration seeds 0..N-1 per recipe: mean ± std")
    parser.add_argument(
        "--target-bpw",
        nargs="+",
        metavar="BITS",
        help="also run each recipe allocated to each of these budgets (compress apply --target-bpw): one row each",
    )
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument(
        "--calibration-dtype",
        choices=["auto", "float32", "bfloat16"],
        help="passed to compress apply (default: its own)",
    )
    parser.add_argument("--device", default="auto")
    parser.add_argument("--keep", help="keep the exports in this folder (default: a temporary one)")
    parser.add_argument("--json", help="also write the raw reports here")
    parser.add_argument("--no-kl", action="store_true", help="skip the dense reference (no KL, top-1 or dense row)")
    parser.add_argument(
        "--reuse",
        action="store_true",
        help="with --keep: score exports already there instead of compressing them again",
    )
    parser.add_argument(
        "--report",
        metavar="DIR",
        help="with --keep: also write each export's score into its "
        "report.json, and `compress report`'s table and plots "
        "into DIR/<model>",
    )
    args = parser.parse_args()
    if (args.reuse or args.report) and not args.keep:
        parser.error("--reuse and --report need --keep DIR (where the exports are kept)")

    print(f"command: python {' '.join(sys.argv)}")
    print(f"machine: {machine.describe()}, Python {platform.python_version()}")
    from compress import models

    device = models.pick_device(args.device)
    computed = models.compute_dtype(device, models.parse_dtype(args.dtype))
    print(
        f"protocol: wikitext-2-raw test, {args.windows} windows × {args.seqlen} tokens, stored {args.dtype}, "
        f"computed in {str(computed).removeprefix('torch.')} on {device.type}\n"
    )
    rows, raw = [], []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.keep or tmp)
        for model in args.models:
            reports = []
            runs = [(recipe, None) for recipe in args.recipes]
            runs += [(recipe, budget) for recipe in args.recipes for budget in args.target_bpw or []]
            for recipe, budget in runs:
                for seed in range(args.seeds) if args.seeds > 1 else [None]:
                    name = f"{model}-{Path(recipe).name.removesuffix('.yaml')}" + (f"-{budget}bpw" if budget else "")
                    name += f"-seed{seed}" if seed is not None else ""
                    r = compress(recipe, model, args, root / name, seed, budget)
                    if r is not None:
                        print(f"compressed: {name} in {r['compress_s']:.0f} s", file=sys.stderr, flush=True)
                        reports.append(r)
            if not reports:
                continue
            score(model, reports, args)
            raw += reports
            if args.report:
                from compress import report

                files, note = report.write([r["output"] for r in reports], Path(args.report) / model)
                print(f"report: {files[0]}" + (f" ({note})" if note else ""), file=sys.stderr, flush=True)
            if not args.no_kl:
                rows.append(
                    [model, "dense", "16", "", "", "", "", f"{reports[0]['eval']['ref_ppl']:.3f}", "0", "1.000", "", ""]
                )
            for key in dict.fromkeys(map(_row_key, reports)):  # one row per recipe and budget, over its seeds
                runs = [r for r in reports if _row_key(r) == key]
                r = runs[0]
                rows.append(
                    [
                        model,
                        r["method"] + (f" ({len(runs)} seeds)" if len(runs) > 1 else ""),
                        fmt(r["bits_per_weight"], ".2f"),
                        fmt(r.get("sparsity"), ".1%"),
                        fmt(r.get("params_kept"), ".1%"),
                        fmt(r.get("kv_bytes_per_token"), ",.0f"),
                        f"{r['size_mb']:.1f}",
                        spread([x["eval"]["ppl"] for x in runs], ".3f"),
                        spread([x["eval"]["kl"] for x in runs], ".4f"),
                        spread([x["eval"]["top1"] for x in runs], ".3f"),
                        spread([x["compress_s"] for x in runs], ".1f"),
                        f"{max(x['peak_rss_gb'] for x in runs):.2f}",
                    ]
                )
    head = [
        "model",
        "method",
        "bits/w",
        "sparsity",
        "params kept",
        "KV B/token",
        "size MB",
        "ppl",
        "KL",
        "top-1",
        "compress s",
        "peak RSS GB",
    ]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for row in rows:
        print("| " + " | ".join(row) + " |")
    print()
    for r in raw:
        extra = "".join(
            f"; {where}: loss {log['loss_first']:.4g} -> {log['loss_last']:.4g}"
            for where, log in r.get("training", {}).items()
            if "loss_first" in log
        )
        print(f"{r['recipe']}: calibration {r['calibration']}{extra}")
    if args.json:
        Path(args.json).write_text(json.dumps(raw, indent=2))


if __name__ == "__main__":
    main()
