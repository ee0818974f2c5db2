"""How much memory ``apply`` will need, said before any compute, and refused when it is not there.

Compression holds one block at a time: its stored tensors and their float32 copy, the
calibration activations entering and leaving it, and the largest group of Hessians.
Evaluation holds one set of hidden states per model (the compressed one and the
reference). The tensors outside the blocks (embeddings, head) stay in memory throughout;
in evaluation the reference has its own, and both heads are cast to float32 while they
score. Recovery passes and data-free calibration need the whole model. Each phase's sum is
an estimate: bench_scale.py prints it beside the measured peak.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import moe
from .arch import arch_of

GB = 1e9
# Python, torch, transformers and a tokenizer: 0.38 GB after import and tokenizer load, plus headroom
RUNTIME = int(0.6 * GB)


class MemoryPlanError(RuntimeError):
    """The plan does not fit this machine; the message names the number and what to change."""


@dataclass
class MemoryPlan:
    compress: dict[str, int] = field(default_factory=dict)  # bytes by what holds them
    evaluate: dict[str, int] = field(default_factory=dict)  # the blocks, run over the windows
    score: dict[str, int] = field(default_factory=dict)  # then the heads, over the hidden states
    allocate: dict[str, int] = field(default_factory=dict)  # measuring an ``allocate`` key's costs, before compressing
    learn: dict[str, int] = field(default_factory=dict)  # training learned rotations, before compressing
    shared: dict[str, int] = field(default_factory=dict)  # held in both phases
    disk: dict[str, int] = field(default_factory=dict)  # spilled (``apply --spill``): files, not RAM
    kept: int = 0  # disk beside the output for the finished blocks ``--resume`` reads back
    where: str = "RAM"
    processes: int = 1  # processes of one run sharing this memory (torchrun on one machine's CPU)

    @property
    def peak(self) -> int:
        phases = (self.compress, self.evaluate, self.score, self.allocate, self.learn)
        one = RUNTIME + sum(self.shared.values()) + max(sum(phase.values()) for phase in phases)
        return self.processes * one

    def describe(self) -> str:
        parts = {**self.shared, **self.compress, **self.evaluate, **self.score, **self.allocate, **self.learn}
        top = ", ".join(f"{k} {v / GB:.2f}" for k, v in sorted(parts.items(), key=lambda kv: -kv[1]) if v)
        spilled = "".join(f"; {k} on disk ≈ {v / GB:.1f} GB" for k, v in self.disk.items())
        kept = f"; finished blocks kept for --resume ≤ {self.kept / GB:.1f} GB on disk" if self.kept else ""
        processes = f" for {self.processes} processes, each holding" if self.processes > 1 else ""
        return f"peak {self.where} ≈ {self.peak / GB:.1f} GB{processes} ({top} GB){spilled}{kept}"


def available_bytes(device: torch.device) -> int | None:
    """Memory free for us: the device's on CUDA, Linux's MemAvailable on the CPU (None elsewhere)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def plan(
    model,
    passes,
    device: torch.device,
    samples: int,
    cal_seqlen: int,
    windows: int,
    eval_seqlen: int,
    whole: bool,
    spill: bool = False,
    keep_blocks: bool = False,
    allocation_samples: int = 0,
) -> MemoryPlan:
    """``model`` a ``lazy.StreamedModel`` (shapes only are read); ``samples`` 0 without calibration,
    ``windows`` 0 without evaluation; ``whole``: the run reads every block and keeps it; ``spill``:
    calibration activations go to files (``apply --spill``); ``keep_blocks``: finished blocks
    are kept on disk for ``--resume`` (at most their stored tensors and a byte of mask per weight);
    ``allocation_samples``: the samples an ``allocate`` key measures its costs on (0: none)."""
    cfg = model.config
    stored = torch.tensor([], dtype=model.dtype).element_size()
    f32, hidden = 4, cfg.hidden_size
    n_block = sum(p.numel() for p in model.layers[0].parameters())
    n_outside = sum(p.numel() for n, p in model.model.named_parameters() if not n.startswith(model.prefix))
    dense = samples > 0 and any(p.needs_dense_inputs for p in passes)
    copies = 1 + (dense or any(p.needs_original for p in passes)) + dense
    plan = MemoryPlan(where="GPU memory" if device.type == "cuda" else "RAM")
    n_head = model.model.get_output_embeddings().weight.numel()
    plan.shared["tensors outside the blocks"] = n_outside * stored
    if whole:
        plan.shared["the whole model (recovery or data-free calibration)"] = n_block * len(model) * stored
    plan.compress["one block"] = n_block * (stored + copies * f32)
    plan.kept = n_block * len(model) * (stored + 1) if keep_blocks else 0
    # inputs, outputs and the inputs a replayed linear keeps: three sets of activations (GPTAQ: and the
    # dense model's inputs and outputs)
    sets = 3 + 2 * dense
    (plan.disk if spill else plan.compress)["calibration activations"] = sets * samples * cal_seqlen * hidden * f32
    if any(p.uses_hessian for p in passes):
        at_once = any(p.holds_block_statistics for p in passes if p.uses_hessian)
        plan.compress["Hessians"] = _hessian_stage(model, dense, at_once)
    if windows:
        # the reference has its own embeddings and head; each model's blocks run over the windows,
        # then both heads, cast to float32 (in place of their stored values), score the hidden states
        for phase in (plan.evaluate, plan.score):
            phase["the reference's tensors outside the blocks"] = n_outside * stored
            phase["evaluation hidden states"] = 2 * windows * eval_seqlen * hidden * f32  # model and reference
        plan.evaluate["one block"] = n_block * (stored + f32)
        plan.score["both heads in float32"] = 2 * n_head * (f32 - stored)
        plan.score["logits"] = 4 * (1 << 26) * f32  # two models' log-probabilities and their softmax, a chunk
    if allocation_samples:
        tokens = allocation_samples * cal_seqlen
        linears = [m for m in model.layers[0].modules() if isinstance(m, torch.nn.Linear)]
        plan.allocate["allocation: every block's inputs"] = len(model) * tokens * hidden * f32
        plan.allocate["allocation: gradients and outputs"] = 3 * tokens * hidden * f32
        plan.allocate["allocation: one sample's logits"] = 3 * cal_seqlen * cfg.vocab_size * f32
        candidates = 9  # allocate.DEFAULT_CANDIDATES; GGUF exports offer 5
        plan.allocate["allocation: one block and its rounding errors"] = n_block * (stored + f32 + candidates * f32)
        plan.allocate["allocation: one sample's inputs and output errors"] = (
            cal_seqlen * f32 * sum(m.in_features + candidates * m.out_features for m in linears)
        )
    if any(getattr(p, "learned", False) for p in passes):  # rotate: {kind: learned}
        n_all = n_block * len(model) + n_outside
        per_token = (12 * hidden + 3 * cfg.intermediate_size) * len(model) + 3 * cfg.vocab_size  # kept for backward
        # the float32 copy, each step's rotated and rounded weights, and what autograd keeps of them
        plan.learn["learned rotations: a float32 copy, its rotated weights, one sample's activations"] = (
            4 * n_all * f32 + cal_seqlen * per_token * f32
        )
    return plan


