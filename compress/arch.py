"""What each architecture looks like, as data.

``groups`` lists a decoder block's linears in forward order; linears in one group
read the same input (so one statistic serves them all). ``scalings`` says which op
feeds which linears, for passes that fold a per-channel scale into the previous op
(AWQ, SmoothQuant). Gemma's RMSNorm multiplies by ``1 + weight``: ``norm_plus_one``.
"""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass

import torch

from . import moe


@dataclass(frozen=True)
class Scaling:
    prev: str  # module whose output feeds `linears` (a norm or a linear)
    linears: tuple[str, ...]
    inspect: str  # module whose output measures the damage (attention, MLP, or the linear itself)
    attention: bool = False  # `inspect` is the attention: call it with the block's arguments


@dataclass(frozen=True)
class Arch:
    name: str
    groups: tuple[tuple[str, ...], ...]
    scalings: tuple[Scaling, ...]
    norm_plus_one: bool = False
    layers: str = "model.layers"
    norm: str = "model.norm"  # the final norm, between the last block and the head


_ATTN = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
_MLP_IN = ("mlp.gate_proj", "mlp.up_proj")
_GROUPS = (_ATTN, ("self_attn.o_proj",), _MLP_IN, ("mlp.down_proj",))


def _llama_like(name: str, mlp_norm: str = "post_attention_layernorm", plus_one: bool = False) -> Arch:
    return Arch(
        name=name,
        groups=_GROUPS,
        scalings=(
            Scaling("input_layernorm", _ATTN, "self_attn", attention=True),
            Scaling("self_attn.v_proj", ("self_attn.o_proj",), "self_attn.o_proj"),
            Scaling(mlp_norm, _MLP_IN, "mlp"),
            Scaling("mlp.up_proj", ("mlp.down_proj",), "mlp.down_proj"),
        ),
        norm_plus_one=plus_one,
    )


ARCHS = {
    "llama": _llama_like("llama"),
    "mistral": _llama_like("mistral"),
    "qwen2": _llama_like("qwen2"),
    "qwen3": _llama_like("qwen3"),
    # Gemma-3 normalises the attention output with post_attention_layernorm; the MLP
    # input comes from pre_feedforward_layernorm.
    "gemma3_text": _llama_like("gemma3_text", mlp_norm="pre_feedforward_layernorm", plus_one=True),
    "gemma3": _llama_like("gemma3", mlp_norm="pre_feedforward_layernorm", plus_one=True),
}


class UnknownArchitecture(ValueError):
    pass


def arch_of(model: torch.nn.Module) -> Arch:
    """The table's entry for the model type, else what one traced forward of a block shows
    (``infer``), kept on the model. Fused mixture-of-experts weights are first split into one
    linear per expert projection (``moe.unfuse``), in place: the model computes the same."""
    model_type = getattr(model.config, "model_type", None)
    if model_type in ARCHS:
        return ARCHS[model_type]
    inferred = model.__dict__.get("_compress_arch")
    if inferred is None:
        moe.unfuse(model)
        inferred = model.__dict__["_compress_arch"] = infer(model)
    return inferred


class _Stop(Exception):
    pass


def _layers_path(model: torch.nn.Module) -> str:
    """The decoder blocks: the longest ``ModuleList`` of one module type."""
    lists = [
        (len(m), name)
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.ModuleList) and len(m) and len({type(c) for c in m}) == 1
    ]
    if not lists:
        raise UnknownArchitecture(
            f"model_type {model.config.model_type!r}: found no list of decoder blocks (a ModuleList of one "
            "module type); add its mapping to compress/arch.py"
        )
    return max(lists)[1]


@torch.no_grad()
def _traced_block(model: torch.nn.Module, layers: str):
    """A float32 copy of block 0 with random weights (shapes are what matter; block 0 itself may not be
    read yet) and its call arguments, recorded by running the model's body on random embeddings."""
    parent, blocks = model.get_submodule(layers.rpartition(".")[0]), model.get_submodule(layers)
    seen = {}

    def record(module, args, kwargs):
        seen["call"] = (args, kwargs)
        raise _Stop

    handle = blocks[0].register_forward_pre_hook(record, with_kwargs=True)
    width = model.config.get_text_config().hidden_size
    generator = torch.Generator().manual_seed(0)
    try:
        parent(inputs_embeds=torch.randn(1, 8, width, generator=generator), use_cache=False)
    except _Stop:
        pass
    finally:
        handle.remove()
    if "call" not in seen:
        raise UnknownArchitecture(f"model_type {model.config.model_type!r}: its body never called block 0")
    block = copy.deepcopy(blocks[0]).to_empty(device="cpu").float()
    for p in block.parameters():
        p.copy_(
            torch.randn(p.shape, generator=generator, dtype=p.dtype) * (0.3 if p.dim() == 1 else 0.1) + (p.dim() == 1)
        )
    args, kwargs = seen["call"]
    kwargs = {k: v for k, v in kwargs.items() if k not in ("past_key_values", "cache", "use_cache")}
    return block, args, kwargs


