"""The decode engine: our own forward over a loaded model's weights, with a preallocated KV cache.

Why our own forward rather than transformers' with a static cache: most of a decoded token's
time in transformers' eager modeling code is overhead (mask construction, cache bookkeeping,
many small modules and ops), not the arithmetic or the weight reads (docs/decoder.md, "Our
own forward"). The forward below does per layer what the paper-level model
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

import copy
import os
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .. import USER_INDUCTOR_CACHE, hadamard, kv_quant
from ..models import cache_dir
from . import choice, kernels, native, onednn, steps
from .attention import Attention
from .cache import KVCache
from .loop import DecodeError, device_of

SUPPORTED = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text")
STEP_ROWS = 8  # tokens a fixed-shape step computes: one-token and verify steps alike (``steps``)
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
    down_rotated: bool = False  # down_proj reads its input rotated online (``rotate: {down: true}``)


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
    ``compile``: steps of up to ``step_rows`` tokens through one graph compiled by AOTInductor
    (``steps.compiled``; eager if it fails); ``graphs`` (default: on a GPU): through one CUDA graph
    (``steps.GraphStep``); not both yet (said in one line). Either way one-token and verify steps
    run the same graph, so speculation on it reproduces its greedy exactly; prompts and longer
    steps run eager. ``step_rows`` (default: 8 on CUDA graphs, and on a CPU where every kernel is
    a float GEMM, whose extra rows ride along with the weight reads; 1 over a CPU's integer kernels,
    whose cost grows with the rows, and then speculation on it has no room and is plain greedy).
    A model carrying a KIVI scheme gets KIVI's numerics (``cache.KVCache``); ``kivi=False`` keeps a
    full-precision cache whatever the model carries (a draft, whose rejected tokens must be
    rolled back). ``cache_dtype``: the KV cache's (default: ``_cache_dtype``).
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
        self.device, self.config, self.act = device_of(model), config, _activation(config)
        inner = model.model
        gemma = config.model_type.startswith("gemma")
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.scaling = inner.layers[0].self_attn.scaling
        self.softcap_attn = getattr(config, "attn_logit_softcapping", None)
        self.softcap_logits = getattr(config, "final_logit_softcapping", None)
        self.embed = inner.embed_tokens.weight.detach()
        self.embed_scale = float(getattr(inner.embed_tokens, "scalar_embed_scale", 1.0))
        groups, head = _linear_groups(model, quantize), [model.lm_head]
        self.formats, self.timings = choice.choose(
            {name: [g[name] for g in groups] for name in groups[0]} | {"lm_head": [head]},
            kernel,
            self.device,
            lossy={"lm_head": lm_head} if lm_head else {},
            compiled=compile and self.device.type == "cpu",
        )
        self.lm_head, matmuls = _matmuls(self.formats, head, groups, self.device, compile)
        self.matmuls = [self.lm_head, *(m for g in matmuls for m in g.values())]  # their traits decide what follows
        self.dtype = dtype or _stream_dtype(model, self.device, self.matmuls)
        native_attention = (
            self.device.type == "cpu" and self.softcap_attn is None and self.head_dim % 8 == 0 and native.available()
        )
        if cache_dtype not in (None, torch.float32, torch.bfloat16):
            raise DecodeError(f"cache_dtype={cache_dtype}: the KV cache is float32 or bfloat16")
        self.cache_dtype = cache_dtype or _cache_dtype(self.device, self.dtype, native_attention, self.matmuls)
        # one-row attention over an fp32 cache, or a bf16 one read by an fp32 stream, on our own
        # kernel (``native``): SDPA's fixed overhead a layer outweighs one row's arithmetic
        self.native_attention = native_attention and torch.float32 in (self.cache_dtype, self.dtype)
        self.attention = Attention(self.heads, self.kv_heads, self.scaling, self.softcap_attn, self.native_attention)
        self.final_norm = _norm(inner.norm, self.dtype, gemma)
        self.layers = [
            _layer(config, i, layer, m, self.dtype) for i, (layer, m) in enumerate(zip(inner.layers, matmuls))
        ]
        self.q_size, self.kv_size = self.heads * self.head_dim, self.kv_heads * self.head_dim
        graphs = self.device.type == "cuda" if graphs is None else graphs
        if graphs and self.device.type != "cuda":
            raise DecodeError("CUDA graphs need a CUDA device; run without graphs on the CPU")
        self.graphs = steps.GraphStep(self) if graphs else None
        # a compiled step attends past its tokens (``steps.run_compiled``): room for that from the start
        max_len += 2 * steps.SPAN_ALIGN if compile else 0
        self.cache = _cache(self, model, max_len, kv_quant.scheme_of(model) if kivi else None)
        self.compiled, self.compile_seconds, self.note, self.exited = None, 0.0, "", None
        self.features, self.features_start = None, 0  # the last forward's final-normed states, from this position
        # a compiled step whose every row is computed alone (our kernels and attention) takes exactly
        # its tokens' rows (``steps.run_compiled``): no padding, so a one-token step pays for one row
        self.rows_alone = compile and self.native_attention and all(m.rows_alone for m in self.matmuls)
        self.step_rows = self._default_step_rows() if step_rows is None else step_rows
        if not 1 <= self.step_rows <= kernels.VERIFY_ROWS:
            raise DecodeError(f"step_rows={step_rows}: give 1 to {kernels.VERIFY_ROWS}")
        if compile and self.graphs:  # see docs/results.md: both ways failed on an H100
            self.note = "compiling is not combined with CUDA graphs yet; the graphs run uncompiled"
            print(f"[decode engine: {self.note}]", file=sys.stderr)
        elif compile:
            if not USER_INDUCTOR_CACHE:
                os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir() / "inductor")
            self.compiled = steps.compiled(self)

    def _default_step_rows(self) -> int:
        """Extra rows ride along with a float GEMM's weight reads, not with an integer kernel's on a
        CPU; a GPU's step at a few rows is launch-bound whatever the kernel."""
        ride_along = self.graphs is not None or self.rows_alone or all(m.rows_ride_along for m in self.matmuls)
        return STEP_ROWS if ride_along else 1

    @property
    def layer_count(self) -> int:
        return len(self.layers)

    @property
    def length(self) -> int:
        """Tokens in the cache."""
        return self.cache.length

    def reset(self) -> None:
        self.cache.reset()

    def crop(self, n: int) -> None:
        """Forget the last ``n`` cached tokens (their slots are overwritten by the next forward)."""
        self.cache.crop(n)

    @property
    def step_tokens(self) -> int:
        """The most tokens one step computes exactly as one-token steps do (a verify step's limit)."""
        return self.step_rows if self.compiled is not None or self.graphs else kernels.VERIFY_ROWS

    def subset(self, keep: list[int]) -> Engine:
        """The same weights with only the layers ``keep`` run, and a cache of its own: a draft."""
        keep = sorted(set(keep))
        if not keep or keep[-1] >= len(self.layers) or keep[0] < 0:
            raise DecodeError(f"--layers must stay within 0-{len(self.layers) - 1}")
        view = copy.copy(self)
        view.layers = [self.layers[i] for i in keep]
        view.cache = self.cache.empty([layer.rotary for layer in view.layers])  # a draft's: full precision
        if self.graphs is not None:  # graphs of its own over its own cache, in the same memory pool
            view.graphs = steps.GraphStep(view, self.graphs.pool)
        if self.compiled is not None:  # a graph of its own: the view runs other layers
            view.compiled, view.compile_seconds = steps.compiled(view), 0.0
        return view

    @torch.no_grad()
    def forward(self, ids: list[int] | torch.Tensor, all_logits: bool = True, exit_when=None) -> torch.Tensor:
        """Float32 logits of ``ids`` appended to the cache: (len(ids), vocab), or (1, vocab). The
        final-normed states of every row are kept in ``features``, the first one's position in
        ``features_start`` (an EAGLE head reads them; None after an early exit).

        ``exit_when(layer index, state entering the layer, state leaving it) -> bool``: early exit for
        one token (eager). Once it answers yes, the logits come from that state, and every later
        layer only writes its keys and values computed from it (CALM's state propagation), so
        later tokens find a complete cache; ``exited`` then holds the layer (None: no exit)."""
        ids = torch.as_tensor(ids, device=self.device).reshape(-1)
        count, context = ids.numel(), self.cache.context
        start = self.cache.make_room(count)
        positions = torch.arange(start, start + count, device=self.device)
        self.features, self.features_start = None, start
        if exit_when is not None:
            if count != 1:
                raise DecodeError("early exit decides per token: give one token")
            logits = self.logits(self.body(ids, positions, start + 1, exit_when=exit_when))
        elif self.graphs is not None and count <= self.step_rows and start + self.step_rows <= context:
            logits, self.features = self.graphs(ids, start)
        elif (
            self.compiled is not None
            and count <= self.step_rows
            and start + self.step_rows + steps.SPAN_ALIGN <= context
        ):
            logits, self.features = steps.run_compiled(self, ids, start)  # (near the context's end: eager, below)
        else:
            self.features = self.final_norm(self.body(ids, positions, start + count))
            logits = self.head_logits(self.features if all_logits else self.features[-1:])
        self.cache.length = start + count
        return logits if all_logits else logits[-1:]

    def logits(self, x: torch.Tensor, whole: bool = False) -> torch.Tensor:
        """Float32 logits of residual states ``x`` (final norm, lm_head, soft-capping); ``whole``:
        see ``kernels.Matmul``."""
        return self.head_logits(self.final_norm(x), whole)

    def head_logits(self, features: torch.Tensor, whole: bool = False) -> torch.Tensor:
        """Float32 logits of final-normed states (lm_head, soft-capping): what an EAGLE head's
        predicted features are read through."""
        logits = self.lm_head(features, whole).float()
        cap = self.softcap_logits
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def body(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        span: int,
        static: bool = False,
        exit_when=None,
        cache=None,
        tree: dict[int | None, list[torch.Tensor]] | None = None,
    ) -> torch.Tensor:
        """The decoder blocks over new tokens at ``positions``, attending to cache slots ``[0, span)``;
        ``static``: every token under a mask (the span may run past the tokens), no value read
        back to the host, and matmuls over all rows at once (fixed shapes, for a CUDA graph or a
        compiled step). ``exit_when``: see
        ``forward``. ``cache``: (keys, values, rotary tables) in place of the engine's own (for
        the compiled step, which takes them as inputs). ``tree``: per sliding window (None: none), per
        token, the cache slots it attends to (a tree step, ``tree.EngineTree``; its keys and values
        then go to the slots after the cache's tokens)."""
        k_caches, v_caches, tables = cache or (self.cache.k, self.cache.v, self.cache.rotary)
        x = F.embedding(ids, self.embed).to(self.dtype)
        if self.embed_scale != 1.0:
            x = x * torch.tensor(self.embed_scale, dtype=self.embed.dtype).to(self.dtype)
        count = ids.numel()
        windows = {layer.window for layer in self.layers}
        masks = self.attention.masks(positions, span, windows, static) if tree is None else {}
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
                attn = self.attention.tree(q, k_cache[0], v_cache[0], tree[layer.window])
            else:
                keys, values = k_cache[0, :, :span], v_cache[0, :, :span]
                attn = self.attention(q, keys, values, masks[layer.window], layer.window, positions, static)
            h = layer.o(attn.transpose(0, 1).reshape(count, self.q_size), static)
            x = x + (layer.post_attn_norm(h) if layer.post_attn_norm is not None else h)
            gate, up = layer.gate_up(layer.mlp_norm(x), static).chunk(2, -1)
            h = self.act(gate) * up
            if layer.down_rotated:  # a fast Walsh-Hadamard transform, in float32 as the export's hook does it
                h = hadamard.block_transform(h.float()).to(h.dtype)
            h = layer.down(h, static)
            x = x + (layer.post_mlp_norm(h) if layer.post_mlp_norm is not None else h)
            if exit_when is not None and exit_when(i, before, x):
                exited = i
        if exit_when is not None:
            self.exited = exited
        return x

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


