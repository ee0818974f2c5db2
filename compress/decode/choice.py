"""Which weight format each linear group of the engine runs in, chosen on this machine.

A group is offered only the formats that hold its weights exactly (``exact_formats``), unless a
lossy one is asked for (a W4 draft, a quantized lm_head); ``auto`` times each offered format on
one row and keeps the fastest. Which wins depends on the CPU (the int4 kernel is the fastest per
weight on AVX-512 parts and 20x slower than fp32 on the AVX2-only Zen 1 machines this project ran
on before), so timings are kept on disk per machine.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import torch

from .. import machine
from ..models import cache_dir
from ..quant import quantized_of
from . import native, onednn
from .kernels import (
    ARGMAX,
    FLOAT_FORMATS,
    INT4_GROUPS,
    KERNELS,
    Matmul,
    build,
    fp8_operands,
    integer_grid,
    w8a8_integers,
)
from .loop import sync, write_json


def int4_kernel_available(device: torch.device = torch.device("cpu")) -> bool:
    """Whether torch has the int4 kernel for ``device``: the CPU one, or tinygemm on an Ampere or
    newer GPU (bf16 tensor cores)."""
    if device.type == "cuda":
        return hasattr(torch.ops.aten, "_weight_int4pack_mm") and torch.cuda.get_device_capability(device)[0] >= 8
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")


def fp8_kernel_fits(linears: list, device: torch.device) -> bool:
    """Whether ``kernels.FP8`` runs this group: FP8 weights and inputs on every linear, one static
    input scale (or none) for the input they share, and on a GPU FP8 tensor cores with row-wise
    scales (Hopper or newer) and widths of whole 16s."""
    operands = [fp8_operands(lin) for lin in linears]
    if any(o is None for o in operands):
        return False
    statics = [o[2] for o in operands]
    if any(s is None for s in statics) != all(s is None for s in statics):
        return False
    if statics[0] is not None and not all(torch.equal(s, statics[0]) for s in statics):
        return False
    if device.type == "cuda":
        widths = (linears[0].in_features, sum(lin.out_features for lin in linears))
        return fp8_tensor_cores(device) and all(w % 16 == 0 for w in widths)
    return device.type == "cpu"


def fp8_tensor_cores(device: torch.device) -> bool:
    """Whether ``device`` is a GPU whose FP8 products take a scale per row (Hopper or newer)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0)


def exact_formats(linears: list, device: torch.device) -> list[str]:
    """The formats that hold every linear of the group exactly, on ``device``."""
    if all(w8a8_integers(lin) is not None for lin in linears) and (
        device.type == "cpu" or linears[0].in_features % 8 == sum(lin.out_features for lin in linears) % 8 == 0
    ):
        return ["w8a8"]  # its activations are int8 by design: the float formats would not be W8A8
    if device.type == "cuda" and fp8_kernel_fits(linears, device):
        return ["fp8"]  # as the server computes it, on the tensor cores FP8 exports are for
    if device.type != "cpu":
        return ["dense"] + (["int4"] if _int4_fits(linears, device) else [])
    found = ["fp32"] + (["fp32-onednn"] if onednn.onednn_available() else [])
    found += ["fp8"] if fp8_kernel_fits(linears, device) else []
    weights = [lin.weight.detach() for lin in linears]
    if all(torch.equal(w.to(torch.bfloat16).to(w.dtype), w) for w in weights):
        found.append("bf16")
    schemes = [quantized_of(lin) and quantized_of(lin).scheme for lin in linears]
    if all(s is not None and s.format == "int" and s.bits == 8 and s.symmetric and s.group_size == -1 for s in schemes):
        found.append("int8")
    if _int4_fits(linears, device):
        found.append("int4")
    if native.available():
        found += ["bf16-avx2"] if "bf16" in found and linears[0].in_features % 16 == 0 else []
        found += ["int4-avx2"] if _native_int4_fits(linears) else []
        found += ["int4-a16", "int4-a8"] if _native_int4_fits(linears, a8=True) else []
        found += ["int8g-avx2"] if _native_int8_groups_fit(linears) else []
    return found


