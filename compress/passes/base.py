"""The pass contract, and what weight-quantization and pruning passes share.

A layer-pass is a class with an ``Options`` model (its YAML keys; typos fail)
and two methods: ``check(model)`` validates against the model's shapes before
any compute, ``apply(block, data, prefix)`` transforms one decoder block. The
pipeline owns the data flow; ``data`` is None for passes with ``needs_data = False``.
A pass that needs others before or after it says so in ``order_problem``, which the
recipe parser calls for every pass: a new method is one file and one recipe. What a pass asks of
the pipeline (a Hessian's memory, the block before the passes, the dense model's inputs) is a
declared attribute of ``LayerPass``, set by the passes that need it.
"""

from __future__ import annotations

import importlib.util
import re
import warnings
from dataclasses import replace
from typing import ClassVar, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from .. import kquant, moe
from ..arch import arch_of, block_linears, decoder_layers
from ..formats import gguf_file
from ..quant import BLOCK_ROWS, FORMATS, QuantScheme, attach, global_scale_of, quantize_weight, resolve_group_size
from ..sparsity import Pattern, parse_pattern, prune_by_magnitude


class RecipeError(ValueError):
    """A recipe that cannot run on this model; the message names the YAML path."""


class PassOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")


class LayerPass:
    name: ClassVar[str]
    Options: ClassVar[type[PassOptions]]
    needs_data: ClassVar[bool] = True
    compresses: ClassVar[bool] = True  # changes the weights (recovery and the KV cache do not)
    corrects_rounding: ClassVar[bool] = False  # changes rounded weights on purpose (LoRC), so may follow a quantizer
    data_parallel: ClassVar[bool] = True  # runs with several processes (torchrun); training passes do not
    uses_hessian: ClassVar[bool] = False  # collects XᵀX per linear: the memory plan counts it
    needs_original: bool = False  # the pipeline keeps each block as it was before the passes
    needs_dense_inputs: bool = False  # the pipeline carries the dense model's inputs to each block too
    # observes every linear of a block in one forward, so holds all their statistics at once (the
    # memory plan adds them up); a true-sequential sweep holds one group's at a time
    holds_block_statistics: bool = False
    whole_model: bool = False  # reads every block at once (training), so the run holds the whole model
    # the kinds of state (``state.KINDS`` attributes) this pass may attach: a format that cannot
    # store one of them refuses the pass when the recipe is read
    leaves: ClassVar[frozenset[str]] = frozenset()

    def __init__(self, options: PassOptions, where: str):
        self.options = options
        self.where = where  # YAML path of this pass, e.g. "passes[0].rtn"
        self.log: dict = {}  # what training passes record (losses), kept in the report and for --resume

    @property
    def weight_bits(self) -> int | None:
        """The bits of the integer weights this pass leaves (None: it rounds no weights)."""
        return None

    @property
    def rounding(self):
        """The integer scheme (``bits``, ``group_size``, ``symmetric``) this pass rounds weights to, or None."""
        return None

    @property
    def rounds(self) -> bool:
        """Whether it leaves the weights rounded, which a later compression pass would undo."""
        return self.rounding is not None

    def order_problem(self, before: list[LayerPass], after: list[LayerPass]) -> str | None:
        """What is wrong with this pass's place among the recipe's passes, or None."""
        return None

    def check(self, model: torch.nn.Module) -> None:
        pass

    def prepare(self, model) -> None:
        """Before any block of the ``StreamedModel`` is read for calibration: a pass that changes the
        model every reader sees (``rotate``) does it here. Called once per model."""

    def fit(self, model, ids: torch.Tensor | None, passes: list[LayerPass], device: torch.device) -> None:
        """After ``prepare``, with the calibration samples, before any block is compressed: a pass
        that learns something of the whole model first (learned rotations) does it here."""

    def apply(self, block: torch.nn.Module, data, prefix: str) -> None:
        raise NotImplementedError

    def without_data(self, block: torch.nn.Module, prefix: str) -> None:
        """What the pass does, after ``apply``, to the linears of experts calibrated on too few tokens
        (which ``LinearPass.targets`` leaves out): by default nothing, they stay dense; quantizers
        round them to nearest, pruners prune them by magnitude."""

    def summary(self) -> str:
        return self.name


