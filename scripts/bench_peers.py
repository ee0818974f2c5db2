"""Peers side by side: llm-compressor's W4 on SmolLM2 with our calibration samples, scored by our
evaluation beside our own recipes, in one run on one machine; one markdown row as soon as each
is measured.

    python scripts/bench_peers.py [--model smollm2-135m] [--samples 128] [--windows 40]
        [--peers llmc-gptq llmc-gptq-actorder llmc-rtn] [--recipes gptq-w4 gptq-w4-actorder rtn-w4]
        [--root out/peers]

llm-compressor pins transformers and compressed-tensors versions other than ours, so it runs in
a virtual environment of its own, ``.venv-peers`` in the repository (made on first use: the CPU
build of torch 2.13.0, then llmcompressor 0.14.0.1 with what it pins). Every peer row quantizes
the same bf16 checkpoint as ours (the bundled model's cached safetensors folder), with our
calibration samples (the exact ``samples`` × ``seqlen`` token ids ``compress apply`` calibrates
on), at the scheme of our W4 recipes: int4, symmetric, groups of 64, lm_head dense; llm-compressor
writes its export in its own compressed-tensors layout, and ``compress eval`` scores it on the
same windows, against the same dense reference, as our exports. "compress s" is the quantization
call alone (the model's load and the export's write excluded; ours: the block sweep), wall and
peak RSS are the whole process's. A peer that fails is a row with its error.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PEERS_VENV = REPO / ".venv-peers"
PEER_PACKAGES = ["llmcompressor==0.14.0.1"]

# Runs inside .venv-peers: quantize with llm-compressor, save compressed, print the seconds.
WORKER = r"""
import json, sys, time
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

folder, ids_path, method, group, out = sys.argv[1:6]
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
from llmcompressor import oneshot
from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier

ids = load_file(ids_path)["ids"]
model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
tokenizer = AutoTokenizer.from_pretrained(folder)
weights = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=int(group))
groups = {"group_0": QuantizationScheme(targets=["Linear"], weights=weights)}
start = time.perf_counter()
if method == "rtn":
    oneshot(model=model, recipe=QuantizationModifier(config_groups=groups, ignore=["lm_head"]))
else:
    from datasets import Dataset

    data = Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": torch.ones_like(ids).tolist()})
    order = "static" if method == "gptq-actorder" else None
    modifier = GPTQModifier(config_groups=groups, ignore=["lm_head"], actorder=order, dampening_frac=0.01)
    oneshot(model=model, dataset=data, recipe=modifier, num_calibration_samples=len(ids), max_seq_length=ids.shape[1])
seconds = time.perf_counter() - start
model.save_pretrained(out, save_compressed=True)
tokenizer.save_pretrained(out)
print("PEER-RESULT " + json.dumps({"seconds": seconds}), flush=True)
"""

PEERS = {  # row name -> worker method
    "llmc-gptq": "gptq",
    "llmc-gptq-actorder": "gptq-actorder",
    "llmc-rtn": "rtn",
}


def run(command: list[str], log: Path) -> tuple[int, float, float, str]:
    """(exit status, wall seconds, peak RSS GB, output) of a child process, its output kept in ``log``."""
    start = time.perf_counter()
    with open(log, "w") as out:
        child = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
        _, status, usage = os.wait4(child.pid, 0)
    child.returncode = os.waitstatus_to_exitcode(status)
    return child.returncode, time.perf_counter() - start, usage.ru_maxrss / 1e6, log.read_text()


def peers_python() -> Path:
    """The peers' interpreter, the environment made first if it is missing."""
    python = PEERS_VENV / "bin" / "python"
    if not python.exists():
        print(
            f"making {PEERS_VENV.name} (torch 2.13.0 CPU, {', '.join(PEER_PACKAGES)}) ...", file=sys.stderr, flush=True
        )
        subprocess.run([sys.executable, "-m", "venv", str(PEERS_VENV)], check=True)
        pip = [str(python), "-m", "pip", "install", "-q"]
        subprocess.run([*pip, "torch==2.13.0"], check=True)
        subprocess.run([*pip, *PEER_PACKAGES], check=True)
    return python


