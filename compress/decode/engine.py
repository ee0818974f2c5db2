"""The decode engine: our own forward over a loaded model's weights, with a preallocated KV cache.

Why our own forward rather than transformers' with a static cache: most of a decoded token's
time in transformers' eager modeling code is overhead (mask construction, cache bookkeeping,
many small modules and ops), not the arithmetic or the weight reads (docs/design.md, "The
decode engine"). The forward below does per layer what the paper-level model
needs and nothing else: one fused q/k/v matmul, RMSNorm, rotary from a precomputed table, a
write into the preallocated cache, SDPA over the filled part, one fused gate/up matmul. It
reads the weights from the loaded transformers model, so everything ``models.load`` reads
(aliases, folders, our exports) decodes here, and it is checked token for token against
transformers' greedy (``tests/test_engine.py``).

Each linear group (q/k/v, o, gate/up, down, lm_head) runs on a kernel from ``kernels``: the
formats that represent its weights exactly (fp32 and bf16 for bf16 checkpoints; int4 for W4
exports; int8 for per-channel W8; ``_int_mm`` for W8A8), the fastest measured on this machine
(``kernel="auto"``), or one named.

Supported: Llama, Mistral, Qwen2, Qwen3 and Gemma-3 text blocks (q/k norms, sandwich norms,
``1 + w`` norms, scaled embeddings, sliding-window layers, logit soft-capping).
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import math
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from .. import USER_INDUCTOR_CACHE, kv_quant, machine
from ..models import cache_dir
from . import kernels, native
from .loop import DecodeError, device_of

SUPPORTED = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text")
STEP_ROWS = 8  # tokens a compiled float step computes: one-token and verify steps alike (``_run_compiled``)
SPAN_ALIGN = 64  # a compiled step attends over a multiple of this many cache slots (see ``_run_compiled``)
ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


@dataclass
class Norm:
    """RMSNorm: Llama-style ``w · norm(x)`` (cast first), or Gemma-style ``(1 + w) · norm(x)`` in fp32."""

    weight: torch.Tensor
    eps: float
    plus_one: bool

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * self.weight).to(x.dtype) if self.plus_one else self.weight * h.to(x.dtype)


def _norm(module, dtype: torch.dtype, plus_one: bool) -> Norm | None:
    if module is None:
        return None
    eps = getattr(module, "variance_epsilon", None) or module.eps
    w = module.weight.detach()
    return Norm(1.0 + w.float() if plus_one else w.to(dtype), eps, plus_one)


@dataclass
class Layer:
    qkv: kernels.Matmul
    o: kernels.Matmul
    gate_up: kernels.Matmul
    down: kernels.Matmul
    attn_norm: Norm
    mlp_norm: Norm
    post_attn_norm: Norm | None  # Gemma-3's sandwich norms
    post_mlp_norm: Norm | None
    q_norm: Norm | None  # Qwen3, Gemma-3
    k_norm: Norm | None
    window: int | None  # sliding-window attention: keys within this many positions
    rotary: str  # which rotary table


def _linears(layer) -> dict[str, list]:
    a, m = layer.self_attn, layer.mlp
    return {
        "qkv": [a.q_proj, a.k_proj, a.v_proj],
        "o": [a.o_proj],
        "gate_up": [m.gate_proj, m.up_proj],
        "down": [m.down_proj],
    }


class Engine:
    """A runner (``forward``/``crop``/``reset``, see ``loop``) over ``model``'s weights.

    ``kernel``: ``auto`` (time the exact formats of each linear group, keep the fastest),
    ``dense`` (fp32 on the CPU, the model's dtype elsewhere), or a format name from
    ``kernels.FORMATS`` applied wherever it is exact. ``quantize="w4"`` rounds the block
    linears to 4 bits in memory first (lossy: a draft for the original). ``lm_head``: a lossy
    format for the output layer (``int8``, ``int4``); ``argmax``, whose largest logit is exact and
    the others int8's (``kernels.Int8Argmax``: greedy's tokens at half the reads); or None: exact.
    ``max_len``: cache slots; the cache grows when a request needs more. ``dtype``: the
    residual stream's; by default bf16 on a CPU when every chosen kernel takes bf16 (then the
    engine computes what transformers computes in bf16), else fp32; the model's on a GPU.
    ``compile``: run steps of up to ``step_rows`` tokens, lm_head included, through one graph
    compiled by AOTInductor with the weights frozen in as constants (``_Step``; the span and the
    cache length are dynamic, so one graph serves every step). The package is kept on disk per
    machine and weights (``_compiled``): the first process compiles (about a minute for
    SmolLM2), later ones load it in about a second. Eager if it fails. One-token and verify steps run the same graph, so
    speculation on it reproduces its greedy exactly. ``step_rows`` (default: 8 on CUDA graphs,
    and on a CPU where every kernel is a float GEMM, whose extra rows ride along with the weight
    reads; 1 over a CPU's integer kernels, whose cost grows with the rows, and then speculation
    on it has no room and is plain greedy).
    Prompts and longer steps run eager. On the CPU ``auto`` then keeps bf16 wherever exact.

    ``graphs`` (default: on a GPU): steps of up to ``step_rows`` tokens (one-token steps and
    speculative verify steps alike) replay one CUDA graph of ``step_rows`` rows (``_replay``), so
    a small model's step costs the GPU's time, not one Python launch per operation, and a verify
    step rounds as one-token steps do. A graph needs fixed shapes, so these steps attend over
    every cache slot with a mask of the filled ones (the dynamic path attends over the filled
    part only). ``compile`` is not combined with graphs yet (said in one line).

    A model carrying a KIVI scheme (the ``kv_cache`` pass) gets KIVI's numerics: once the
    full-precision window holds ``residual`` tokens, they are quantized and replaced in the
    cache by their dequantized values, as ``kv_quant.KIVICache`` does, so attention reads what
    KIVI decoding reads at dense speed. The engine keeps those values dense, not the codes: it
    reproduces KIVI's tokens, not its memory saving. ``kivi=False`` keeps a full-precision
    cache whatever the model carries (a draft, whose rejected tokens must be rolled back).

    ``cache_dtype``: the KV cache's dtype. By default the stream's, except bf16 under kernels that
    round their rows to int8 (they lose more than a bf16 cache does) and fp32 where bf16 arithmetic
    is emulated. ``torch.bfloat16`` under an fp32 stream halves what attention reads (a step at 400
    cached tokens reads 18 MB of fp32 keys and values on SmolLM2), at a rounding of its own: lossy
    against fp32 greedy, as ``scripts/bench_kernel_accuracy.py`` measures.
    """

    def __init__(
        self,
        model,
        kernel: str = "auto",
        max_len: int = 1024,
        quantize: str | None = None,
        lm_head: str | None = None,
        dtype: torch.dtype | None = None,
        compile: bool = False,
        kivi: bool = True,
        graphs: bool | None = None,
        step_rows: int | None = None,
        cache_dtype: torch.dtype | None = None,
    ):
        config = model.config
        if config.model_type not in SUPPORTED:
            raise DecodeError(f"the decode engine supports {', '.join(SUPPORTED)} models, not {config.model_type}")
        act = getattr(config, "hidden_activation", None) or config.hidden_act
        if act not in ACTIVATIONS:
            raise DecodeError(f"the decode engine has no {act!r} activation (known: {', '.join(ACTIVATIONS)})")
        self.device, self.config, self.act = device_of(model), config, ACTIVATIONS[act]
        inner = model.model
        gemma = config.model_type.startswith("gemma")
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.scaling = inner.layers[0].self_attn.scaling
        self.softcap_attn = getattr(config, "attn_logit_softcapping", None)
        self.softcap_logits = getattr(config, "final_logit_softcapping", None)
        self.embed = inner.embed_tokens.weight.detach()
        self.embed_scale = float(getattr(inner.embed_tokens, "scalar_embed_scale", 1.0))
        self.rotary_module = inner.rotary_emb
        if quantize not in (None, "w4"):
            raise DecodeError(f"quantize={quantize!r}: only w4 (round-to-nearest 4-bit, in memory) is offered")

        groups = [_linears(layer) for layer in inner.layers]
        if quantize == "w4":
            groups = [{name: [kernels.rtn_w4(lin) for lin in lins] for name, lins in g.items()} for g in groups]
        head = [model.lm_head]
        self.formats, self.timings = kernels.choose(
            {name: [g[name] for g in groups] for name in groups[0]} | {"lm_head": [head]},
            kernel,
            self.device,
            lossy={"lm_head": lm_head} if lm_head else {},
            compiled=compile and self.device.type == "cpu",
        )
        bf16_kernels = all(kernels.takes_bf16(fmt) for fmt in self.formats.values())
        self.dtype = dtype or (
            model.dtype if self.device.type != "cpu" else torch.bfloat16 if bf16_kernels else torch.float32
        )
        native_attention = (
            self.device.type == "cpu" and self.softcap_attn is None and self.head_dim % 8 == 0 and native.available()
        )
        if cache_dtype is not None:
            if cache_dtype not in (torch.float32, torch.bfloat16):
                raise DecodeError(f"cache_dtype={cache_dtype}: the KV cache is float32 or bfloat16")
            self.cache_dtype = cache_dtype
        elif self.device.type == "cpu" and self.dtype == torch.bfloat16 and not kernels.onednn_bf16_available():
            # attention (and so the cache) in fp32 where bf16 arithmetic is emulated (an AVX2-only CPU):
            # there the compiled step's bf16 SDPA for one row over ~330 slots took 352 us a layer, fp32 156-173
            self.cache_dtype = torch.float32
        elif native_attention and any(map(kernels.rounds_rows, self.formats.values())):
            # kernels that round their input rows to int8 lose more than a bf16 cache does; the cache's
            # reads halve (18 MB a step at 400 cached tokens in fp32 for SmolLM2, about a sixth of a W4A8 step)
            self.cache_dtype = torch.bfloat16
        else:
            self.cache_dtype = self.dtype
        # one-row attention over an fp32 cache, or a bf16 one read by an fp32 stream: ~60 us of SDPA's
        # overhead a layer on an AVX2 CPU (``native``)
        self.native_attention = native_attention and torch.float32 in (self.cache_dtype, self.dtype)
        self.final_norm = _norm(inner.norm, self.dtype, gemma)
        self.lm_head = kernels.build(self.formats["lm_head"], head, self.device, traceable=compile)
        self.layers = []
        for i, (layer, g) in enumerate(zip(inner.layers, groups)):
            a = layer.self_attn
            window = getattr(a, "sliding_window", None)
            if config.model_type == "mistral":
                window = getattr(config, "sliding_window", None)
            self.layers.append(
                Layer(
                    **{
                        name: kernels.build(self.formats[name], lins, self.device, traceable=compile)
                        for name, lins in g.items()
                    },
                    attn_norm=_norm(layer.input_layernorm, self.dtype, gemma),
                    mlp_norm=_norm(
                        layer.pre_feedforward_layernorm if gemma else layer.post_attention_layernorm, self.dtype, gemma
                    ),
                    post_attn_norm=_norm(layer.post_attention_layernorm, self.dtype, gemma) if gemma else None,
                    post_mlp_norm=_norm(layer.post_feedforward_layernorm, self.dtype, gemma) if gemma else None,
                    q_norm=_norm(getattr(a, "q_norm", None), self.dtype, gemma),
                    k_norm=_norm(getattr(a, "k_norm", None), self.dtype, gemma),
                    window=window,
                    rotary=config.layer_types[i] if gemma else "default",
                )
            )
        self.q_size, self.kv_size = self.heads * self.head_dim, self.kv_heads * self.head_dim
        self.context = getattr(config, "max_position_embeddings", None) or 1 << 20
        self.graphs = self.device.type == "cuda" if graphs is None else graphs
        if self.graphs and self.device.type != "cuda":
            raise DecodeError("CUDA graphs need a CUDA device; run without graphs on the CPU")
        self.graph_pool = torch.cuda.graph_pool_handle() if self.graphs else None  # shared by its graphs
        self.max_len, self.length, self.k_cache, self.v_cache = 0, 0, [], []
        # a compiled step attends past its tokens (``_run_compiled``): room for that from the start
        self._allocate(max_len + (2 * SPAN_ALIGN if compile else 0))
        self.kv_scheme, self.quantized_upto = kv_quant.scheme_of(model) if kivi else None, 0
        self.compiled, self.compile_seconds, self.note, self.exited = None, 0.0, "", None
        # a compiled step whose every row is computed alone (our kernels and attention) takes exactly
        # its tokens' rows (``_run_compiled``): no padding, so a one-token step pays for one row
        self.rows_alone = compile and self.native_attention and all(map(kernels.rows_alone, self.formats.values()))
        if step_rows is None:  # extra rows ride along with a float GEMM's weight reads, not with an integer
            # kernel's on a CPU; a GPU's step at a few rows is launch-bound whatever the kernel
            ride_along = self.graphs or self.rows_alone or all(map(kernels.rows_ride_along, self.formats.values()))
            step_rows = STEP_ROWS if ride_along else 1
        if not 1 <= step_rows <= kernels.VERIFY_ROWS:
            raise DecodeError(f"step_rows={step_rows}: give 1 to {kernels.VERIFY_ROWS}")
        self.step_rows = step_rows
        if compile and self.graphs:  # see docs/results.md: both ways failed on an H100
            self.note = "compiling is not combined with CUDA graphs yet; the graphs run uncompiled"
            print(f"[decode engine: {self.note}]", file=sys.stderr)
        elif compile:
            if not USER_INDUCTOR_CACHE:
                os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir() / "inductor")
            self.compiled = _compiled(self)

    @property
    def layer_count(self) -> int:
        return len(self.layers)

    @property
    def step_tokens(self) -> int:
        """The most tokens one step computes exactly as one-token steps do (a verify step's limit)."""
        return self.step_rows if self.compiled is not None or self.graphs else kernels.VERIFY_ROWS

    def _allocate(self, max_len: int) -> None:
        """Cache slots and rotary tables for ``max_len`` positions (kept entries are copied over)."""
        max_len = min(max_len, self.context)
        shape = (1, self.kv_heads, max_len, self.head_dim)
        old = self.k_cache + self.v_cache if self.length else []
        self.k_cache = [torch.zeros(shape, dtype=self.cache_dtype, device=self.device) for _ in self.layers]
        self.v_cache = [torch.zeros(shape, dtype=self.cache_dtype, device=self.device) for _ in self.layers]
        for new, kept in zip(self.k_cache + self.v_cache, old):
            new[:, :, : self.length] = kept[:, :, : self.length]
        self.captured = {}  # token count -> (graph, ids, positions, logits): graphs read the old cache
        positions = torch.arange(max_len, device=self.device)[None]
        probe = torch.zeros((), dtype=self.dtype, device=self.device)
        self.rotary = {}
        for kind in {layer.rotary for layer in self.layers}:
            args = () if kind == "default" else (kind,)
            cos, sin = self.rotary_module(probe, positions, *args)
            self.rotary[kind] = (cos[0].to(self.dtype), sin[0].to(self.dtype))
        self.max_len = max_len

    def reset(self) -> None:
        self.length = self.quantized_upto = 0

    def crop(self, n: int) -> None:
        """Forget the last ``n`` cached tokens (their slots are overwritten by the next forward)."""
        if self.length - n < self.quantized_upto:
            raise DecodeError(f"cannot roll back {n} tokens past the KIVI-quantized part of the cache")
        self.length -= n

    def keep(self, length: int, extra: list[int]) -> None:
        """Keep the first ``length`` cached tokens and the entries at slots ``extra``, moved in order
        to follow them: lookahead keeps its accepted branch this way (``forward_tree`` rotated
        their keys at the positions they keep)."""
        if length < self.quantized_upto:
            raise DecodeError(f"cannot roll back to {length} tokens past the KIVI-quantized part of the cache")
        if extra:
            index = torch.tensor(extra, device=self.device)
            for cache in self.k_cache + self.v_cache:
                cache[:, :, length : length + len(extra)] = cache[:, :, index]  # the gather copies first
        self.length = length + len(extra)

    def _flush_kv(self) -> None:
        """KIVI: quantize the window's oldest whole multiple of ``residual`` tokens (all of it
        without a window) and keep their dequantized values, as ``KIVICache`` does after each step;
        the first ``sinks`` tokens stay as they are."""
        s = self.kv_scheme
        start = max(self.quantized_upto, min(s.sinks, self.length))
        n = s.quantized_upto(self.length) - start
        if n <= 0:
            return
        done = slice(start, start + n)
        for layer, k_cache, v_cache in zip(self.layers, self.k_cache, self.v_cache):
            cos, sin = self.rotary[layer.rotary]
            # in the stream's dtype, as ``KIVICache`` quantizes (the cache may be wider: values stay exact)
            k_cache[:, :, done], v_cache[:, :, done] = kv_quant.round_trip(
                k_cache[:, :, done].to(self.dtype), v_cache[:, :, done].to(self.dtype), s, (cos[done], sin[done])
            )
        self.quantized_upto = start + n

    def subset(self, keep: list[int]) -> Engine:
        """The same weights with only the layers ``keep`` run, and a cache of its own: a draft."""
        keep = sorted(set(keep))
        if not keep or keep[-1] >= len(self.layers) or keep[0] < 0:
            raise DecodeError(f"--layers must stay within 0-{len(self.layers) - 1}")
        view = copy.copy(self)
        view.layers = [self.layers[i] for i in keep]
        view.length, view.k_cache, view.v_cache, view.kv_scheme = 0, [], [], None  # a draft: full precision
        view._allocate(self.max_len)
        if self.compiled is not None:  # a graph of its own: the view runs other layers
            view.compiled, view.compile_seconds = _compiled(view), 0.0
        return view

    def _make_room(self, ids) -> tuple[torch.Tensor, int, int]:
        """(ids as a tensor, cache slot of the first, how many) for tokens about to be appended:
        KIVI's window flushed, the context checked, the cache grown where it is too short."""
        ids = torch.as_tensor(ids, device=self.device).reshape(-1)
        if self.kv_scheme is not None:
            self._flush_kv()  # lazily, so a rolled-back candidate is never quantized
        start, count = self.length, ids.numel()
        if start + count > self.context:
            raise DecodeError(
                f"{start + count} tokens do not fit: the model's context is {self.context} tokens; "
                "shorten the prompt or ask for fewer new tokens"
            )
        if start + count > self.max_len:
            self._allocate(max(2 * self.max_len, start + count))
        return ids, start, count

    @torch.no_grad()
    def forward(self, ids: list[int] | torch.Tensor, all_logits: bool = True, exit_when=None) -> torch.Tensor:
        """Float32 logits of ``ids`` appended to the cache: (len(ids), vocab), or (1, vocab).

        ``exit_when(layer index, state entering the layer, state leaving it) -> bool``: early exit for
        one token (eager). Once it answers yes, the logits come from that state, and every later
        layer only writes its keys and values computed from it (CALM's state propagation), so
        later tokens find a complete cache; ``exited`` then holds the layer (None: no exit)."""
        ids, start, count = self._make_room(ids)
        positions = torch.arange(start, start + count, device=self.device)
        if exit_when is not None:
            if count != 1:
                raise DecodeError("early exit decides per token: give one token")
            logits = self.logits(self._body(ids, positions, start + 1, exit_when=exit_when))
        elif self.graphs and count <= self.step_rows and start + self.step_rows <= self.context:
            logits = self._replay(ids, start)
        elif (
            self.compiled is not None
            and count <= self.step_rows
            and start + self.step_rows + SPAN_ALIGN <= self.context
        ):
            logits = self._run_compiled(ids, start)  # (near the end of the context: eager, below)
        else:
            x = self._body(ids, positions, start + count)
            logits = self.logits(x if all_logits else x[-1:])
        self.length = start + count
        return logits if all_logits else logits[-1:]

    @torch.no_grad()
    def forward_tree(self, ids: list[int], offsets: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """Float32 logits of tokens that are not one sequence (lookahead's window and candidates):
        token ``i`` sits at position ``length + offsets[i]`` and sees the cache and the new tokens
        ``visible[i]`` marks. Their keys and values take the next ``len(ids)`` slots (``keep`` then
        keeps the accepted ones). Each token attends over exactly the slots it sees, gathered in
        order, and the matmuls run as in verify steps (up to ``kernels.VERIFY_ROWS`` tokens), so a
        token that sees its prefix gets the logits a one-token step gives it. Eager, also on a
        compiled engine."""
        ids, start, count = self._make_room(ids)
        prefix = torch.arange(start, device=self.device)
        seen = [torch.cat([prefix, start + row.nonzero()[:, 0].to(self.device)]) for row in visible]
        positions = start + torch.as_tensor(offsets, device=self.device)
        logits = self.logits(self._body(ids, positions, start + count, tree=seen))
        self.length = start + count
        return logits

    def _run_compiled(self, ids: torch.Tensor, start: int) -> torch.Tensor:
        """A step of up to ``step_rows`` tokens through the one compiled graph.

        Lossless speculation needs a token's logits in a verify step to equal, bit for bit, its
        logits in a one-token step, so both run the same code: the tokens are padded to
        ``step_rows`` rows (copies of the last one, written to cache slots past the real ones,
        which no real row attends to and a later step overwrites; not where every row is computed
        alone, ``rows_alone``: there the graph takes 1 to ``step_rows`` rows), and attention spans a multiple
        of ``SPAN_ALIGN`` slots (the compiled softmax sums a span's last partial block of 16 in
        another order; the masked slots past a token add exact zeros)."""
        count = ids.numel()
        rows = count if self.rows_alone else self.step_rows  # (rows computed alone: no padding needed)
        span = -(-(start + rows) // SPAN_ALIGN) * SPAN_ALIGN
        if span > self.max_len:
            self._allocate(max(2 * self.max_len, span + SPAN_ALIGN))
        padded = ids if rows == count else torch.cat([ids, ids[-1:].expand(rows - count)])
        positions = torch.arange(start, start + rows, device=self.device)
        first, clock = not self.compile_seconds, time.perf_counter()
        try:
            logits = self.compiled(padded, positions, span)
        except Exception as e:  # noqa: BLE001 - no C++ compiler, an op inductor cannot lower: run eager
            why = (str(e).splitlines() or [""])[0][:120]
            self.compiled, self.note = None, f"compiling failed ({type(e).__name__}: {why}); running eager"
            print(f"[decode engine: {self.note}]", file=sys.stderr)
            return self.logits(self._body(ids, positions[:count], start + count))
        if first:
            self.compile_seconds = time.perf_counter() - clock
        return logits[:count]

    def _static_body(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Logits of a step with fixed shapes: attention spans every cache slot, masked."""
        return self.logits(self._body(ids, positions, self.max_len, static=True), whole=True)

    def _replay(self, ids: torch.Tensor, start: int) -> torch.Tensor:
        """A step of up to ``step_rows`` tokens through the one CUDA graph, captured on the first step.

        As in ``_run_compiled``, one-token and verify steps run the same kernels on the same
        shapes, so speculation reproduces greedy bit for bit: the tokens are padded to
        ``step_rows`` rows (copies of the last, written to slots past the real ones, which no
        real row attends to and a later step overwrites). Per-count graphs over unpadded rows
        did not: cuBLAS picks its kernel by the row count, and on an H100 in bf16 a verify step
        rounded differently from one-token steps (docs/results.md). The first step runs for real
        (warming up on a side stream, as capture requires: lazy library handles), then is
        recorded; recording runs nothing, so the cache holds that step's keys and values once."""
        count, rows = ids.numel(), self.step_rows
        if start + rows > self.max_len:
            self._allocate(max(2 * self.max_len, start + rows))
        ids = torch.cat([ids, ids[-1:].expand(rows - count)])
        positions = torch.arange(start, start + rows, device=self.device)
        if rows not in self.captured:
            static_ids, static_positions = ids.clone(), positions.clone()
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                logits = self._static_body(static_ids, static_positions)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.graph_pool):
                out = self._static_body(static_ids, static_positions)
            self.captured[rows] = (graph, static_ids, static_positions, out)
            return logits[:count]
        graph, static_ids, static_positions, out = self.captured[rows]
        static_ids.copy_(ids)
        static_positions.copy_(positions)
        graph.replay()
        return out[:count].clone()  # graphs share one memory pool: the next replay may overwrite ``out``

    def logits(self, x: torch.Tensor, whole: bool = False) -> torch.Tensor:
        """Float32 logits of residual states ``x`` (final norm, lm_head, soft-capping); ``whole``:
        see ``kernels.Matmul``."""
        logits = self.lm_head(self.final_norm(x), whole).float()
        cap = self.softcap_logits
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def _masks(self, positions: torch.Tensor, span: int, static: bool = False) -> dict:
        """Per window size, which of the ``span`` cache slots each new token sees (None: all)."""
        slots = torch.arange(span, device=self.device)
        causal = slots[None, :] <= positions[:, None]
        masks = {None: None if positions.numel() == 1 and not static else causal}
        for window in {layer.window for layer in self.layers} - {None}:
            masks[window] = causal & (positions[:, None] - slots[None, :] < window)
        return masks

    def _body(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        span: int,
        static: bool = False,
        exit_when=None,
        cache=None,
        tree: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """The decoder blocks over new tokens at ``positions``, attending to cache slots ``[0, span)``;
        ``static``: every token under a mask (the span may run past the tokens), no value read
        back to the host, and matmuls over all rows at once (fixed shapes, for a CUDA graph or a
        compiled step). ``exit_when``: see
        ``forward``. ``cache``: (keys, values, rotary tables) in place of the engine's own (for
        ``_Step``, which takes them as inputs). ``tree``: per token, the cache slots it attends to
        (``forward_tree``; its keys and values then go to the slots after the cache's tokens)."""
        k_caches, v_caches, tables = cache or (self.k_cache, self.v_cache, self.rotary)
        x = F.embedding(ids, self.embed).to(self.dtype)
        if self.embed_scale != 1.0:
            x = x * torch.tensor(self.embed_scale, dtype=self.embed.dtype).to(self.dtype)
        count = ids.numel()
        masks = self._masks(positions, span, static) if tree is None else {}
        slots = positions if tree is None else torch.arange(self.length, self.length + count, device=self.device)
        rotary = {kind: (cos[positions], sin[positions]) for kind, (cos, sin) in tables.items()}
        exited = None
        for i, (layer, k_cache, v_cache) in enumerate(zip(self.layers, k_caches, v_caches)):
            before, h = x, layer.attn_norm(x)
            q, k, v = layer.qkv(h, static).split([self.q_size, self.kv_size, self.kv_size], -1)
            q = q.view(count, self.heads, self.head_dim).transpose(0, 1)
            k = k.view(count, self.kv_heads, self.head_dim).transpose(0, 1)
            if layer.q_norm is not None:
                q, k = layer.q_norm(q), layer.k_norm(k)
            cos, sin = rotary[layer.rotary]
            q, k = kv_quant.rotate(q, cos, sin), kv_quant.rotate(k, cos, sin)
            # index_copy_ on the cache itself, not an assignment through a view of it: compiled,
            # the assignment became a copy of the whole cache and a copy back, every layer and step
            k_cache.index_copy_(2, slots, k[None].to(k_cache.dtype))
            v_cache.index_copy_(
                2, slots, v.view(count, self.kv_heads, self.head_dim).transpose(0, 1)[None].to(v_cache.dtype)
            )
            if exited is not None:  # after an early exit a layer only writes its keys and values
                continue
            if tree is not None:
                attn = torch.cat(
                    [
                        self._attention(
                            q[:, i : i + 1],
                            k_cache[0][:, seen],
                            v_cache[0][:, seen],
                            None,
                            None,
                            torch.tensor([len(seen) - 1], device=self.device),
                        )
                        for i, seen in enumerate(tree)
                    ],
                    1,
                )
            else:
                attn = self._attention(
                    q, k_cache[0, :, :span], v_cache[0, :, :span], masks[layer.window], layer.window, positions, static
                )
            h = layer.o(attn.transpose(0, 1).reshape(count, self.q_size), static)
            x = x + (layer.post_attn_norm(h) if layer.post_attn_norm is not None else h)
            gate, up = layer.gate_up(layer.mlp_norm(x), static).chunk(2, -1)
            h = layer.down(self.act(gate) * up, static)
            x = x + (layer.post_mlp_norm(h) if layer.post_mlp_norm is not None else h)
            if exit_when is not None and exit_when(i, before, x):
                exited = i
        if exit_when is not None:
            self.exited = exited
        return x

    def _attention(self, q, k, v, mask, window, positions, static=False):
        """Attention of the new tokens over the cache. A verify step (up to ``kernels.VERIFY_ROWS`` tokens)
        attends row by row, each over exactly its own prefix, as a one-token step does: SDPA over a
        longer masked span rounds differently (in bf16, enough to flip a near-tie), and lossless
        speculation must give the tokens plain greedy gives. Longer inputs (prompts) are one call.
        ``static``: a fixed-shape step (compiled, or a CUDA graph), one masked call over the
        whole span (its exactness comes from padding every step to the same rows: ``_replay``).
        On a CPU with an fp32 cache (or a bf16 one read by an fp32 stream: ``int4-a8``), steps run
        ``native``'s attention, row by row by design."""
        if self.native_attention and q.shape[1] <= kernels.VERIFY_ROWS:
            return torch.ops.compress.decode_attention(q.float(), k, v, positions, window or 0, self.scaling).to(
                q.dtype
            )
        if mask is None or q.shape[1] == 1 or q.shape[1] > kernels.VERIFY_ROWS or static:
            return self._sdpa(q, k, v, mask)
        rows = []
        for i, end in enumerate((positions + 1).tolist()):
            rows.append(
                self._sdpa(q[:, i : i + 1], k[:, :end], v[:, :end], None if window is None else mask[i : i + 1, :end])
            )
        return torch.cat(rows, 1)

    def _sdpa(self, q, k, v, mask):
        dtype, q = q.dtype, q.to(k.dtype)  # the cache's dtype (``cache_dtype``)
        if self.softcap_attn is None:
            return F.scaled_dot_product_attention(
                q[None], k[None], v[None], attn_mask=mask, scale=self.scaling, enable_gqa=True
            )[0].to(dtype)
        groups = self.heads // self.kv_heads  # soft-capped scores: SDPA cannot, so spelled out
        k, v = k.repeat_interleave(groups, 0), v.repeat_interleave(groups, 0)
        scores = torch.tanh(q @ k.transpose(1, 2) * self.scaling / self.softcap_attn) * self.softcap_attn
        if mask is not None:
            scores = scores.masked_fill(~mask, -math.inf)
        return (torch.softmax(scores.float(), -1).to(q.dtype) @ v).to(dtype)

    def describe(self) -> str:
        """Which kernel each linear group runs on, and what a one-token call of the group took."""
        return "; ".join(
            f"{name}: {fmt}"
            + (f" ({self.timings[name][fmt]:.2f} ms/token)" if fmt in self.timings.get(name, {}) else "")
            for name, fmt in self.formats.items()
        )

    def weight_bytes(self) -> int:
        """Bytes one decoded token reads from weights (every linear once; the embedding row is noise)."""
        return self.lm_head.nbytes + sum(
            m.nbytes for layer in self.layers for m in (layer.qkv, layer.o, layer.gate_up, layer.down)
        )


class _Step(torch.nn.Module):
    """An engine's compiled step as a module: its weights (linears, norms, embedding) are buffers,
    which inductor's ``freezing`` folds in as constants, prepacks, and runs through its own GEMM
    templates with everything between the matmuls fused into a few loops, so a token costs its
    matmuls, not ~40 ops a layer. The KV cache and the rotary tables are inputs (updated in place),
    so the eager prompt and the compiled steps share one cache, and growing it needs no new graph."""

    def __init__(self, engine: Engine):
        super().__init__()
        self.engine = engine  # a plain attribute: not a module, its tensors are found by identity
        for i, t in enumerate(_step_tensors(engine)):
            # not "constant{i}": AOTInductor names its packed weights so, and a buffer of that name
            # replaced a packed weight in the package, which then computed wrong products
            self.register_buffer(f"engine_tensor{i}", t)

    def forward(self, ids, positions, slots, k_cache, v_cache, rotary):
        """``slots``: a tensor whose length is the span (a shape, so the span stays symbolic);
        ``rotary``: (cos, sin) tables in the order of ``sorted(engine.rotary)``."""
        tables = dict(zip(sorted(self.engine.rotary), rotary))
        x = self.engine._body(ids, positions, slots.shape[0], static=True, cache=(k_cache, v_cache, tables))
        return self.engine.logits(x)


# Freezing folds the weights in as constants, which lets inductor prepack them and run its own
# AMX/AVX-512 GEMM templates (chosen by timing: max-autotune). AOTInductor writes the result as one
# package (a shared library and its constants), which later processes load in about a second.
INDUCTOR_OPTIONS = {"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN"}


def _step_tensors(engine: Engine) -> list[torch.Tensor]:
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


def _fingerprint(engine: Engine) -> str:
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
    for module in (sys.modules[__name__], kernels):  # the code that builds the graph
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
    a new package (200-400 MB for SmolLM2, 1.4x the bf16 size for a 7B model), so without this the
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


def _compiled(engine: Engine):
    """The compiled step (``step_rows`` tokens): ids, positions, span -> logits.

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
        rows, length = engine.step_rows, 3 * SPAN_ALIGN  # examples: the span and cache length differ
        cache = [
            torch.zeros(1, engine.kv_heads, length, engine.head_dim, dtype=engine.cache_dtype, device=engine.device)
            for _ in engine.layers
        ]
        tables = [
            tuple(torch.zeros(length, engine.head_dim, dtype=engine.dtype, device=engine.device) for _ in range(2))
            for _ in engine.rotary
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

    def step(ids: torch.Tensor, positions: torch.Tensor, span: int) -> torch.Tensor:
        nonlocal runner
        if runner is None:
            runner = load_or_build()
        rotary = [engine.rotary[kind] for kind in sorted(engine.rotary)]
        slots = torch.empty(span, dtype=torch.int8)
        loader = getattr(runner, "loader", None)
        if loader is None:
            return runner(ids, positions, slots, engine.k_cache, engine.v_cache, rotary)
        # the inputs flattened as the package's call spec orders them (``_Step.forward``), handed to the
        # loader itself: the packaged model's ``__call__`` parses its call spec from JSON and walks
        # the ~65 inputs with pytree on every call (0.05-0.1 ms of a 5.7 ms W4 step, timed side by side)
        tables = [t for pair in rotary for t in pair]
        return loader.boxed_run([ids, positions, slots, *engine.k_cache, *engine.v_cache, *tables])[0]

    step.path, step.built = path, None  # built: compiled in this process (False: loaded; None: not yet run)
    return step
