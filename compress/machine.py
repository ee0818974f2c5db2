"""The machine a number was measured on: every benchmark prints ``describe()`` in its header, and
kernel timings and compiled steps are kept per ``key`` (the fastest kernel differs by CPU)."""

from __future__ import annotations

import functools
import os
import platform
from pathlib import Path

import torch

# the instruction sets that decide which kernel wins on a CPU
ISA = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8", "amx_tile")


@functools.cache
def _cpuinfo(field: str) -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return ""
    return next((line.partition(":")[2].strip() for line in lines if line.startswith(field)), "")


def cpu_name() -> str:
    return _cpuinfo("model name") or platform.processor() or "unknown CPU"


def isa_limit() -> str | None:
    """torch's ``ATEN_CPU_CAPABILITY`` when it caps the vector instructions torch uses (``avx2`` or
    ``default``): we cap ours to match, so that an AVX-512 machine can run and time the code an
    AVX2-only CPU gets (with ``ONEDNN_MAX_CPU_ISA=AVX2`` for oneDNN's kernels)."""
    limit = os.environ.get("ATEN_CPU_CAPABILITY", "").lower()
    return limit if limit in ("avx2", "default") else None


def cpu_flags() -> set[str]:
    flags, limit = set(_cpuinfo("flags").split()), isa_limit()
    if limit:
        flags = {f for f in flags if not f.startswith(("avx512", "amx"))}
    if limit == "default":
        flags -= {"avx2", "fma"}
    return flags


def bf16_arithmetic() -> bool:
    """Whether this CPU multiplies bf16 in hardware (AVX512-BF16 or AMX); elsewhere torch emulates
    it, several times slower than float32."""
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())


def describe() -> str:
    """e.g. ``AMD EPYC 7B13 (avx2), 2 threads, no GPU, torch 2.13.0+cpu``."""
    isa = " ".join(f for f in ISA if f in cpu_flags()) or "no AVX2"
    if isa_limit():
        onednn = os.environ.get("ONEDNN_MAX_CPU_ISA", "unset")
        isa += f"; ATEN_CPU_CAPABILITY={isa_limit()}, ONEDNN_MAX_CPU_ISA={onednn}"
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    return f"{cpu_name()} ({isa}), {torch.get_num_threads()} threads, {gpu}, torch {torch.__version__}"


def key(device: torch.device) -> str:
    """What a timing or a compiled kernel depends on: torch, the CPU (model and every flag) or GPU."""
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
    return repr([torch.__version__, platform.machine(), cpu_name(), sorted(cpu_flags()), gpu])