def argmax_fits(linears: list, device: torch.device) -> bool:
    """Whether ``Int8Argmax`` can stand in for this layer (one linear, no bias, bf16 weights, a
    width of whole blocks, our kernels built)."""
    (lin,) = linears
    w = lin.weight.detach()
    return (
        device.type == "cpu"
        and lin.bias is None
        and lin.in_features % 64 == 0
        and torch.equal(w.to(torch.bfloat16).to(w.dtype), w)
        and native.available()
    )


def _native_int4_fits(linears: list, a8: bool = False) -> bool:
    qws = [quantized_of(lin) for lin in linears]
    return (
        all(integer_grid(qw, 4) and qw.scheme.bits == 4 for qw in qws)
        and len({qw.scale.shape[1] for qw in qws}) == 1
        and linears[0].in_features % 64 == 0
        and linears[0].in_features // qws[0].scale.shape[1] in (INT4_GROUPS[1:] if a8 else INT4_GROUPS)
    )


def _native_int8_groups_fit(linears: list) -> bool:
    """Integers of at most 8 bits on every linear, one group count, groups of 16k weights."""
    qws = [quantized_of(lin) for lin in linears]
    if not all(integer_grid(qw, 8) for qw in qws) or len({qw.scale.shape[1] for qw in qws}) != 1:
        return False
    group = linears[0].in_features // qws[0].scale.shape[1]
    return group % 16 == 0 and group * qws[0].scale.shape[1] == linears[0].in_features


def _int4_fits(linears: list, device: torch.device) -> bool:
    """W4 integers recorded on every linear, one group size the kernel takes, shapes it tiles."""
    qws = [quantized_of(lin) for lin in linears]
    return (
        int4_kernel_available(device)
        and all(qw is not None and qw.scheme.format == "int" and qw.scheme.bits == 4 for qw in qws)
        and len({qw.scale.shape[1] for qw in qws}) == 1
        and linears[0].in_features // qws[0].scale.shape[1] in INT4_GROUPS
        and sum(lin.out_features for lin in linears) % 16 == 0
        and (device.type == "cpu" or linears[0].in_features % 32 == 0)
    )


def _time_one_row(
    matmuls: list[Matmul], width: int, dtype: torch.dtype, device: torch.device, repeats: int = 7
) -> float:
    """Fastest of ``repeats`` ms to push one row through every matmul in turn (the weights stream
    as in decoding); the minimum, since other work on the machine can only add time."""
    x = torch.randn(1, width, dtype=dtype, device=device)
    for m in matmuls:
        m(x)  # warm-up: first calls allocate
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        for m in matmuls:
            m(x)
        sync(device)
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


# Timings of a group shape on a device, kept on disk per machine (``_timings_file``): formats
# within timing noise of each other would otherwise be chosen differently by two runs, or two
# engines, over the same model (and compute differently: bf16 and fp32 round differently), and
# then their tokens would differ at near-ties.
_TIMED: dict[str, dict[str, float]] = {}


def _timings_file(device: torch.device) -> Path:
    # our own kernels' source too: a changed kernel is timed again
    digest = hashlib.blake2b(machine.key(device).encode() + native.SOURCE.read_bytes(), digest_size=8).hexdigest()
    return cache_dir() / "kernels" / f"timings-{digest}.json"


def _timed(key: str, device: torch.device) -> dict[str, float] | None:
    """The timings of ``key`` measured earlier on this machine (this process, or one before)."""
    if key not in _TIMED:
        path = _timings_file(device)
        try:
            _TIMED.update({k: v for k, v in json.loads(path.read_text()).items() if k not in _TIMED})
        except (OSError, ValueError):
            pass  # none yet, or unreadable: time again
    return _TIMED.get(key)


def _keep_timed(key: str, measured: dict[str, float], device: torch.device) -> None:
    _TIMED[key] = measured
    path = _timings_file(device)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        saved = json.loads(path.read_text()) if path.exists() else {}
        write_json(path, saved | {key: measured}, indent=1)
    except (OSError, ValueError):
        pass  # a read-only or damaged cache: this process still keeps the timings