def recovery_problem(recovery: LayerPass, before: list[LayerPass]) -> str | None:
    """Recovery needs something compressed to recover, and LoRA needs a quantized base."""
    if not any(q.compresses for q in before):
        return "recovers what compression lost; put a compression pass before it"
    train = getattr(recovery.options, "train", [])
    if "lora" in train and not any(q.weight_bits for q in before):
        return "LoRA trains on a frozen quantized base; put a quantization pass before it"
    floats = [q for q in before if q.rounding is not None and q.rounding.format != "int"]
    if "scales" in train and floats:
        return (
            f"trains integer scales, but {floats[0].where} stores {floats[0].rounding.format} scales on a grid of "
            "their own; drop scales from train"
        )
    return None


class ModelPass(LayerPass):
    """A pass over the whole model after the block sweep (recovery training): it gets the
    compressed model, the original as teacher, and the calibration ids."""

    compresses = False
    data_parallel = False
    whole_model = True
    needs_teacher = True  # trains against the original model (an EAGLE head reads only the compressed one)

    def order_problem(self, before, after):
        if later := [q for q in after if not isinstance(q, ModelPass)]:
            return (
                f"trains the whole compressed model, so it must follow every block pass "
                f"({later[0].where} comes after it)"
            )
        return recovery_problem(self, before)

    def apply(self, block, data, prefix: str) -> None:
        raise TypeError(f"{self.where} is a model pass; the pipeline calls apply_model")

    def apply_model(
        self, model: torch.nn.Module, teacher: torch.nn.Module, ids: torch.Tensor, device: torch.device, tokenizer=None
    ) -> None:
        raise NotImplementedError


class RecoveryOptions(PassOptions):
    """Training options shared by the recovery passes (``compress/recovery.py``)."""

    train: list[Literal["scales", "norms", "weights", "lora"]] = ["scales", "norms"]
    steps: int = Field(200, gt=0)
    lr: float = Field(1e-3, gt=0)  # scales (a multiplier starting at 1), norms and LoRA factors
    weight_lr: float = Field(3e-5, gt=0)  # raw weights, which are ~100x smaller than a scale multiplier
    batch: int = Field(1, gt=0)  # calibration samples per step
    # adamw8bit: bitsandbytes' AdamW with its two moments in 8 bits (blockwise quantized, Dettmers et
    # al. 2022): 2 bytes of state per trained value instead of 8
    optimizer: Literal["adamw", "adamw8bit"] = "adamw"

    @field_validator("optimizer")
    @classmethod
    def _installed(cls, v):
        if v == "adamw8bit" and importlib.util.find_spec("bitsandbytes") is None:
            raise ValueError("adamw8bit needs the bitsandbytes package: pip install bitsandbytes (or use adamw)")
        return v

    @field_validator("train")
    @classmethod
    def _some(cls, v):
        if not v:
            raise ValueError("name at least one of scales, norms, weights, lora")
        return v


def matches(name: str, pattern: str) -> bool:
    """``re:<regex>`` (searched), an exact module name, or a dotted suffix (``lm_head``, ``mlp.down_proj``)."""
    if pattern.startswith("re:"):
        return re.search(pattern[3:], name) is not None
    return name == pattern or name.endswith("." + pattern)


class LinearOptions(PassOptions):
    ignore: list[str] = ["lm_head"]

    @field_validator("ignore")
    @classmethod
    def _patterns(cls, patterns):
        for p in patterns:
            if p.startswith("re:"):
                try:
                    re.compile(p[3:])
                except re.error as e:
                    raise ValueError(f"{p!r} is not a regular expression ({e})") from None
        return patterns


