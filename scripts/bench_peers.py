"""Peers side by side: llm-compressor's and GPTQModel's W4 (or W3) on SmolLM2 with our calibration
samples, scored by our evaluation beside our own recipes, in one run on one machine; one markdown
row as soon as each is measured.

    python scripts/bench_peers.py [--model smollm2-135m] [--samples 128] [--windows 40]
        [--peers llmc-gptq llmc-gptq-actorder llmc-rtn gptqmodel-gptq gptqmodel-awq]
        [--recipes gptq-w4 gptq-w4-actorder rtn-w4] [--bits 4] [--seeds 1] [--root out/peers]
        [--timeout SECONDS]

``--bits 3`` quantizes the peers to int3 (name W3 recipes of ours with ``--recipes``). The
``llmc-nvfp4a16-*``, ``llmc-nvfp4-*`` (W4A4), ``llmc-mxfp4a16-rtn``, ``llmc-fp8-dynamic`` and
``llmc-fp8-static`` peers quantize to compressed-tensors' preset float schemes instead (``--bits``
does not apply), to compare with our float recipes (``--recipes nvfp4a16 gptq-nvfp4a16
best-nvfp4a16 nvfp4 fp8-dynamic fp8``). With
``--seeds N`` every row is quantized from calibration seeds 0..N-1 (ours through ``compress apply
--seed``, the peers from the same seed's token ids) and shows mean ± standard deviation; a line
per seed goes to stderr as it is scored.

llm-compressor pins transformers and compressed-tensors versions other than ours, and GPTQModel
brings dependencies of its own, so each runs in a virtual environment of its own in the
repository, made on first use from the CPU build of torch 2.13.0: ``.venv-peers`` (llmcompressor
0.14.0.1) and ``.venv-gptqmodel`` (gptqmodel 7.6.0, the newest that accepts torch 2.13; it
compiles nothing at install). Every peer row quantizes the same
bf16 checkpoint as ours (the bundled model's cached safetensors folder), with our calibration
samples (the exact ``samples`` × ``seqlen`` token ids ``compress apply`` calibrates on), at the
scheme of our recipes: int4 (or int3), symmetric, groups of 64, lm_head dense; GPTQModel's other
settings at its defaults (for GPTQ: its group-aware activation order, GAR, and 5% dampening).
llm-compressor writes its export in its own compressed-tensors layout. GPTQModel writes its
GPTQ/AWQ layouts, which our loader does not read: its worker writes a dense float32 copy instead,
each quantized linear's weight read back through GPTQModel's own kernel (the layer applied to the
identity matrix), and the row is scored from that copy in float32 (the dense reference then loads
exactly as in bfloat16; the CPU computes in float32 either way).
``compress eval`` scores every export on the same windows, against the same dense reference, as
ours. "compress s" is the quantization call alone (the model's load and the export's write
excluded; ours: the block sweep), wall and peak RSS are the whole process's. A peer that fails is
a row with its error; one stopped by ``--timeout`` a row with the last line it printed (how
far it got).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from bench_recipes import spread

REPO = Path(__file__).resolve().parent.parent

# Runs inside .venv-peers: quantize with llm-compressor, save compressed, print the seconds.
LLMC_WORKER = r"""
import json, sys, time
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

folder, ids_path, method, group, bits, out = sys.argv[1:7]
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
from datasets import Dataset
from llmcompressor import oneshot
from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier

ids = load_file(ids_path)["ids"]
model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
tokenizer = AutoTokenizer.from_pretrained(folder)
method, _, preset = method.partition(":")  # "gptq:NVFP4A16": one of compressed-tensors' preset schemes
weights = QuantizationArgs(num_bits=int(bits), type="int", symmetric=True, strategy="group", group_size=int(group))
scheme = dict(config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=weights)})
if preset:
    scheme = dict(scheme=preset, targets=["Linear"])
data = Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": torch.ones_like(ids).tolist()})
calibrated = dict(dataset=data, num_calibration_samples=len(ids), max_seq_length=ids.shape[1])
start = time.perf_counter()
if method == "rtn":  # a preset with static activation scales calibrates them on the same data
    needs = preset in ("NVFP4", "FP8")
    oneshot(model=model, recipe=QuantizationModifier(**scheme, ignore=["lm_head"]), **(calibrated if needs else {}))
else:
    order = "static" if method == "gptq-actorder" else None
    modifier = GPTQModifier(**scheme, ignore=["lm_head"], actorder=order, dampening_frac=0.01)
    oneshot(model=model, recipe=modifier, **calibrated)
seconds = time.perf_counter() - start
model.save_pretrained(out, save_compressed=True)
tokenizer.save_pretrained(out)
print("PEER-RESULT " + json.dumps({"seconds": seconds}), flush=True)
"""

# Runs inside .venv-gptqmodel: quantize with GPTQModel at its defaults, save its checkpoint, load it
# back as its users do, and write a dense float32 copy whose quantized linears hold the weights
# GPTQModel's own CPU kernel computes with (each layer applied to the identity matrix).
GPTQMODEL_WORKER = r"""
import json, os, sys, time

folder, ids_path, method, group, bits, out = sys.argv[1:7]
ids_path, out = os.path.abspath(ids_path), os.path.abspath(out)
os.chdir(os.path.dirname(out))  # GPTQModel writes a logs/ folder where it runs
os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")  # its default, 1 on 2 cores, fails its own pool check
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer
from gptqmodel import BACKEND, GPTQModel
from gptqmodel.nn_modules.qlinear import BaseQuantLinear
from gptqmodel.quantization.config import AWQConfig, GPTQConfig

ids = load_file(ids_path)["ids"]
config = (AWQConfig if method == "awq" else GPTQConfig)(bits=int(bits), group_size=int(group), sym=True)
model = GPTQModel.load(folder, config, device="cpu")
start = time.perf_counter()
samples = [{"input_ids": row.tolist(), "attention_mask": [1] * len(row)} for row in ids]
# AWQ packs for its CUDA GEMM kernel unless told to pack for its torch one
model.quantize(samples, batch_size=1, backend=BACKEND.AWQ_TORCH if method == "awq" else BACKEND.AUTO)
seconds = time.perf_counter() - start
native = os.path.join(out, "gptqmodel")
model.save(native)
del model
quantized = GPTQModel.load(native, device="cpu").model
dense = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
kernels, state = set(), quantized.state_dict()
with torch.no_grad():
    for key, tensor in dense.state_dict().items():  # the norms AWQ folded its scales into
        if key in state and state[key].shape == tensor.shape and state[key].is_floating_point():
            tensor.copy_(state[key])
    for name, layer in quantized.named_modules():
        if isinstance(layer, BaseQuantLinear):
            weight = layer(torch.eye(layer.in_features, dtype=layer.scales.dtype)).float()
            if getattr(layer, "bias", None) is not None:
                weight -= layer.bias.float()
            dense.get_submodule(name).weight.copy_(weight.T)
            kernels.add(type(layer).__name__)
if not kernels:
    raise SystemExit("no quantized linear in GPTQModel's checkpoint")
