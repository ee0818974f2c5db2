"""Mixture-of-experts blocks as linears.

transformers 5 keeps a block's experts as two fused 3-D tensors (``gate_up_proj`` (E, 2I, H),
``down_proj`` (E, H, I)) that no linear-based pass sees. ``unfuse`` replaces such a module with
``LinearExperts``: one ``nn.Linear`` per expert projection, named as the family's checkpoints
on the hub name them (found by asking transformers' own ``revert_weight_conversion``). Then
GPTQ, AWQ, SparseGPT and Wanda treat experts like any linear; the export writes the per-expert
layout that transformers (which fuses it again on load) and vLLM read; and a streamed hub
checkpoint, which stores experts one by one, is read block by block as it is.

Calibration counts the tokens the router sends each expert (``count_routed``); an expert that gets
too few is left out of data-based passes and rounded (or pruned) without data, by the pipeline.
``route_all`` sends every token through every expert for statistics only (the block's output
still uses the router's choice), as the peers' "calibrate all experts" options do.
"""

from __future__ import annotations

import re
from contextlib import contextmanager

import torch
from torch import nn


class Expert(nn.Module):
    """One expert's gated MLP, its three linears named as the checkpoint names them."""

    def __init__(self, names: tuple[str, str, str], gate: nn.Linear, up: nn.Linear, down: nn.Linear, act):
        super().__init__()
        self.names = names
        for name, linear in zip(names, (gate, up, down), strict=True):
            self.add_module(name, linear)
        self.act_fn = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up, down = (getattr(self, n) for n in self.names)
        return down(self.act_fn(gate(x)) * up(x))


class LinearExperts(nn.Module):
    """The fused experts module's replacement: the same call (hidden states, the router's top-k
    expert indices and weights), the same arithmetic, one ``Expert`` per child ``"0"``, ``"1"``...
    (not a ``ModuleList``: the longest one of those is taken for the decoder blocks)."""

    def __init__(self, experts: list[Expert], checkpoint_parent: str | None):
        super().__init__()
        for e, expert in enumerate(experts):
            self.add_module(str(e), expert)
        self.num_experts = len(experts)
        self.checkpoint_parent = checkpoint_parent  # the sparse block's name in checkpoints, if not ours
        self.tokens: torch.Tensor | None = None  # routed tokens per expert, while ``count_routed`` runs
        self.route_all = False
        self.starved: frozenset[int] = frozenset()  # experts that data-based passes leave to data-free rounding

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        out = torch.zeros_like(hidden_states)
        if self.tokens is not None:
            self.tokens += torch.bincount(top_k_index.flatten().cpu(), minlength=self.num_experts)[: self.num_experts]
        for e in range(self.num_experts):
            # (position in the top-k, token) in the order transformers' eager experts use
            top_k_pos, token_idx = torch.where((top_k_index == e).T)
            if self.route_all:
                y = self.get_submodule(str(e))(hidden_states)[token_idx]
            elif token_idx.numel():
                y = self.get_submodule(str(e))(hidden_states[token_idx])
            else:
                continue
            out.index_add_(0, token_idx, (y * top_k_weights[token_idx, top_k_pos, None]).to(out.dtype))
        return out


def _fused(module: nn.Module) -> bool:
    params = dict(module.named_parameters(recurse=False))
    return (
        set(params) == {"gate_up_proj", "down_proj"}
        and params["gate_up_proj"].dim() == params["down_proj"].dim() == 3
        and hasattr(module, "act_fn")
    )


def _layout(model: nn.Module, path: str, module: nn.Module):
    """How the hub's checkpoints of this family store one fused module: (gate, up, down) leaf names,
    the experts' parent path in checkpoints, or None when the split is not gate rows then up rows.
    Read off transformers' reverse conversion of tensors whose values encode (expert, row)."""
    from transformers.core_model_loading import revert_weight_conversion

    E, two_i, _ = module.gate_up_proj.shape
    width = module.down_proj.shape[1]

    def code(rows: int, offset: int) -> torch.Tensor:  # value = expert · 10⁷ + offset + row
        return (torch.arange(E)[:, None, None] * 10**7 + offset + torch.arange(rows)[None, :, None]).double()

    DOWN = 5 * 10**6
    try:
        split = revert_weight_conversion(
            model, {f"{path}.gate_up_proj": code(two_i, 0), f"{path}.down_proj": code(width, DOWN)}
        )
    except Exception:  # a family transformers has no conversion for: not ours to guess
        return None
    names: dict[str, tuple[int, int]] = {}
    parent = None
    for key, t in split.items():
        match = re.fullmatch(r"(.*)\.0\.(\w+)\.weight", key)
        if match and t.dim() == 2 and t.shape[1] == 1:
            parent, leaf = match.groups()
            names[leaf] = (int(t[0, 0].item()), t.shape[0])
    two = two_i // 2
    leaf_of = {place: n for n, place in names.items()}
    gate, up, down = leaf_of.get((0, two)), leaf_of.get((two, two)), leaf_of.get((DOWN, width))
    if gate is None or up is None or down is None or len(split) != 3 * E or parent is None:
        return None
    return (gate, up, down), parent