def _run_traced(block, args, kwargs, changes=None):
    """Each submodule's input and output and its call, in call order, for one forward of ``block``;
    ``changes[name](output)`` replaces a submodule's output."""
    calls, handles = {}, []
    for name, module in block.named_modules():
        if not name:
            continue

        def hook(module, a, kw, out, name=name):
            x = a[0] if a else next((v for v in kw.values() if isinstance(v, torch.Tensor)), None)
            calls.setdefault(name, (x, out[0] if isinstance(out, tuple) else out, a, kw))
            if changes and name in changes:
                return changes[name](out)
            return None

        handles.append(module.register_forward_hook(hook, with_kwargs=True))
    try:
        out = block(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
    return calls, out[0] if isinstance(out, tuple) else out


def _same(a, b) -> bool:
    return a is b or (
        isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    )


def _parent(name: str) -> str:
    return name.rpartition(".")[0]


@torch.no_grad()
def infer(model: torch.nn.Module) -> Arch:
    """Groups and scalings from the module tree and one traced forward of (a random copy of) block 0.

    Groups: linears that read the same tensor, in call order. Scalings: a module whose output is
    a group's input (a norm), and a linear whose output channels scale another linear's input
    channels one for one (v → o under multi-head attention, up → down). Each scaling is then
    confirmed: folding a random scale into it must leave the block's output unchanged (that also
    tells Gemma-style ``1 + w`` norms apart)."""
    layers = _layers_path(model)
    block, args, kwargs = _traced_block(model, layers)
    with moe.routing_all(block):  # every expert is traced, not only those 8 random tokens reach
        return _infer_traced(model, layers, block, args, kwargs)


def _infer_traced(model, layers: str, block, args, kwargs) -> Arch:
    calls, reference = _run_traced(block, args, kwargs)
    # a linear with one output is a gate (Qwen2-MoE's shared_expert_gate: one scalar per token), not a
    # projection to compress: it stays dense, as routers do
    linears = [
        n
        for n in calls
        if isinstance(block.get_submodule(n), torch.nn.Linear) and block.get_submodule(n).out_features > 1
    ]
    if not linears:
        raise UnknownArchitecture(
            f"model_type {model.config.model_type!r}: its decoder block calls no torch.nn.Linear; "
            "add its mapping to compress/arch.py"
        )
    covered = {id(p) for n in linears for p in block.get_submodule(n).parameters()}
    left: dict[str, int] = {}
    for n, p in block.named_parameters():
        if p.dim() > 1 and id(p) not in covered:
            left[_parent(n)] = left.get(_parent(n), 0) + p.numel()
    if sum(left.values()) > 0.1 * sum(p.numel() for p in block.parameters()):
        warnings.warn(  # e.g. the fused 3-D expert weights of mixture-of-experts blocks
            f"model_type {model.config.model_type!r}: {', '.join(sorted(left))} hold "
            f"{sum(left.values()) / sum(p.numel() for p in block.parameters()):.0%} of a block's weights outside "
            "torch.nn.Linear layers; no pass compresses them, they stay dense",
            stacklevel=3,
        )
    groups: list[list[str]] = []
    expert = {n: moe.expert_path(block, n) for n in linears}  # experts read their own tokens: never one statistic
    for name in linears:
        match = next(
            (g for g in groups if expert[g[0]] == expert[name] and _same(calls[g[0]][0], calls[name][0])), None
        )
        (match.append(name) if match else groups.append([name]))
    candidates = []
    for group in groups:
        x = calls[group[0]][0]
        common = _parent(group[0]) if all(_parent(n) == _parent(group[0]) for n in group) else ""
        prev = next((n for n, c in calls.items() if n not in group and _same(c[1], x) and _is_norm(block, n)), None)
        if prev is not None and common:
            module_args = calls[common][2:]
            attention = len(module_args[0]) + len(module_args[1]) > 1  # called with more than the hidden states
            candidates.append(Scaling(prev, tuple(group), common, attention))
    for i, a in enumerate(linears):
        for b in linears[i + 1 :]:
            lin_a, lin_b = block.get_submodule(a), block.get_submodule(b)
            if (
                _parent(a) == _parent(b)
                and lin_a.out_features == lin_b.in_features
                and _scales_through(block, args, kwargs, calls, a, b)
            ):
                candidates.append(Scaling(a, (b,), b))
    scalings, plus_one = [], False
    for m in sorted(candidates, key=lambda m: linears.index(m.linears[0])):  # forward order, as passes fold
        for flag in (False, True) if not isinstance(block.get_submodule(m.prev), torch.nn.Linear) else (False,):
            if _fold_keeps_output(block, args, kwargs, reference, m, flag):
                scalings.append(m)
                plus_one = plus_one or flag
                break
    norm = next(
        (
            f"{_parent(layers)}.{n}"
            for n, c in model.get_submodule(_parent(layers)).named_children()
            if "norm" in n.lower()
        ),
        f"{_parent(layers)}.norm",
    )
    return Arch(
        str(model.config.model_type),
        tuple(tuple(g) for g in groups),
        tuple(scalings),
        norm_plus_one=plus_one,
        layers=layers,
        norm=norm,
    )


def _is_norm(block, name: str) -> bool:
    module = block.get_submodule(name)
    weight = getattr(module, "weight", None)
    return not isinstance(module, torch.nn.Linear) and isinstance(weight, torch.Tensor) and weight.dim() == 1


def _scales_through(block, args, kwargs, calls, a: str, b: str) -> bool:
    """Scaling ``a``'s output channels by s scales ``b``'s input channels by s, exactly."""
    s = torch.rand(block.get_submodule(a).out_features, generator=torch.Generator().manual_seed(1))
    s = s + 0.5
    changed, _ = _run_traced(block, args, kwargs, {a: lambda out: out * s})
    before, after = calls[b][0], changed[b][0]
    # a wrong mapping is off by the scale itself (0.5 to 1.5); some modules compute in float32 inside
    return before is not None and torch.allclose(after, before * s, rtol=1e-4, atol=1e-6 * before.abs().max().item())


def _fold_keeps_output(block, args, kwargs, reference, m: Scaling, plus_one: bool) -> bool:
    """Fold a random scale, run the block, fold it back (no copy of the block: it may be large)."""
    width = block.get_submodule(m.linears[0]).in_features
    s = torch.rand(width, generator=torch.Generator().manual_seed(2)) + 0.5
    fold(block, m, s, plus_one)
    try:
        out = block(*args, **kwargs)
    finally:
        fold(block, m, 1 / s, plus_one)
    out = out[0] if isinstance(out, tuple) else out
    return torch.allclose(out, reference, rtol=1e-4, atol=1e-6 * reference.abs().max().item())


@torch.no_grad()
def fold(block: torch.nn.Module, mapping: Scaling, s: torch.Tensor, norm_plus_one: bool) -> None:
    """``prev`` output / s, following linears' input columns × s: the float function is unchanged
    (AWQ, SmoothQuant; ``infer`` confirms each mapping with it)."""
    prev = block.get_submodule(mapping.prev)
    if isinstance(prev, torch.nn.Linear):
        prev.weight.data = (prev.weight.float() / s.unsqueeze(1)).to(prev.weight.dtype)
        if prev.bias is not None:
            prev.bias.data = (prev.bias.float() / s).to(prev.bias.dtype)
    elif norm_plus_one:  # Gemma: y = x̂ · (1 + w)  ->  1 + w' = (1 + w) / s
        prev.weight.data = ((1 + prev.weight.float()) / s - 1).to(prev.weight.dtype)
    else:
        prev.weight.data = (prev.weight.float() / s).to(prev.weight.dtype)
        if getattr(prev, "bias", None) is not None:
            prev.bias.data = (prev.bias.float() / s).to(prev.bias.dtype)
    for name in mapping.linears:
        lin = block.get_submodule(name)
        lin.weight.data = (lin.weight.float() * s).to(lin.weight.dtype)


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    return model.get_submodule(arch_of(model).layers)


def block_linears(block: torch.nn.Module, arch: Arch) -> dict[str, torch.nn.Linear]:
    """The linears of one block, in forward order, by their name inside the block."""
    return {name: block.get_submodule(name) for group in arch.groups for name in group}


def foldable_scalings(model: torch.nn.Module) -> list[Scaling]:
    """The scalings whose ``prev`` output width matches its linears' input (v -> o drops out
    under grouped-query attention, where v is narrower than o's input)."""
    arch, block = arch_of(model), decoder_layers(model)[0]
    out = []
    for m in arch.scalings:
        prev = block.get_submodule(m.prev)
        width = prev.out_features if isinstance(prev, torch.nn.Linear) else prev.weight.shape[0]
        if all(block.get_submodule(n).in_features == width for n in m.linears):
            out.append(m)
    return out