def scores(output: str) -> dict:
    """Perplexity, KL and top-1 from `compress eval`'s or `compress apply`'s output."""
    found = {}
    for key, pattern in (
        ("ppl", r"perplexity: ([\d.]+)"),
        ("kl", r"KL: ([\d.]+)"),
        ("top1", r"top-1 agreement: ([\d.]+)"),
    ):
        match = re.search(pattern, output)
        found[key] = float(match.group(1)) if match else None
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--samples", type=int, default=128, help="calibration samples of 512 tokens")
    parser.add_argument("--windows", type=int, default=40, help="evaluation windows of 2048 tokens")
    parser.add_argument("--peers", nargs="*", default=list(PEERS), choices=list(PEERS))
    parser.add_argument("--recipes", nargs="*", default=["gptq-w4", "gptq-w4-actorder", "rtn-w4"])
    parser.add_argument("--root", default="out/peers", help="exports and logs go here")
    args = parser.parse_args()

    import torch

    from compress import data, machine, models

    root = Path(args.root)
    root.mkdir(parents=True, exist_ok=True)
    loaded = models.load(args.model, torch.bfloat16)
    folder = models.local_folder(args.model)
    ids, what = data.calibration_batches(loaded.model, loaded.tokenizer, "wikitext2", args.samples, 512, seed=0)
    from safetensors.torch import save_file

    save_file({"ids": ids.contiguous()}, str(root / "calibration.safetensors"))
    del loaded
    print(f"command: python {shlex.join(sys.argv)}")
    print(f"machine: {machine.describe()}")
    print(f"model: {args.model}; calibration {what}; evaluation {args.windows} × 2048 tokens of wikitext-2 test\n")
    print("| tool | method | compress s | wall s | peak RSS GB | ppl | KL | top-1 | note |")
    print("|---|---|---|---|---|---|---|---|---|", flush=True)

    def row(tool, method, seconds, wall, rss, found, note=""):
        cells = [
            tool,
            method,
            f"{seconds:.0f}" if seconds is not None else "",
            f"{wall:.0f}" if wall is not None else "",
            f"{rss:.2f}" if rss is not None else "",
            f"{found['ppl']:.3f}" if found.get("ppl") else "",
            f"{found['kl']:.4f}" if found.get("kl") is not None else "",
            f"{found['top1']:.3f}" if found.get("top1") is not None else "",
            note,
        ]
        print("| " + " | ".join(cells) + " |", flush=True)

    ours = [sys.executable, "-m", "compress.cli"]
    for recipe in args.recipes:
        out = root / f"ours-{recipe}"
        status, wall, rss, output = run(
            [
                *ours,
                "apply",
                recipe,
                "--model",
                args.model,
                "--samples",
                str(args.samples),
                "--windows",
                str(args.windows),
                "--output",
                str(out),
                "--overwrite",
            ],
            root / f"ours-{recipe}.log",
        )
        report = json.loads((out / "report.json").read_text()) if status == 0 else {}
        found = {k: report.get("eval", {}).get(k) for k in ("ppl", "kl", "top1")}
        seconds = report.get("compress_s")
        row(
            "compress (ours)", recipe, seconds, wall, rss, found, "" if status == 0 else output.strip().splitlines()[-1]
        )

    try:
        python = peers_python()
    except subprocess.CalledProcessError as e:
        for name in args.peers:
            row("llm-compressor 0.14.0.1", name, None, None, None, {}, f"install failed: {e}")
        return
    for name in args.peers:
        out = root / name
        status, wall, rss, output = run(
            [
                str(python),
                "-c",
                WORKER,
                str(folder),
                str(root / "calibration.safetensors"),
                PEERS[name],
                "64",
                str(out),
            ],
            root / f"{name}.log",
        )
        if status != 0:
            last = [line for line in output.strip().splitlines() if line.strip()][-1:] or [f"exit status {status}"]
            row("llm-compressor 0.14.0.1", name, None, wall, rss, {}, f"failed: {last[0][:160]}")
            continue
        seconds = json.loads(output.split("PEER-RESULT ", 1)[1].splitlines()[0])["seconds"]
        _, _, _, scored = run(
            [*ours, "eval", str(out), "--reference", args.model, "--windows", str(args.windows)],
            root / f"{name}-eval.log",
        )
        row("llm-compressor 0.14.0.1", name, seconds, wall, rss, scores(scored))


if __name__ == "__main__":
    main()