def choose(
    groups: dict[str, list[list]],
    kernel: str,
    device: torch.device,
    lossy: dict[str, str] | None = None,
    compiled: bool = False,
) -> tuple[dict[str, str], dict[str, dict[str, float]]]:
    """The format of each linear group (name -> per-layer lists of linears), and what each
    timed candidate took for one token (ms over all layers).

    ``auto`` times every exact format (once per group shape in a process) and keeps the fastest;
    ``dense`` keeps plain matmuls;
    a format name is used where it is exact, elsewhere bf16 (for a format that takes bf16
    rows, so the stream stays bf16) or fp32. ``lossy`` names a
    format per group to use whatever the weights are (``argmax``: ``Int8Argmax`` where it runs,
    else the exact formats, whose largest logit is the same). ``compiled`` (a CPU engine under
    AOTInductor): the float formats all become the compiler's own GEMM, so ``auto``
    offers only bf16 among them where it is exact (half the bytes of fp32; what eager
    timings say of oneDNN and MKL does not carry over), and once one group takes our bf16 kernel
    every group it holds does (a compiled step takes only its tokens' rows when all of its
    kernels compute each row alone).
    """
    formats, timings, offered = {}, {}, {}
    for name, layers in groups.items():
        if lossy and lossy.get(name) == "argmax" and argmax_fits(layers[0], device):
            formats[name] = ARGMAX
            continue
        # a lossy int4 on a CPU: the int4 kernel asked for, or the fastest (argmax where it cannot run:
        # the exact formats, whose largest logit is the same)
        if lossy and name in lossy and lossy[name] != "argmax":
            native_fits = device.type == "cpu" and layers[0][0].in_features % 64 == 0 and native.available()
            exact = [lossy[name]]
            if lossy[name] == "int4" and native_fits and (kernel == "auto" or kernel in native.INT4_FORMATS):
                exact = [kernel] if kernel != "auto" else ["int4", "int4-avx2", "int4-a16"]
            if len(exact) == 1:
                formats[name] = exact[0]
                continue
        else:
            exact = [
                f
                for f in exact_formats(layers[0], device)
                if all(f in exact_formats(lins, device) for lins in layers[1:])
            ] or ["fp32"]
        if kernel == "auto":
            exact = [f for f in exact if KERNELS[f].offered_to_auto(device)] or ["fp32"]  # the rest: asked for only
        if compiled and kernel == "auto" and "bf16" in exact:
            exact = [f for f in exact if f == "bf16" or f not in FLOAT_FORMATS]
        if kernel == "auto" and len(exact) == 1:
            formats[name] = exact[0]
        elif kernel == "auto":
            key = repr(
                (str(device), name, len(layers), [(lin.out_features, lin.in_features) for lin in layers[0]], exact)
            )
            measured = _timed(key, device)
            if measured is None:
                width, measured = layers[0][0].in_features, {}
                for fmt in exact:
                    built = [build(fmt, lins, device) for lins in layers]
                    measured[fmt] = _time_one_row(built, width, torch.float32, device)
                    del built
                _keep_timed(key, measured, device)
            timings[name] = measured
            formats[name] = min(timings[name], key=timings[name].get)
        elif kernel in exact or exact in (["w8a8"], ["fp8"]):  # W8A8 has one format, FP8 one on a GPU
            formats[name] = kernel if kernel in exact else exact[0]
        elif "dense" in exact:  # an accelerator: its own dtype
            formats[name] = "dense"
        elif kernel in native.FORMATS and "bf16-avx2" in exact:  # our W4 kernel asked: our bf16 one elsewhere
            formats[name] = "bf16-avx2"
        else:  # dense, or a format that does not hold these weights: bf16 for a bf16 format, else fp32
            bf16_rows = kernel in KERNELS and KERNELS[kernel].dtype == torch.bfloat16
            formats[name] = "bf16" if bf16_rows and "bf16" in exact else "fp32"
        offered[name] = exact
    return (_ours_throughout(formats, offered) if compiled else formats), timings


def _ours_throughout(formats: dict[str, str], offered: dict[str, list[str]]) -> dict[str, str]:
    """``formats`` with our bf16 kernel in every group it holds once one group has it: one compiled
    group on the compiler's bf16 GEMM among ours would pad every step to its rows
    (``Engine.rows_alone`` is all or nothing) and so leave verify steps one row, and the
    speculative methods would decode as plain greedy."""
    if "bf16-avx2" not in formats.values():
        return formats
    ours = {n for n, f in formats.items() if f == "bf16" and "bf16-avx2" in offered.get(n, ())}
    return {n: "bf16-avx2" if n in ours else f for n, f in formats.items()}