class QuantSpec(PassOptions):
    """A weight quantization scheme as written in a recipe (``group_size: auto`` resolved at check)."""

    bits: Literal[2, 3, 4, 8] = 4
    group_size: Literal["auto"] | int = "auto"
    # Symmetric by default: transformers 5 + compressed-tensors 0.20 cannot reload asymmetric
    # pack-quantized checkpoints (vLLM can); see docs/limits.md.
    symmetric: bool = True
    # how a group's scale is chosen: its min/max, or the clipped range that rounds best (``quant``)
    observer: Literal["minmax", "mse"] = "minmax"
    # the grid: integers, or a float format GPU servers run (``quant``), which fixes bits and group size
    # or a GGUF k-quant (``compress/kquant.py``), which fixes bits, group size and symmetry
    format: Literal[
        "int", "fp8", "fp8_block", "nvfp4", "mxfp4", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "q4_1", "q5_1"
    ] = "int"

    @field_validator("group_size")
    @classmethod
    def _group(cls, v):
        if v != "auto" and v != -1 and v <= 0:
            raise ValueError("must be auto, -1 (one scale per output channel) or a positive group size")
        return v

    @model_validator(mode="after")
    def _fixed_format(self):
        """A float format or k-quant fixes bits and group size (a k-quant its symmetry too)."""
        if self.format == "int":
            return self
        bits, group, _ = FORMATS[self.format]
        given = self.model_fields_set
        reshaped = (
            "bits" in given and self.bits != bits or "group_size" in given and self.group_size not in ("auto", group)
        )
        if self.format in kquant.TYPES:
            symmetric = kquant.TYPES[self.format].symmetric
            fixed = f"{self.format} stores {bits}-bit {'' if symmetric else 'a'}symmetric integers in groups of {group}"
            if reshaped:
                raise ValueError(f"{fixed}: drop bits and group_size")
            if "symmetric" in given and self.symmetric != symmetric:
                raise ValueError(f"{fixed}: drop symmetric")
            self.bits, self.group_size, self.symmetric = bits, group, symmetric
            return self
        per = "per channel" if group == -1 else f"per {group} weights"
        per = f"per tile of {BLOCK_ROWS} × {group} weights" if self.format == "fp8_block" else per
        fixed = f"{self.format} stores {bits}-bit values with one scale {per}"
        if reshaped:
            raise ValueError(f"{fixed}: drop bits and group_size (or set bits: {bits}, group_size: {group})")
        if not self.symmetric:
            raise ValueError(f"{self.format} is symmetric: drop symmetric: false")
        self.bits, self.group_size = bits, group
        return self


class WeightQuantOptions(QuantSpec, LinearOptions):
    pass


def _shape_pattern(name: str) -> str:
    return re.sub(r"\.\d+\.", ".*.", name)


def _listed(bad: list[tuple[str, int]]) -> str:
    listed = ", ".join(f"{n} (in_features {w})" for n, w in bad[:4])
    return listed + (f" and {len(bad) - 4} more" if len(bad) > 4 else "")


def resolve_scheme(spec: QuantSpec, widths: dict[str, tuple[int, int]], where: str) -> QuantScheme:
    """The scheme for layers of these (input, output) widths; a group size that does not divide one names it."""
    if spec.format == "fp8_block":
        tile = FORMATS["fp8_block"][1]
        bad = sorted({(_shape_pattern(n), w) for n, w in widths.items() if w[0] % tile or w[1] % BLOCK_ROWS})
        if bad:
            listed = ", ".join(f"{n} ({i} × {o})" for n, (i, o) in bad[:4]) + (" and more" if len(bad) > 4 else "")
            raise RecipeError(
                f"{where}.format: fp8_block tiles weights {BLOCK_ROWS} × {tile}, which do not fit (inputs × outputs) "
                f"{listed}; add those linears to ignore, or use format: fp8 (a scale per channel)"
            )
    widths = {n: w[0] for n, w in widths.items()}
    g = resolve_group_size(spec.group_size, list(widths.values()))
    if g != -1:
        bad = sorted({(_shape_pattern(n), w) for n, w in widths.items() if w % g})
        if bad:
            raise RecipeError(
                f"{where}.group_size: {g} does not divide the input width of {_listed(bad)}; "
                "use group_size: auto, -1, or a divisor of every width"
            )
    scheme = QuantScheme(spec.bits, g, spec.symmetric, observer=spec.observer, format=spec.format)
    if not scheme.symmetric and not scheme.is_kquant:
        warnings.warn(
            f"{where}.symmetric: false exports zero-points that vLLM reads but transformers "
            "5 with compressed-tensors 0.20 cannot reload (see docs/limits.md)",
            stacklevel=3,
        )
    return scheme


