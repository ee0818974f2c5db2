"""Peak memory and time of `compress apply` and `compress eval` as a model grows layer by layer.

Writes one synthetic checkpoint with random bf16 weights of Llama-3-8B's shapes (hidden 4096,
intermediate 14336, 32/8 heads, vocab 128256) or, with `--width 70b`, Llama-3-70B's (hidden
8192, intermediate 28672, 64/8 heads), one shard per layer, then for each layer count a folder
whose index lists only the first N layers (the shards are shared by links), and runs rtn-w4
(and the calibrated recipes with a few samples on the smallest models) and `compress eval` on
each. Peak RSS is the child process's own (wait4), not this script's, in GB of 10⁹ bytes as
the memory plan beside it (tables before 2026-11-30 gave GiB); seconds per block are the
export's compression time over its layers, projected to Llama-3-70B's 80. Rows print as measured.

    python scripts/bench_scale.py --layers 2 4 8 16 32 --gptq-layers 2 4 --root /big/disk/bench-scale
    python scripts/bench_scale.py --layers 56 --root /big/disk/bench-scale      # larger than RAM
    python scripts/bench_scale.py --layers 2 --gptq-layers 2 --data-recipe wanda-50 --samples 16 \
        --spill /big/disk/spill --root /big/disk/bench-scale                     # activations in files
    python scripts/bench_scale.py --width 70b --layers 2 --gptq-layers 2 \
        --data-recipes gptq-w4 awq-w4 sparsegpt-2of4 --root /big/disk/bench-scale

Random weights measure memory and time, not quality: perplexities are meaningless here.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

import torch
from safetensors.torch import save_file

from compress import machine

LLAMA = dict(
    num_key_value_heads=8,
    vocab_size=128256,
    max_position_embeddings=8192,
    rope_theta=500000.0,
    tie_word_embeddings=False,
)
SHAPES = {  # --width: Llama-3's 8B and 70B
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, **LLAMA),
    "70b": dict(hidden_size=8192, intermediate_size=28672, num_attention_heads=64, **LLAMA),
}


PROJECTED = 80  # blocks of Llama-3-70B: the time per block projected to the whole model


def cpu_header() -> str:
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"machine: {machine.describe()}; {os.cpu_count()} cores, {mem:.1f} GiB RAM"


def _layer(i: int, g: torch.Generator, shapes: dict) -> dict[str, torch.Tensor]:
    h, m = shapes["hidden_size"], shapes["intermediate_size"]
    kv = h // shapes["num_attention_heads"] * shapes["num_key_value_heads"]
    linears = {
        "self_attn.q_proj": (h, h),
        "self_attn.k_proj": (kv, h),
        "self_attn.v_proj": (kv, h),
        "self_attn.o_proj": (h, h),
        "mlp.gate_proj": (m, h),
        "mlp.up_proj": (m, h),
        "mlp.down_proj": (h, m),
    }
    out = {f"model.layers.{i}.{n}.weight": (torch.randn(s, generator=g) * 0.02).bfloat16() for n, s in linears.items()}
    for norm in ("input_layernorm", "post_attention_layernorm"):
        out[f"model.layers.{i}.{norm}.weight"] = torch.ones(h, dtype=torch.bfloat16)
    return out


def write_shards(root: Path, layers: int, width: str) -> Path:
    """One shard per layer plus one for the rest, written once and reused by every layer count."""
    shapes = SHAPES[width]
    shards = root / f"shards-{width}"
    shards.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    rest = shards / "rest.safetensors"
    if not rest.exists():
        v, h = shapes["vocab_size"], shapes["hidden_size"]
        save_file(
            {
                "model.embed_tokens.weight": (torch.randn(v, h, generator=g) * 0.02).bfloat16(),
                "model.norm.weight": torch.ones(h, dtype=torch.bfloat16),
                "lm_head.weight": (torch.randn(v, h, generator=g) * 0.02).bfloat16(),
            },
            rest,
            metadata={"format": "pt"},
        )
    for i in range(layers):
        path = shards / f"layer-{i:03d}.safetensors"
        if not path.exists():
            tmp = path.with_suffix(".tmp")
            save_file(_layer(i, g, shapes), tmp, metadata={"format": "pt"})
            os.replace(tmp, path)
            print(f"  wrote {path.name}", file=sys.stderr, flush=True)
    return shards


def model_folder(root: Path, shards: Path, layers: int, width: str, tokenizer_from: Path) -> Path:
    """A checkpoint folder of ``layers`` layers: config, tokenizer, index and links to the shards."""
    from transformers import LlamaConfig

    folder = root / f"llama{width}-width-{layers}L"
    if (folder / "config.json").exists():
        return folder
    folder.mkdir(parents=True)
    LlamaConfig(num_hidden_layers=layers, **SHAPES[width]).save_pretrained(folder)
    weight_map = {}
    for name in ["rest.safetensors"] + [f"layer-{i:03d}.safetensors" for i in range(layers)]:
        (folder / name).symlink_to(shards / name)
        from safetensors import safe_open

        with safe_open(shards / name, framework="pt") as st:
            weight_map.update({k: name for k in st.keys()})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    for f in tokenizer_from.iterdir():
        if f.name.startswith("tokenizer") or f.name in ("special_tokens_map.json", "chat_template.jinja"):
            shutil.copy(f, folder / f.name)
    return folder


def run(cmd: list[str]) -> tuple[float, float, str]:
    """(peak RSS GB of the child, wall seconds, its output)."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{out[-3000:]}")
    return usage.ru_maxrss * 1024 / 1e9, time.perf_counter() - start, out  # GB of 10⁹ bytes, as the plan


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, nargs="+", default=[2, 4, 8, 16, 32])
    ap.add_argument("--gptq-layers", type=int, nargs="*", default=[2, 4])
    ap.add_argument("--root", type=Path, required=True, help="a folder on a disk with room for the checkpoints")
    ap.add_argument("--windows", type=int, default=2)
    ap.add_argument("--seqlen", type=int, default=256)
    ap.add_argument("--samples", type=int, default=4, help="calibration samples of the data recipe")
    ap.add_argument("--width", choices=SHAPES, default="8b", help="Llama-3-8B's or Llama-3-70B's shapes")
    ap.add_argument(
        "--data-recipes",
        "--data-recipe",
        nargs="+",
        default=["gptq-w4"],
        help="calibrated recipes, on --gptq-layers",
    )
    ap.add_argument(
        "--spill", type=Path, help="run the data recipe without evaluation, in RAM and with --spill in this folder"
    )
    ap.add_argument("--keep", action="store_true", help="keep the exports (they are removed after each row)")
    args = ap.parse_args()

    from compress import models

    print(f"# bench_scale: {' '.join(sys.argv)}")
    print(f"# {cpu_header()}; {date.today()}")
    print(
        f"# rows: apply = compress, export and evaluate ({args.windows} x {args.seqlen} tokens against the "
        "original); eval = `compress eval` of the export alone, same windows"
    )
    print(
        "| layers | params (B) | checkpoint GB | recipe | apply peak RSS GB | plan GB | apply s | s per block | "
        f"{PROJECTED} blocks h | eval peak RSS GB | eval s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|", flush=True)
    shards = write_shards(args.root, max(args.layers), args.width)
    tokenizer_from = models.resolve("smollm2-135m")
    compress_cli = [sys.executable, "-c", "import sys; from compress.cli import main; sys.exit(main())"]
    for layers in args.layers:
        folder = model_folder(args.root, shards, layers, args.width, tokenizer_from)
        files = set(json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"].values())
        size = sum((folder / f).stat().st_size for f in files) / 1e9
        params = size / 2  # bf16
        rows = [("rtn-w4", [])]
        for recipe in args.data_recipes if layers in args.gptq_layers else []:
            if not args.spill:
                rows.append((recipe, ["--samples", str(args.samples)]))
            else:  # without evaluation, whose peak would hide the calibration's
                calibrate = ["--samples", str(args.samples), "--no-eval"]
                rows += [(recipe, calibrate), (recipe, calibrate + ["--spill", str(args.spill)])]
        for recipe, extra in rows:
            out = args.root / f"out-{recipe}-{layers}L"
            cmd = compress_cli + [
                "apply",
                recipe,
                "--model",
                str(folder),
                "--output",
                str(out),
                "--overwrite",
                "--windows",
                str(args.windows),
                "--seqlen",
                str(args.seqlen),
                "--device",
                "cpu",
                *extra,
            ]
            rss, wall, log = run(cmd)
            plan = re.search(r"peak RAM ≈ ([\d.]+) GB", log)
            per_block = json.loads((out / "report.json").read_text())["compress_s"] / layers
            e_rss, e_wall, _ = run(
                compress_cli
                + ["eval", str(out), "--windows", str(args.windows), "--seqlen", str(args.seqlen), "--device", "cpu"]
            )
            said = (
                [f"{args.samples} samples"] + ["no eval"] * ("--no-eval" in extra) + ["spilled"] * ("--spill" in extra)
            )
            name = recipe + (f" ({', '.join(said)})" if extra else "")
            print(
                f"| {layers} | {params:.2f} | {size:.1f} | {name} | {rss:.2f} | {plan.group(1) if plan else '?'} | "
                f"{wall:.0f} | {per_block:.0f} | {per_block * PROJECTED / 3600:.1f} | {e_rss:.2f} | {e_wall:.0f} |",
                flush=True,
            )
            if not args.keep:
                shutil.rmtree(out)


if __name__ == "__main__":
    main()