def _cache_dtype(device: torch.device, dtype: torch.dtype, native_attention: bool, matmuls: list) -> torch.dtype:
    """The KV cache's dtype when none is asked for: the stream's, with two exceptions. A bf16 cache
    under an fp32 stream halves what attention reads (a step at 400 cached tokens reads 18 MB of
    fp32 keys and values on SmolLM2), at a rounding of its own: lossy against fp32 greedy, as
    ``scripts/bench_kernel_accuracy.py`` measures."""
    if device.type == "cpu" and dtype == torch.bfloat16 and not onednn.onednn_bf16_available():
        # attention (and so the cache) in fp32 where bf16 arithmetic is emulated (an AVX2-only CPU):
        # there a compiled step's bf16 SDPA is about twice fp32's
        return torch.float32
    if native_attention and any(m.rounds_rows for m in matmuls):
        # kernels that round their input rows to int8 lose more than a bf16 cache does, and the
        # cache's reads, a sizeable share of such a step, halve
        return torch.bfloat16
    return dtype


def _layer(config, i: int, layer, matmuls: dict[str, kernels.Matmul], dtype: torch.dtype) -> Layer:
    """Block ``i`` of a transformers model as the engine runs it: its linear groups on ``matmuls``,
    its norms in ``dtype``."""
    gemma = config.model_type.startswith("gemma")
    a = layer.self_attn
    window = (
        getattr(config, "sliding_window", None)
        if config.model_type == "mistral"
        else getattr(a, "sliding_window", None)
    )
    return Layer(
        **matmuls,
        attn_norm=_norm(layer.input_layernorm, dtype, gemma),
        mlp_norm=_norm(layer.pre_feedforward_layernorm if gemma else layer.post_attention_layernorm, dtype, gemma),
        post_attn_norm=_norm(layer.post_attention_layernorm, dtype, gemma) if gemma else None,
        post_mlp_norm=_norm(layer.post_feedforward_layernorm, dtype, gemma) if gemma else None,
        q_norm=_norm(getattr(a, "q_norm", None), dtype, gemma),
        k_norm=_norm(getattr(a, "k_norm", None), dtype, gemma),
        window=window,
        rotary=config.layer_types[i] if gemma else "default",
        down_rotated=hadamard.InputRotation.of(layer.mlp.down_proj) is not None,
    )