def gguf_scheme(gguf_type: str, observer: str) -> QuantScheme:
    """The scheme of one GGUF type: a k-quant, or a legacy block type with float16 scales."""
    if gguf_type in kquant.TYPES:
        t = kquant.TYPES[gguf_type]
        return QuantScheme(t.bits, t.group, t.symmetric, observer=observer, format=gguf_type)
    legacy = gguf_file.LEGACY[gguf_type]
    return QuantScheme(legacy.bits, gguf_file.GROUP, legacy.symmetric, fp16_scales=True, observer=observer)


def gguf_schemes(scheme: QuantScheme, mix: str | None, widths: dict, where: str, config) -> dict[str, QuantScheme]:
    """The layers whose scheme is not the pass's k-quant: those a GGUF ``mix`` gives more bits, as
    llama.cpp's quantizer does (``gguf_file.mix_type``), and those whose input width is not whole
    super-blocks of 256, which take the type llama.cpp falls back to (``kquant.FALLBACK``)."""
    if not scheme.is_kquant:
        return {}
    layers, heads = config.num_hidden_layers, config.num_attention_heads
    gqa = heads // (getattr(config, "num_key_value_heads", None) or heads)
    out, fallen = {}, {}
    for name, (width, _) in widths.items():
        layer = int(re.search(r"\.(\d+)\.", name).group(1))
        chosen = gguf_file.mix_type(mix or scheme.format, name, layer, layers, gqa)
        if width % kquant.TYPES[chosen].super:
            chosen = fallen[name] = kquant.FALLBACK[chosen]
        if chosen != scheme.format:
            out[name] = gguf_scheme(chosen, scheme.observer)
    if fallen:
        kinds = ", ".join(sorted(set(fallen.values())))
        warnings.warn(
            f"{where}: {_listed(sorted({(_shape_pattern(n), widths[n][0]) for n in fallen}))} are not whole "
            f"super-blocks of {kquant.SUPER} inputs; they take {kinds}, as llama.cpp does",
            stacklevel=3,
        )
    return out


class LinearPass(LayerPass):
    """A pass over the linears of each block, minus ``ignore``; remembers the storage dtype."""

    Options = LinearOptions
    dtype: torch.dtype
    fp16_scales: bool = False  # set by a format whose scales are float16 (``gguf_file.adapt``)
    gguf_type: str | None = None  # set by ``gguf_file.adapt`` for a k-quant file: its mix sets each layer's scheme

    def targets(self, block: torch.nn.Module, prefix: str, starved: bool = False) -> dict[str, torch.nn.Linear]:
        """The block's linears this pass changes, minus ``ignore``. A pass that needs data leaves out the
        experts calibrated on too few tokens (``moe.starved_linears``); ``starved`` asks for those instead."""
        left_out = moe.starved_linears(block) if self.needs_data else set()
        return {
            name: lin
            for name, lin in block_linears(block, self.arch).items()
            if not any(matches(prefix + name, p) for p in self.options.ignore) and (name in left_out) == starved
        }

    def target_groups(self, targets: dict) -> list[tuple[str, ...]]:
        """The architecture's input-sharing groups restricted to ``targets``, in forward order."""
        return [g for g in (tuple(n for n in grp if n in targets) for grp in self.arch.groups) if g]

    def check(self, model: torch.nn.Module) -> None:
        """Resolve targets on the model; ``self.widths`` maps each targeted linear to its (input, output) widths."""
        self.arch = arch_of(model)
        self.dtype = model.dtype  # storage dtype: scales are rounded to it (blocks may compute in float32)
        prefix = self.arch.layers + "."
        all_names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
        for pattern in self.options.ignore:
            if not any(matches(n, pattern) for n in all_names):
                warnings.warn(f"{self.where}.ignore: pattern {pattern!r} matches no linear layer", stacklevel=2)
        self.widths = {
            f"{prefix}{i}.{name}": (lin.in_features, lin.out_features)
            for i, block in enumerate(decoder_layers(model))
            for name, lin in self.targets(block, f"{prefix}{i}.").items()
        }
        if not self.widths:
            raise RecipeError(f"{self.where}.ignore: every linear layer is ignored, the pass would do nothing")


