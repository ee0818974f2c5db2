"""What each architecture looks like, as data.

``groups`` lists a decoder block's linears in forward order; linears in one group
read the same input (so one statistic serves them all). ``scalings`` says which op
feeds which linears, for passes that fold a per-channel scale into the previous op
(AWQ, SmoothQuant). Gemma's RMSNorm multiplies by ``1 + weight``: ``norm_plus_one``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


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
    model_type = getattr(model.config, "model_type", None)
    if model_type not in ARCHS:
        raise UnknownArchitecture(
            f"no architecture mapping for model_type {model_type!r} (known: {', '.join(sorted(ARCHS))}); "
            "add one to compress/arch.py"
        )
    return ARCHS[model_type]


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