def _activation(config):
    """The MLP's activation function; an unsupported family or activation is refused in one line."""
    if config.model_type not in SUPPORTED:
        raise DecodeError(f"the decode engine supports {', '.join(SUPPORTED)} models, not {config.model_type}")
    act = getattr(config, "hidden_activation", None) or config.hidden_act
    if act not in ACTIVATIONS:
        raise DecodeError(f"the decode engine has no {act!r} activation (known: {', '.join(ACTIVATIONS)})")
    return ACTIVATIONS[act]


def _linear_groups(model, quantize: str | None) -> list[dict[str, list]]:
    """Each block's linear groups (q/k/v, o, gate/up, down), rounded to 4 bits in memory for a W4 draft."""
    if quantize not in (None, "w4"):
        raise DecodeError(f"quantize={quantize!r}: only w4 (round-to-nearest 4-bit, in memory) is offered")
    groups = [_linears(layer) for layer in model.model.layers]
    if quantize == "w4":
        groups = [{name: [kernels.rtn_w4(lin) for lin in lins] for name, lins in g.items()} for g in groups]
    return groups


def _stream_dtype(model, device: torch.device, matmuls: list) -> torch.dtype:
    """The residual stream's dtype when none is asked for: the model's on a GPU; on a CPU bf16 when
    every chosen kernel takes bf16 (then the engine computes what transformers computes in bf16)."""
    if device.type != "cpu":
        return model.dtype
    return torch.bfloat16 if all(m.takes_bf16 for m in matmuls) else torch.float32


def _cache(engine: Engine, model, max_len: int, scheme) -> KVCache:
    return KVCache(
        [layer.rotary for layer in engine.layers],
        model.model.rotary_emb,
        engine.kv_heads,
        engine.head_dim,
        engine.dtype,
        engine.cache_dtype,
        engine.device,
        getattr(model.config, "max_position_embeddings", None) or 1 << 20,
        max_len,
        scheme,
    )


def _matmuls(formats: dict[str, str], head: list, groups: list[dict], device, traceable: bool):
    """The lm_head's kernel, and each block's linear groups on theirs, in the chosen formats."""
    build = lambda name, linears: kernels.build(formats[name], linears, device, traceable)  # noqa: E731
    return build("lm_head", head), [{name: build(name, linears) for name, linears in g.items()} for g in groups]