class WeightQuantPass(LinearPass):
    """Weight quantizers: a ``QuantScheme`` checked against every targeted layer's width."""

    Options = WeightQuantOptions
    leaves = frozenset({"quantized"})
    scheme: QuantScheme

    @property
    def weight_bits(self) -> int:
        return self.options.bits

    @property
    def rounding(self):
        return self.options

    def check(self, model: torch.nn.Module) -> None:
        super().check(model)
        self.scheme = replace(resolve_scheme(self.options, self.widths, self.where), fp16_scales=self.fp16_scales)
        self.schemes = gguf_schemes(self.scheme, self.gguf_type, self.widths, self.where, model.config)

    def scheme_for(self, name: str) -> QuantScheme:
        """The scheme of the linear ``name`` (its full name): the pass's, or the one a GGUF mix or fallback gives it."""
        return self.schemes.get(name, self.scheme)

    def without_data(self, block: torch.nn.Module, prefix: str) -> None:
        self.round_to_nearest(self.targets(block, prefix, starved=True), prefix)

    def round_to_nearest(self, linears: dict[str, torch.nn.Linear], prefix: str) -> None:
        """Round ``linears`` to the nearest grid values. NVFP4's global scale is shared by the linears
        that read one input (q/k/v, gate/up): vLLM fuses them into one matmul under one global scale."""
        shared = {}
        if self.scheme.format == "nvfp4":
            for group in self.target_groups(linears):
                lowest = torch.cat([global_scale_of(linears[n].weight) for n in group]).min()
                shared |= dict.fromkeys(group, lowest.reshape(1))
        for name, lin in linears.items():
            global_scale = shared[name].clone() if name in shared else None  # each its own tensor (resume files)
            attach(lin, quantize_weight(lin.weight.data, self.scheme_for(prefix + name), self.dtype, global_scale))

    def summary(self) -> str:
        return f"{self.name} {self.scheme.describe()}"


class PruneOptions(LinearOptions):
    pattern: str = "unstructured"  # or N:M, e.g. 2:4 (at most 2 non-zeros in every 4 inputs)
    sparsity: float | None = None  # unstructured: the share pruned (default 0.5); N:M fixes it
    skip_indivisible: bool = False  # N:M on a layer whose width M does not divide: skip it instead of failing

    @model_validator(mode="after")
    def _pattern(self):
        parse_pattern(self.pattern, self.sparsity)  # a ValueError here names the pass's YAML path
        return self


class PrunePass(LinearPass):
    """Pruning passes: a sparsity ``Pattern``, checked against every targeted layer's width."""

    Options = PruneOptions
    leaves = frozenset({"prune_mask"})
    pattern: Pattern
    skipped: frozenset[str] = frozenset()

    def targets(self, block: torch.nn.Module, prefix: str, starved: bool = False) -> dict[str, torch.nn.Linear]:
        return {n: lin for n, lin in super().targets(block, prefix, starved).items() if prefix + n not in self.skipped}

    def without_data(self, block: torch.nn.Module, prefix: str) -> None:
        for lin in self.targets(block, prefix, starved=True).values():
            prune_by_magnitude(lin, self.pattern)
            if getattr(self, "scheme", None) is not None:  # SparseGPT's joint rounding
                attach(lin, quantize_weight(lin.weight.data, self.scheme, self.dtype))

    def check(self, model: torch.nn.Module) -> None:
        super().check(model)
        self.pattern = parse_pattern(self.options.pattern, self.options.sparsity)
        m = self.pattern.m
        bad = {n: w for n, (w, _) in self.widths.items() if m and w % m}
        if bad and not self.options.skip_indivisible:
            raise RecipeError(
                f"{self.where}.pattern: {self.options.pattern} needs input widths divisible by {m}, "
                f"not so for {_listed(sorted({(_shape_pattern(n), w) for n, w in bad.items()}))}; "
                "set skip_indivisible: true to leave them dense, or ignore them"
            )
        if bad:
            warnings.warn(f"{self.where}: {len(bad)} layers with widths not divisible by {m} stay dense", stacklevel=2)
            self.skipped = frozenset(bad)
            self.widths = {n: w for n, w in self.widths.items() if n not in bad}
            if not self.widths:
                raise RecipeError(f"{self.where}: no targeted layer has a width divisible by {m}")

    def summary(self) -> str:
        return f"{self.name} {self.pattern.describe()}"