dense.save_pretrained(out)
AutoTokenizer.from_pretrained(folder).save_pretrained(out)
print("PEER-RESULT " + json.dumps({"seconds": seconds, "kernels": sorted(kernels)}), flush=True)
"""


@dataclass(frozen=True)
class Tool:
    name: str  # as rows name it
    venv: str  # in the repository
    packages: tuple[str, ...]
    worker: str
    eval_args: tuple[str, ...] = ()


LLMC = Tool("llm-compressor 0.14.0.1", ".venv-peers", ("llmcompressor==0.14.0.1",), LLMC_WORKER)
GPTQMODEL = Tool("GPTQModel 7.6.0", ".venv-gptqmodel", ("gptqmodel==7.6.0",), GPTQMODEL_WORKER, ("--dtype", "float32"))
PEERS = {  # row name -> (tool, worker method)
    "llmc-gptq": (LLMC, "gptq"),
    "llmc-gptq-actorder": (LLMC, "gptq-actorder"),
    "llmc-rtn": (LLMC, "rtn"),
    # float schemes (compressed-tensors' presets); --bits does not apply to them
    "llmc-nvfp4a16-rtn": (LLMC, "rtn:NVFP4A16"),
    "llmc-nvfp4a16-gptq": (LLMC, "gptq:NVFP4A16"),
    "llmc-mxfp4a16-rtn": (LLMC, "rtn:MXFP4A16"),
    "llmc-fp8-dynamic": (LLMC, "rtn:FP8_DYNAMIC"),
    "llmc-fp8-static": (LLMC, "rtn:FP8"),  # per-tensor weights, static per-tensor activations
    "llmc-nvfp4-rtn": (LLMC, "rtn:NVFP4"),  # W4A4
    "llmc-nvfp4-gptq": (LLMC, "gptq:NVFP4"),
    "gptqmodel-gptq": (GPTQMODEL, "gptq"),
    "gptqmodel-awq": (GPTQMODEL, "awq"),
}


def run(command: list[str], log: Path, timeout: float | None = None) -> tuple[int, float, float, str]:
    """(exit status, wall seconds, peak RSS GB, output) of a child process, its output kept in ``log``;
    killed after ``timeout`` seconds."""
    start = time.perf_counter()
    with open(log, "w") as out:
        child = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
        timer = threading.Timer(timeout, child.kill) if timeout else None
        if timer:
            timer.start()
        _, status, usage = os.wait4(child.pid, 0)
        if timer:
            timer.cancel()
    child.returncode = os.waitstatus_to_exitcode(status)
    return child.returncode, time.perf_counter() - start, usage.ru_maxrss / 1e6, log.read_text()


def last_line(output: str) -> str:
    """The last non-empty line, or the last frame of a progress bar drawn with carriage returns."""
    lines = [part.strip() for line in output.splitlines() for part in line.split("\r") if part.strip()]
    return lines[-1][:160] if lines else ""


def peer_python(tool: Tool) -> Path:
    """The tool's interpreter, its environment made first if it is missing. torch is pinned to the
    CPU build in the same install, so that no dependency pulls a CUDA build."""
    venv = REPO / tool.venv
    python = venv / "bin" / "python"
    if not python.exists():
        print(f"making {tool.venv} (torch 2.13.0 CPU, {', '.join(tool.packages)}) ...", file=sys.stderr, flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", "torch==2.13.0", *tool.packages], check=True)
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
    parser.add_argument("--bits", type=int, default=4, choices=[3, 4], help="the peers' weight bits")
    parser.add_argument("--seeds", type=int, default=1, help="calibration seeds 0..N-1 per row: mean ± std")
    parser.add_argument("--root", default="out/peers", help="exports and logs go here")
    parser.add_argument(
        "--timeout", type=float, help="kill a peer's process after this many seconds; its row says how far it got"
    )
    args = parser.parse_args()
    if args.seeds < 1:
        parser.error("--seeds must be at least 1")

    import torch
    from safetensors.torch import save_file

    from compress import data, machine, models

    root = Path(args.root)
    root.mkdir(parents=True, exist_ok=True)
    loaded = models.load(args.model, torch.bfloat16)
    folder = models.local_folder(args.model)
    seeds = list(range(args.seeds))
    for seed in seeds:
        ids, what = data.calibration_batches(loaded.model, loaded.tokenizer, "wikitext2", args.samples, 512, seed)
        save_file({"ids": ids.contiguous()}, str(root / f"calibration-seed{seed}.safetensors"))
    del loaded
    print(f"command: python {shlex.join(sys.argv)}")
    print(f"machine: {machine.describe()}")
    print(
        f"model: {args.model}; calibration {what}, seeds {', '.join(map(str, seeds))}; "
        f"evaluation {args.windows} × 2048 tokens of wikitext-2 test\n"
    )
    print("| tool | method | compress s | wall s | peak RSS GB | ppl | KL | top-1 | note |")
    print("|---|---|---|---|---|---|---|---|---|", flush=True)

    def row(tool, method, runs: list[dict], note=""):
        """One row over the seeds' runs: each run has seconds, wall, rss, ppl, kl, top1."""
        cells = [tool, method + (f" ({len(runs)} seeds)" if len(runs) > 1 else "")]
        for key, spec in (("seconds", ".0f"), ("wall", ".0f")):
            cells.append(spread([r.get(key) for r in runs], spec) if runs else "")
        cells.append(f"{max(r['rss'] for r in runs):.2f}" if runs else "")  # the largest of the seeds
        for key, spec in (("ppl", ".3f"), ("kl", ".4f"), ("top1", ".3f")):
            cells.append(spread([r.get(key) for r in runs], spec) if runs else "")
        cells.append(note)
        print("| " + " | ".join(cells) + " |", flush=True)

    def progress(name, seed, run):
        if len(seeds) > 1:
            print(f"{name} seed {seed}: ppl {run.get('ppl')} KL {run.get('kl')}", file=sys.stderr, flush=True)

    ours = [sys.executable, "-m", "compress.cli"]
    for recipe in args.recipes:
        runs, note = [], ""
        for seed in seeds:
            name = f"ours-{recipe}" + (f"-seed{seed}" if len(seeds) > 1 else "")
            out = root / name
            command = [*ours, "apply", recipe, "--model", args.model, "--samples", str(args.samples)]
            command += ["--windows", str(args.windows), "--seed", str(seed), "--output", str(out), "--overwrite"]
            status, wall, rss, output = run(command, root / f"{name}.log")
            if status != 0:
                note = output.strip().splitlines()[-1]
                break
            report = json.loads((out / "report.json").read_text())
            runs.append(
                {"seconds": report.get("compress_s"), "wall": wall, "rss": rss}
                | {k: report.get("eval", {}).get(k) for k in ("ppl", "kl", "top1")}
            )
            progress(recipe, seed, runs[-1])
        row("compress (ours)", recipe, runs, note)

    pythons: dict[Tool, Path | str] = {}
    for peer in args.peers:
        tool, method = PEERS[peer]
        if tool not in pythons:
            try:
                pythons[tool] = peer_python(tool)
            except subprocess.CalledProcessError as e:
                pythons[tool] = f"install failed: {e}"
        label = peer if ":" in method else f"{peer} W{args.bits}"
        if isinstance(pythons[tool], str):
            row(tool.name, label, [], pythons[tool])
            continue
        runs, note = [], ""
        for seed in seeds:
            name = f"{peer}-w{args.bits}" + (f"-seed{seed}" if len(seeds) > 1 else "")
            out = root / name
            ids_file = root / f"calibration-seed{seed}.safetensors"
            command = [str(pythons[tool]), "-c", tool.worker, str(folder), str(ids_file), method, "64"]
            command += [str(args.bits), str(out)]
            status, wall, rss, output = run(command, root / f"{name}.log", args.timeout)
            if status != 0:
                stopped = args.timeout and wall >= args.timeout
                note = f"stopped after {wall:.0f} s (--timeout) at: " if stopped else "failed: "
                note += last_line(output) or f"exit status {status}"
                break
            seconds = json.loads(output.split("PEER-RESULT ", 1)[1].splitlines()[0])["seconds"]
            _, _, _, scored = run(
                [*ours, "eval", str(out), "--reference", args.model, "--windows", str(args.windows), *tool.eval_args],
                root / f"{name}-eval.log",
            )
            runs.append({"seconds": seconds, "wall": wall, "rss": rss} | scores(scored))
            progress(peer, seed, runs[-1])
        row(tool.name, label, runs, note)


if __name__ == "__main__":
    main()
