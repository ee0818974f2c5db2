"""Fixed-shape decode steps: one graph per engine for steps of up to ``step_rows`` tokens, so that
a verify step computes each token exactly as a one-token step does (lossless speculation) and a
small model's step costs its arithmetic, not one Python launch per operation.

- ``compiled`` / ``run_compiled``: the step, lm_head included, compiled by AOTInductor with the
  weights frozen in as constants (the span and the cache length are dynamic, so one graph serves
  every step); kept on disk per machine and weights: the first process compiles (about a minute
  for SmolLM2), later ones load it in about a second. On the CPU ``auto`` then keeps bf16 kernels
  wherever exact.
- ``GraphStep``: the step recorded once as a CUDA graph and replayed, so a small model's step
  costs the GPU's time, not one Python launch per operation. A graph needs fixed shapes, so these
  steps attend over every cache slot with a mask of the filled ones (the dynamic path attends
  over the filled part only).

Both pad a step to ``step_rows`` rows (copies of the last token, written to cache slots past the
real ones, which no real row attends to and a later step overwrites), so one-token and verify
steps run the same kernels on the same shapes.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import sys
import time
from pathlib import Path

import torch

from .. import machine
from ..models import cache_dir
from . import attention, kernels, native
from . import cache as kv_cache
from .loop import DecodeError

SPAN_ALIGN = 64  # a compiled step attends over a multiple of this many cache slots (see ``run_compiled``)


class _Step(torch.nn.Module):
    """An engine's compiled step as a module: its weights (linears, norms, embedding) are buffers,
    which inductor's ``freezing`` folds in as constants, prepacks, and runs through its own GEMM
    templates with everything between the matmuls fused into a few loops, so a token costs its
    matmuls, not ~40 ops a layer. The KV cache and the rotary tables are inputs (updated in place),
    so the eager prompt and the compiled steps share one cache, and growing it needs no new graph."""

    def __init__(self, engine):
        super().__init__()
        self.engine = engine  # a plain attribute: not a module, its tensors are found by identity
        for i, t in enumerate(_step_tensors(engine)):
            # not "constant{i}": AOTInductor names its packed weights so, and a buffer of that name
            # replaced a packed weight in the package, which then computed wrong products
            self.register_buffer(f"engine_tensor{i}", t)

    def forward(self, ids, positions, slots, k_cache, v_cache, rotary):
        """``slots``: a tensor whose length is the span (a shape, so the span stays symbolic);
        ``rotary``: (cos, sin) tables in the order of ``sorted(engine.cache.rotary)``."""
        tables = dict(zip(sorted(self.engine.cache.rotary), rotary))
        x = self.engine.body(ids, positions, slots.shape[0], static=True, cache=(k_cache, v_cache, tables))
        features = self.engine.final_norm(x)
        return self.engine.head_logits(features), features


# Freezing folds the weights in as constants, which lets inductor prepack them and run its own
# AMX/AVX-512 GEMM templates (chosen by timing: max-autotune). AOTInductor writes the result as one
# package (a shared library and its constants), which later processes load in about a second.
INDUCTOR_OPTIONS = {"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN"}


def _step_tensors(engine) -> list[torch.Tensor]:
    """Every tensor a compiled step reads besides its inputs: the weights it freezes in."""
    layers = engine.layers
    matmuls = [m for layer in layers for m in (layer.qkv, layer.o, layer.gate_up, layer.down)] + [engine.lm_head]
    norms = [
        n
        for layer in layers
        for n in (
            layer.attn_norm,
            layer.mlp_norm,
            layer.post_attn_norm,
            layer.post_mlp_norm,
            layer.q_norm,
            layer.k_norm,
        )
    ]
    return (
        [t for m in matmuls for t in m.tensors()]
        + [engine.embed, engine.final_norm.weight]
        + [n.weight for n in norms if n is not None]
    )


def _fingerprint(engine) -> str:
    """What a compiled package depends on: torch, this machine's CPU, the engine's settings and
    code, and every byte of its weights (a stale package would decode wrong tokens silently)."""
    digest = hashlib.blake2b(digest_size=16)
    settings = [
        machine.key(engine.device),
        str(engine.device),
        str(engine.dtype),
        str(engine.cache_dtype),
        engine.step_rows,
        sorted(engine.formats.items()),
        engine.native_attention,
        INDUCTOR_OPTIONS,
        engine.config.to_json_string(),
    ]
    digest.update(repr(settings).encode())
    graph_code = (sys.modules[type(engine).__module__], sys.modules[__name__], attention, kv_cache, kernels)
    for module in graph_code:  # a changed line of any of them makes a new package
        digest.update(Path(module.__file__).read_bytes())
    digest.update(native.SOURCE.read_bytes())  # the kernels it calls
    for t in _step_tensors(engine):
        digest.update(repr((t.dtype, tuple(t.shape))).encode())
        digest.update(t.detach().contiguous().cpu().view(-1).view(torch.uint8).numpy())
    return digest.hexdigest()


def _cache_limit() -> float:
    """Bytes the packages may take: ``$COMPRESS_ENGINE_CACHE_GB`` (default 10) gigabytes."""
    value = os.environ.get("COMPRESS_ENGINE_CACHE_GB", "10")
    try:
        return float(value) * 1e9
    except ValueError:
        raise DecodeError(f"COMPRESS_ENGINE_CACHE_GB={value!r}: give a number of gigabytes, e.g. 10") from None


def _evict(kept: Path, limit: float) -> None:
    """Remove the least recently used packages beside ``kept`` until the folder holds at most
    ``limit`` bytes, ``kept`` always included. Every change of weights, settings or compress makes
    a new package (about 1.4x the model's bf16 size), so without this the
    folder only grows. Only ``<32 hex digits>.pt2`` files: the ones we write."""
    packages = []
    for package in kept.parent.glob("*.pt2"):
        if package != kept and re.fullmatch(r"[0-9a-f]{32}", package.stem):
            with contextlib.suppress(OSError):  # another process may remove it first
                status = package.stat()
                packages.append((status.st_mtime, status.st_size, package))
    total = kept.stat().st_size + sum(size for _, size, _ in packages)
    for _, size, package in sorted(packages):  # oldest use first
        if total <= limit:
            break
        with contextlib.suppress(OSError):
            package.unlink()
        total -= size


def _examples(engine):
    """Example inputs of the compiled step and which of their sizes are dynamic: the span, the cache
    length and (where rows are computed alone) the rows."""
    rows, length = engine.step_rows, 3 * SPAN_ALIGN  # examples: the span and cache length differ
    cache = [
        torch.zeros(1, engine.kv_heads, length, engine.head_dim, dtype=engine.cache_dtype, device=engine.device)
        for _ in engine.layers
    ]
    tables = [
        tuple(torch.zeros(length, engine.head_dim, dtype=engine.dtype, device=engine.device) for _ in range(2))
        for _ in engine.cache.rotary
    ]
    example = (
        torch.zeros(rows, dtype=torch.long, device=engine.device),
        torch.arange(rows, device=engine.device),
        torch.empty(SPAN_ALIGN, dtype=torch.int8),
        cache,
        [c.clone() for c in cache],
        tables,
    )
    span, slots = torch.export.Dim("span", min=2), torch.export.Dim("slots", min=2)
    count = {0: torch.export.Dim("rows", min=1, max=engine.step_rows)} if engine.rows_alone else None
    dynamic = (
        count,
        count,
        {0: span},
        [{2: slots}] * len(cache),
        [{2: slots}] * len(cache),
        [({0: slots}, {0: slots})] * len(tables),
    )
    return example, dynamic


def compiled(engine):
    """The compiled step (``step_rows`` tokens): ids, positions, span -> logits, final-normed states.

    Loaded from ``cache_dir()/engine/<fingerprint>.pt2`` when an earlier process built it; else
    exported, compiled with AOTInductor and written there (atomically) on the first call."""
    path = cache_dir() / "engine" / f"{_fingerprint(engine)}.pt2"
    runner, limit = None, _cache_limit()

    def load_or_build():
        if path.exists():
            try:
                step.built = False
                with contextlib.suppress(OSError):
                    os.utime(path)  # used now: the last package ``_evict`` removes
                return torch._inductor.aoti_load_package(str(path))
            except Exception as e:  # noqa: BLE001 - a damaged package (a killed writer cannot leave one): rebuild
                print(
                    f"[decode engine: could not load {path.name} ({type(e).__name__}); compiling again]",
                    file=sys.stderr,
                )
        example, dynamic = _examples(engine)
        step.built = True
        with torch.no_grad():
            program = torch.export.export(_Step(engine), example, dynamic_shapes=dynamic, strict=False)
        path.parent.mkdir(parents=True, exist_ok=True)
        for stale in path.parent.glob("*.partial.pt2"):  # ours, left by a writer killed a day ago or more
            with contextlib.suppress(OSError):  # (another process may remove it first)
                if time.time() - stale.stat().st_mtime > 86400:
                    stale.unlink()
        partial = path.with_name(f"{path.stem}.{os.getpid()}.partial.pt2")  # the packager wants .pt2
        try:
            torch._inductor.aoti_compile_and_package(
                program, package_path=str(partial), inductor_configs=dict(INDUCTOR_OPTIONS)
            )  # it adds keys
            os.replace(partial, path)
        finally:
            partial.unlink(missing_ok=True)
        _evict(path, limit)
        return torch._inductor.aoti_load_package(str(path))

    def step(ids: torch.Tensor, positions: torch.Tensor, span: int) -> tuple[torch.Tensor, torch.Tensor]:
        nonlocal runner
        if runner is None:
            runner = load_or_build()
        cache = engine.cache
        rotary = [cache.rotary[kind] for kind in sorted(cache.rotary)]
        slots = torch.empty(span, dtype=torch.int8)
        loader = getattr(runner, "loader", None)
        if loader is None:
            return runner(ids, positions, slots, cache.k, cache.v, rotary)
        # the inputs flattened as the package's call spec orders them (``_Step.forward``), handed to the
        # loader itself: the packaged model's ``__call__`` parses its call spec from JSON and walks
        # the ~65 inputs with pytree on every call, a visible share of a W4 step
        tables = [t for pair in rotary for t in pair]
        logits, features = loader.boxed_run([ids, positions, slots, *cache.k, *cache.v, *tables])
        return logits, features

    step.path, step.built = path, None  # built: compiled in this process (False: loaded; None: not yet run)
    return step


def run_compiled(engine, ids: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits and final-normed states of a step of up to ``step_rows`` tokens through the engine's
    compiled graph.

    Lossless speculation needs a token's logits in a verify step to equal, bit for bit, its
    logits in a one-token step, so both run the same code: the tokens are padded to
    ``step_rows`` rows (not where every row is computed alone, ``rows_alone``: there the graph
    takes 1 to ``step_rows`` rows), and attention spans a multiple of ``SPAN_ALIGN`` slots (the
    compiled softmax sums a span's last partial block of 16 in another order; the masked slots
    past a token add exact zeros). Eager, for good, when the graph fails."""
    count = ids.numel()
    rows = count if engine.rows_alone else engine.step_rows  # (rows computed alone: no padding needed)
    span = -(-(start + rows) // SPAN_ALIGN) * SPAN_ALIGN
    engine.cache.grow(span, SPAN_ALIGN)
    padded = ids if rows == count else torch.cat([ids, ids[-1:].expand(rows - count)])
    positions = torch.arange(start, start + rows, device=engine.device)
    first, clock = not engine.compile_seconds, time.perf_counter()
    try:
        logits, features = engine.compiled(padded, positions, span)
    except Exception as e:  # noqa: BLE001 - no C++ compiler, an op inductor cannot lower: run eager
        why = (str(e).splitlines() or [""])[0][:120]
        engine.compiled, engine.note = None, f"compiling failed ({type(e).__name__}: {why}); running eager"
        print(f"[decode engine: {engine.note}]", file=sys.stderr)
        features = engine.final_norm(engine.body(ids, positions[:count], start + count))
        return engine.head_logits(features), features
    if first:
        engine.compile_seconds = time.perf_counter() - clock
    return logits[:count], features[:count]


def static_logits(engine, ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits and final-normed states of a step with fixed shapes (what a graph records): attention
    spans every cache slot, masked, no value read back to the host."""
    features = engine.final_norm(engine.body(ids, positions, engine.cache.max_len, static=True))
    return engine.head_logits(features, whole=True), features


class GraphStep:
    """A step of up to ``step_rows`` tokens through one CUDA graph, captured on the first step.

    Per-count graphs over unpadded rows did not reproduce greedy: cuBLAS picks its kernel by the row
    count, and on an H100 in bf16 a verify step rounded differently from one-token steps
    (docs/results.md). The first step runs for real (warming up on a side stream, as capture
    requires: lazy library handles), then is recorded; recording runs nothing, so the cache holds
    that step's keys and values once. A graph reads the cache it was captured over: when the cache
    grows, the graphs are captured again. ``pool``: the memory pool every graph of the engine
    (and of its layer-subset drafts) shares."""

    def __init__(self, engine, pool=None):
        self.engine, self.pool = engine, pool if pool is not None else torch.cuda.graph_pool_handle()
        self.captured, self.over = {}, None  # rows -> (graph, ids, positions, (logits, states)); the cache they read

    def __call__(self, ids: torch.Tensor, start: int) -> torch.Tensor:
        engine, count, rows = self.engine, ids.numel(), self.engine.step_rows
        engine.cache.grow(start + rows)
        if self.over is not engine.cache.k:
            self.captured, self.over = {}, engine.cache.k
        ids = torch.cat([ids, ids[-1:].expand(rows - count)])
        positions = torch.arange(start, start + rows, device=engine.device)
        if rows not in self.captured:
            static_ids, static_positions = ids.clone(), positions.clone()
            side = torch.cuda.Stream(engine.device)
            side.wait_stream(torch.cuda.current_stream(engine.device))
            with torch.cuda.stream(side):
                logits, features = static_logits(engine, static_ids, static_positions)
            torch.cuda.current_stream(engine.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                out = static_logits(engine, static_ids, static_positions)
            self.captured[rows] = (graph, static_ids, static_positions, out)
            return logits[:count], features[:count]
        graph, static_ids, static_positions, (logits, features) = self.captured[rows]
        static_ids.copy_(ids)
        static_positions.copy_(positions)
        graph.replay()
        # graphs share one memory pool: the next replay may overwrite the outputs
        return logits[:count].clone(), features[:count].clone()
