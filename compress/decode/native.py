"""Our own decode kernels for AVX2 CPUs (``native_avx2.cpp``): a bf16 and a W4 one-row product
(and a W4A8 one, over rows rounded to int8), one for integers of up to 8 bits in groups (what
every GGUF block type unpacks to), one-row attention, and an lm_head whose largest
logit is the bf16 weight's at an int8 weight's reads (``int8_argmax_logits``), built with the
machine's C++ compiler on first use and kept on disk.

Why: on a CPU without AVX-512 (AMD Zen 1-3) torch has no fast product for bf16 or int4 weights.
oneDNN refuses bf16 weights there, aten's bf16 GEMV and inductor's generated GEMV stream far
below the memory's rate, torch's int4 kernel is compute-bound, and SDPA's one-row call is mostly
overhead (the measurements: docs/decoder.md, "Our own kernels for AVX2 CPUs"). These kernels
convert bf16 with one shift or mask per 8 weights and int4 with a shift, a mask and a conversion,
accumulate in fp32, and parallelise over output rows.

They are built like inductor's own code (same compiler, same torch headers), so wherever the
compiled engine can be built these can too; where they cannot (no compiler, no AVX2/FMA, or
``COMPRESS_NATIVE=0``), ``available()`` is False and the engine keeps torch's kernels.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch

from .. import machine
from ..models import cache_dir

SOURCE = Path(__file__).with_name("native_avx2.cpp")
INT4_FORMATS = ("int4-avx2", "int4-a16", "int4-a8")  # the W4 weight formats (``kernels``) these kernels compute
FORMATS = ("bf16-avx2", *INT4_FORMATS, "int8g-avx2")


def _compiler() -> str | None:
    return next((c for c in (os.environ.get("CXX"), "c++", "g++", "clang++") if c and shutil.which(c)), None)


def _build(target: Path, compiler: str) -> None:
    """Compile the source into ``target`` (written under another name, then renamed: atomic)."""
    root = Path(torch.__file__).parent
    partial = target.with_name(f"{target.stem}.{os.getpid()}.partial.so")
    command = [
        compiler,
        "-O3",
        "-march=native",
        "-mavx2",
        "-mfma",
        *([] if "avx512f" in machine.cpu_flags() else ["-mno-avx512f"]),  # ATEN_CPU_CAPABILITY=avx2 honoured
        "-fopenmp",
        "-shared",
        "-fPIC",
        "-std=c++17",
        "-w",
        f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
        f"-I{root / 'include'}",
        f"-I{root / 'include' / 'torch' / 'csrc' / 'api' / 'include'}",
        str(SOURCE),
        f"-L{root / 'lib'}",
        "-ltorch",
        "-ltorch_cpu",
        "-lc10",
        f"-Wl,-rpath,{root / 'lib'}",
        "-o",
        str(partial),
    ]
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        subprocess.run(command, check=True, capture_output=True, text=True)
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)


@functools.cache
def available() -> bool:
    """Whether the kernels are loaded in this process (building them on the first call, ~30 s)."""
    if os.environ.get("COMPRESS_NATIVE", "1") == "0" or not {"avx2", "fma"} <= machine.cpu_flags():
        return False
    compiler = _compiler()
    if compiler is None:
        return False

    digest = hashlib.blake2b(SOURCE.read_bytes() + machine.key(torch.device("cpu")).encode(), digest_size=8)
    target = cache_dir() / "native" / f"compress_native_{digest.hexdigest()}.so"
    try:
        if not target.exists():
            print("[decode: building the AVX2 kernels once for this machine (about 30 s)]", file=sys.stderr)
            _build(target, compiler)
        torch.ops.load_library(str(target))
    except (OSError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", None) or str(e)
        print(
            f"[decode: the AVX2 kernels did not build ({detail.strip().splitlines()[-1][:160]}); "
            "using torch's kernels]",
            file=sys.stderr,
        )
        return False
    _register_shapes()
    return True


def _register_shapes() -> None:
    """Output shapes for tracing (torch.export, AOTInductor): the C++ ops compute on real tensors only."""

    @torch.library.register_fake("compress::bf16_matmul")
    def _(x, w):
        return x.new_empty(x.shape[0], w.shape[0])

    @torch.library.register_fake("compress::int4_matmul")
    def _(x, packed, scale, offset, group):
        return x.new_empty(x.shape[0], packed.shape[0])

    for op in ("int4_matmul_a8", "int4_matmul_a16"):

        @torch.library.register_fake(f"compress::{op}")
        def _(x, packed, scale, offset, group):
            return x.new_empty(x.shape[0], packed.shape[0])

    @torch.library.register_fake("compress::int8_matmul")
    def _(x, codes, scale, offset, group):
        return x.new_empty(x.shape[0], codes.shape[0])

    @torch.library.register_fake("compress::int8_argmax_logits")
    def _(x, codes, scale, error, weight):
        return x.new_empty(x.shape[0], codes.shape[0])

    @torch.library.register_fake("compress::int4_dequantize")
    def _(packed, scale, offset, group, bf16=False):
        return scale.new_empty(packed.shape[0], packed.shape[1] * 8, dtype=torch.bfloat16 if bf16 else scale.dtype)

    @torch.library.register_fake("compress::decode_attention")
    def _(q, k, v, positions, window, scaling):
        return torch.empty_like(q, memory_format=torch.contiguous_format)


def pack_int4(u: torch.Tensor) -> torch.Tensor:
    """``int4_matmul``'s layout of codes ``u`` [out, in] (0..15, ``in`` a multiple of 64): per block
    of 64, weight ``8·j + l`` in nibble ``j`` of int32 lane ``l``."""
    out, width = u.shape
    blocks = u.to(torch.int64).reshape(out, width // 64, 8, 8)  # [out, block, nibble j, lane l]
    words = sum(blocks[:, :, j, :] << (4 * j) for j in range(8))
    return words.to(torch.uint32).view(torch.int32).reshape(out, width // 8).contiguous()