def unfuse(model: nn.Module) -> int:
    """Replace every fused experts module of ``model`` by ``LinearExperts`` (meta tensors stay meta);
    returns how many were replaced. Layouts other than gate-then-up rows stay fused."""
    replaced, layout = 0, None
    for path, module in list(model.named_modules()):
        if not _fused(module):
            continue
        if layout is None:
            layout = _layout(model, path, module)
            if layout is None:
                return 0
        names, checkpoint_path = layout
        gate_up, down = module.gate_up_proj, module.down_proj
        E, two_i, width = gate_up.shape
        inter = two_i // 2
        experts = []
        for e in range(E):
            linears = []
            for weight in (gate_up[e, :inter], gate_up[e, inter:], down[e]):
                linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta", dtype=weight.dtype)
                linear.weight = nn.Parameter(weight.detach().clone(), requires_grad=False)
                linears.append(linear)
            experts.append(Expert(names, *linears, module.act_fn))
        ours = path.rpartition(".")[0].rpartition(".")[2]
        theirs = checkpoint_path.rpartition(".")[0].rpartition(".")[2]
        owner, _, attr = path.rpartition(".")
        setattr(model.get_submodule(owner), attr, LinearExperts(experts, theirs if theirs != ours else None))
        replaced += 1
    return replaced


def expert_path(module: nn.Module, name: str) -> str | None:
    """The expert (``mlp.experts.3``) that the linear ``name`` of ``module`` belongs to, if any."""
    for path in experts_of(module):
        if name.startswith(path + "."):
            return f"{path}.{name[len(path) + 1 :].partition('.')[0]}"
    return None


def sequential_stages(module: nn.Module, groups: list[tuple[str, ...]]) -> list[list[tuple[str, ...]]]:
    """``groups`` one stage each in forward order, except that one projection of every expert of a
    ``LinearExperts`` forms one stage (experts do not feed each other): a true-sequential pass
    then observes a block of E experts in 2 forwards, not 2E."""
    stages: list[list[tuple[str, ...]]] = []
    where: dict[tuple, int] = {}
    for group in groups:
        expert = expert_path(module, group[0])
        if expert is None:
            stages.append([group])
            continue
        key = (expert.rpartition(".")[0], tuple(n[len(expert) :] for n in group))
        if key in where:
            stages[where[key]].append(group)
        else:
            where[key] = len(stages)
            stages.append([group])
    return stages


def experts_of(module: nn.Module) -> dict[str, LinearExperts]:
    return {name: m for name, m in module.named_modules() if isinstance(m, LinearExperts)}


def checkpoint_renames(module: nn.Module, prefix: str = "") -> dict[str, str]:
    """Name prefixes of ``module``'s tensors as the hub's checkpoints of the family write them
    (Mixtral's sparse block is ``mlp`` in transformers 5 and ``block_sparse_moe`` on disk)."""
    renames = {}
    for name, m in experts_of(module).items():
        if m.checkpoint_parent is not None:
            sparse_block = f"{prefix}{name}".rpartition(".")[0]
            renames[sparse_block + "."] = f"{sparse_block.rpartition('.')[0]}.{m.checkpoint_parent}."
    return renames


def routers(module: nn.Module, prefix: str = "") -> list[str]:
    """The routers beside ``module``'s experts: modules with a 2-D ``weight`` that are not linears
    in transformers 5 but are in vLLM, whose ``Linear`` target would otherwise quantize them."""
    found = []
    for name in experts_of(module):
        sparse_block = name.rpartition(".")[0]
        for child_name, child in module.get_submodule(sparse_block).named_children():
            weight = getattr(child, "weight", None)
            if (
                not isinstance(child, (nn.Linear, LinearExperts))
                and isinstance(weight, nn.Parameter)
                and weight.dim() == 2
            ):
                found.append(f"{prefix}{sparse_block}.{child_name}")
    return found


def renamed(key: str, renames: dict[str, str]) -> str:
    for ours, theirs in renames.items():
        if (key + ".").startswith(ours):
            return (theirs + key[len(ours) :]).rstrip(".")
    return key


def count_routed(module: nn.Module, forward) -> dict[str, list[int]]:
    """The tokens the router sends each expert of ``module`` during ``forward()``, by ``LinearExperts`` name."""
    experts = experts_of(module)
    for m in experts.values():
        m.tokens = torch.zeros(m.num_experts, dtype=torch.long)
    try:
        forward()
        return {name: m.tokens.tolist() for name, m in experts.items()}
    finally:
        for m in experts.values():
            m.tokens = None


@contextmanager
def routing_all(module: nn.Module, on: bool = True):
    """Every expert of ``module`` computes on every token while inside (statistics only)."""
    experts = experts_of(module).values()
    for m in experts:
        m.route_all = on
    try:
        yield
    finally:
        for m in experts:
            m.route_all = False


def mark_starved(module: nn.Module, starved: dict[str, list[int]]) -> None:
    for name, m in experts_of(module).items():
        m.starved = frozenset(starved.get(name, ()))


def starved_linears(module: nn.Module) -> set[str]:
    """Names (inside ``module``) of the linears of experts marked as calibrated on too few tokens."""
    return {
        f"{name}.{e}.{leaf}"
        for name, m in experts_of(module).items()
        for e in m.starved
        for leaf in m.get_submodule(str(e)).names
    }