def _hessian_stage(model, dense: bool, at_once: bool) -> int:
    """The Hessians of one block as the sweeps hold them, and the working copy of the largest
    group of linears reading one input: each Hessian in float64 (hessian.statistics_dtype; its
    factor is computed in place in it), GPTAQ's asymmetry, and the stacked rows' float32 working
    copy, masks and integers. A true-sequential sweep holds one group's Hessian at a time,
    ``at_once`` (one forward observing the whole block) all of them. A mixture of experts
    observes one projection of every expert at once: E statistics."""
    block = model.layers[0]
    held = max((m.num_experts for m in moe.experts_of(block).values()), default=1)
    linears = {name: m for name, m in block.named_modules() if isinstance(m, torch.nn.Linear)}
    stages = [[linears[n] for n in group if n in linears] for group in arch_of(model.model).groups]
    sizes = [
        (
            (held * 8 + 8 * dense) * group[0].in_features ** 2,
            sum(m.out_features * m.in_features for m in group) * (4 * (len(group) > 1) + 4 + 3),
        )
        for group in stages
        if group
    ]
    if not sizes:
        return 0
    if at_once:
        return sum(h for h, _ in sizes) + max(work for _, work in sizes)
    return max(h + work for h, work in sizes)


def check(plan: MemoryPlan, device: torch.device) -> None:
    """Refuse a run whose plan exceeds what is free (COMPRESS_SKIP_MEMORY_CHECK=1 runs it anyway)."""
    free = available_bytes(device)
    if free is None or plan.peak <= free or os.environ.get("COMPRESS_SKIP_MEMORY_CHECK") == "1":
        return
    phases = {**plan.compress, **plan.evaluate, **plan.score, **plan.allocate, **plan.learn}
    biggest = max(phases.items(), key=lambda kv: kv[1])
    raise MemoryPlanError(
        f"this run needs about {plan.peak / GB:.1f} GB of {plan.where}, {free / GB:.1f} GB is free; "
        f"the largest part is {biggest[0]} ({biggest[1] / GB:.1f} GB): {_advice(biggest[0])} "
        "(set COMPRESS_SKIP_MEMORY_CHECK=1 to try anyway)"
    )


def _advice(part: str) -> str:
    """What shrinks the part of the plan that is largest."""
    if part == "Hessians":
        return (
            "a Hessian is as wide as its linear's input, whatever the samples: a machine with more memory, "
            "or a recipe whose passes need none (rtn, awq)"
        )
    if part.startswith("allocation"):
        return "lower the recipe's allocate.samples or the calibration seqlen"
    if part == "calibration activations":
        return "lower --samples or the calibration seqlen, or --spill DIR to keep them in files"
    if part.startswith("learned rotations"):
        return "lower the calibration seqlen, or rotate with kind: hadamard"
    return "lower --samples or the calibration seqlen, or --windows/--seqlen"


def check_disk(plan: MemoryPlan, folder: str | Path) -> None:
    """Refuse a spilled run whose activation files would not fit in ``folder``'s file system."""
    need, free = sum(plan.disk.values()), shutil.disk_usage(folder).free
    if need > free:
        raise MemoryPlanError(
            f"--spill {folder}: the activations need about {need / GB:.1f} GB there, "
            f"{free / GB:.1f} GB is free; give a folder on a larger disk or lower --samples"
        )
