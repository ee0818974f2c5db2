"""Recipe YAML -> validated ``Recipe``. Every error names its YAML path.

```yaml
description: RTN W4 (one line, shown by `compress recipes`)
model: smollm2-135m            # alias, local folder or hub id
calibration: {source: wikitext2, samples: 128, seqlen: 512}
passes:
  - rtn: {bits: 4, group_size: auto, symmetric: false, ignore: [lm_head]}
evaluation: {ppl: wikitext2, seqlen: 2048, windows: 40}
```
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from . import allocate, kquant
from .formats import gguf_file
from .models import DEFAULT_MODEL
from .passes import REGISTRY, LayerPass, ModelPass, RecipeError


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Calibration(_Strict):
    source: str = "wikitext2"
    samples: int = Field(128, gt=0)
    seqlen: int = Field(512, gt=1)
    # mixture-of-experts models: an expert routed fewer tokens gets the data-free fallback
    min_expert_tokens: int = Field(16, ge=0)
    route_all_experts: bool = False  # every expert computes on every token for statistics
    # what the blocks compute in while calibrating: auto is float32 on a CPU and the model's dtype
    # on a GPU; bfloat16 shortens a CPU sweep where the CPU multiplies bf16 in hardware (AVX512-BF16
    # or AMX), computing as a GPU does (measured: docs/results.md, "AWQ W4 in five minutes")
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"


class Evaluation(_Strict):
    ppl: str | None = "wikitext2"
    seqlen: int = Field(2048, gt=1)
    windows: int = Field(40, gt=0)
    kl: bool = True  # KL divergence and top-1 agreement against the uncompressed model
    # lm-evaluation-harness tasks scored after perplexity (compress.tasks), beside the dense model's
    tasks: list[str] = []
    task_limit: int | None = Field(None, gt=0)  # the first N documents of each task
    num_fewshot: int | None = Field(None, ge=0)  # None: each task's own


class Export(_Strict):
    """compressed-tensors always; ``format: gguf`` adds a llama.cpp file of the same weights."""

    format: Literal["compressed-tensors", "gguf"] = "compressed-tensors"
    type: str | None = None  # gguf: q4_0, q4_1, q8_0, or a k-quant q2_k ... q6_k
    embedding: Literal["dense", "q8_0"] = "dense"  # gguf: token_embd (and a dense output) as Q8_0

    @model_validator(mode="after")
    def _type(self):
        if self.format == "gguf" and self.type is None:
            raise ValueError(f"format gguf needs a type: one of {', '.join(gguf_file.TYPES)}")
        if self.format == "gguf" and (problem := gguf_file.type_problem(self.type)):
            raise ValueError(problem)
        if self.format != "gguf" and (self.type is not None or self.embedding != "dense"):
            raise ValueError("type and embedding are options of format: gguf")
        return self


class Allocate(_Strict):
    """Each quantized linear's scheme chosen to a bits-per-weight budget (``compress.allocate``)."""

    # the whole model's, scales and zero-points counted as stored; or a GGUF k-quant file type: its size
    target_bpw: float | str
    # None: allocate.DEFAULT_CANDIDATES, or GGUF_CANDIDATES for a recipe that exports GGUF k-quants
    candidates: list[str] | None = Field(None, min_length=1)
    measure: Literal["fisher"] = "fisher"  # the predicted loss increase (compress/allocate.py)
    samples: int = Field(16, gt=0)  # calibration samples the costs are measured on

    @field_validator("target_bpw")
    @classmethod
    def _target(cls, value):
        if isinstance(value, str) and value.lower() in gguf_file.MIX_BASE:
            return value.lower()
        try:
            bits = float(value)
        except ValueError:
            raise ValueError(
                f"{value!r} is neither a number of bits per weight nor a GGUF k-quant type "
                f"({', '.join(gguf_file.MIX_BASE)})"
            ) from None
        if not 0 < bits < float("inf"):
            raise ValueError(f"give a positive number of bits per weight; got {value}")
        return bits

    @field_validator("candidates")
    @classmethod
    def _candidates(cls, value):
        if value is not None:
            allocate.check_candidates(value)
            if len(set(value)) != len(value):
                raise ValueError("a candidate is listed twice")
        return value


class _RecipeFields(_Strict):
    description: str = ""
    model: str = DEFAULT_MODEL
    seed: int = Field(0, ge=0, lt=2**63)  # a torch generator's range
    calibration: Calibration = Calibration()
    passes: list = Field(min_length=1)
    export: Export = Export()
    evaluation: Evaluation = Evaluation()
    allocate: Allocate | None = None


class Recipe:
    def __init__(self, fields: _RecipeFields, passes: list[LayerPass], text: str, name: str):
        self.fields = fields
        self.passes = passes
        self.text = text  # the YAML as written, copied into the export
        self.name = name
        self.source: Path | None = None  # the file it was read from (``load``)

    def __getattr__(self, key):
        return getattr(self.fields, key)

    @property
    def needs_data(self) -> bool:
        return any(p.needs_data for p in self.passes) or self.fields.allocate is not None

    def with_budget(self, target_bpw: float) -> Recipe:
        """This recipe with ``allocate.target_bpw`` set (``apply --target-bpw``): the recipe's own
        candidates, or the defaults."""
        try:
            target_bpw = Allocate._target(target_bpw)
        except ValueError as e:
            raise RecipeError(f"--target-bpw: {e}") from None
        spec = (self.fields.allocate or Allocate(target_bpw=target_bpw)).model_copy(update={"target_bpw": target_bpw})
        fields = self.fields.model_copy(update={"allocate": spec})
        _check_allocate(fields, self.passes)
        recipe = Recipe(fields, self.passes, self.text, self.name)
        recipe.source = self.source
        return recipe


def _format(err: ValidationError, prefix: str = "") -> str:
    first = err.errors()[0]
    path = prefix
    for part in first["loc"]:
        if isinstance(part, str) and not part.isprintable():  # a key with a newline in it: quoted, on one line
            part = repr(part)
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    msg = first["msg"].removeprefix("Value error, ")
    if first["type"] == "extra_forbidden":
        msg = "unknown key"
    elif "input" in first and not isinstance(first["input"], (dict, list)):
        msg += f" (got {first['input']!r})"
    return f"{path or 'recipe'}: {msg}"


def _parse_pass(i: int, entry) -> LayerPass:
    where = f"passes[{i}]"
    if not isinstance(entry, dict) or len(entry) != 1:
        raise RecipeError(f"{where}: each pass is a mapping with one key, the pass name, e.g. '- rtn: {{bits: 4}}'")
    ((name, options),) = entry.items()
    if name not in REGISTRY:
        raise RecipeError(f"{where}: unknown pass {name!r}; known passes: {', '.join(sorted(REGISTRY))}")
    cls = REGISTRY[name]
    try:
        opts = cls.Options.model_validate(options or {})
    except ValidationError as e:
        raise RecipeError(_format(e, f"{where}.{name}")) from None
    return cls(opts, f"{where}.{name}")


class _UniqueKeys(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping (the last would silently win)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if key in seen:
                mark = key_node.start_mark
                raise RecipeError(
                    f"line {mark.line + 1}: the key {key!r} is given twice in one mapping; keep one"
                ) from None
            seen.add(key)
        return super().construct_mapping(node, deep)


MAX_RECIPE_BYTES = 1 << 20  # a recipe is a few lines: anything larger is not one


def parse(text: str, name: str = "recipe") -> Recipe:
    if len(text) > MAX_RECIPE_BYTES:
        raise RecipeError(f"{name}: {len(text) / 1e6:.1f} MB is not a recipe (at most 1 MB of YAML)")
    try:
        data = yaml.load(text, Loader=_UniqueKeys)  # noqa: S506 (a SafeLoader)
    except RecipeError as e:
        raise RecipeError(f"{name}: {e}") from None
    except RecursionError:
        raise RecipeError(f"{name}: nested too deeply to be a recipe") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise RecipeError(f"{name}: not valid YAML{where} ({problem})") from None
    if not isinstance(data, dict):
        raise RecipeError(f"{name}: a recipe is a YAML mapping with at least a 'passes' list")
    try:
        fields = _RecipeFields.model_validate(data)
        passes = [_parse_pass(i, entry) for i, entry in enumerate(fields.passes)]
    except ValidationError as e:
        raise RecipeError(_format(e)) from None
    except RecursionError:
        raise RecipeError(f"{name}: nested too deeply to be a recipe") from None
    for i, p in enumerate(passes):
        if problem := p.order_problem(passes[:i], passes[i + 1 :]) or _after_rounding(p, passes[:i]):
            raise RecipeError(f"{p.where}: {problem}")
    _check_allocate(fields, passes)
    if fields.export.format == "gguf":
        _check_gguf(passes, fields.export.type)
    elif kquants := [p for p in passes if p.rounding is not None and p.rounding.format in kquant.TYPES]:
        k = kquants[0].rounding.format
        raise RecipeError(f"{kquants[0].where}.format: {k} is a GGUF type; add export: {{format: gguf, type: {k}}}")
    return Recipe(fields, passes, text, name)


def _check_allocate(fields: _RecipeFields, passes: list[LayerPass]) -> None:
    if fields.allocate is None:
        return
    spec, export = fields.allocate, fields.export
    gguf = export.format == "gguf"
    if gguf and export.type not in gguf_file.MIX_BASE:
        raise RecipeError(
            f"allocate: a {export.type} GGUF file has one block type for every linear; allocate chooses among "
            "k-quant types: export a k-quant type (e.g. type: q4_k_m) or drop export: {format: gguf}"
        )
    if spec.candidates is not None and allocate.check_candidates(spec.candidates) != gguf:
        kind = "GGUF k-quant types (q2_k ... q6_k)" if gguf else "integer schemes (e.g. w4g128)"
        raise RecipeError(f"allocate.candidates: this recipe exports {export.format}; its candidates are {kind}")
    if isinstance(spec.target_bpw, str) and not gguf:
        raise RecipeError(
            f"allocate.target_bpw: {spec.target_bpw} is the size of a GGUF file; this recipe exports "
            f"{export.format}: give a number of bits per weight"
        )
    if not any(p.rounds for p in passes):
        raise RecipeError("allocate: no pass of this recipe rounds weights to integers; add one (e.g. gptq)")


def _after_rounding(p: LayerPass, before: list[LayerPass]) -> str | None:
    """A block pass that changes weights a quantizer before it rounded would leave them off its grid
    (and the export would write the old integers)."""
    rounded = [q for q in before if q.rounds]
    if rounded and p.compresses and not p.corrects_rounding and not isinstance(p, ModelPass):
        awq = rounded[-1].name == "awq"
        hint = "; to combine AWQ's scales with a later quantizer, give awq quantize: false" if awq else ""
        return f"changes weights that {rounded[-1].where} has already rounded; put it before the quantizer{hint}"
    return None


def _check_gguf(passes: list[LayerPass], gguf_type: str) -> None:
    """The GGUF file's rules for each pass (``gguf_file.adapt``), as errors naming the pass."""
    for p in passes:
        if problem := gguf_file.adapt(p, gguf_type):
            raise RecipeError(f"{p.where}: {problem}")


def load(path: str | Path) -> Recipe:
    path = Path(path)
    if not path.exists():
        shipped = RECIPES_DIR / path
        if path.suffix != ".yaml":
            shipped = RECIPES_DIR / f"{path}.yaml"
        if not shipped.exists():
            raise RecipeError(f"no recipe file {path}; `compress recipes` lists the shipped ones")
        path = shipped
    if not path.is_file():
        raise RecipeError(f"recipe {path} is a folder, not a file; give a .yaml file or a shipped recipe's name")
    if path.stat().st_size > MAX_RECIPE_BYTES:
        raise RecipeError(f"recipe {path} is {path.stat().st_size / 1e6:.1f} MB, not a recipe (at most 1 MB of YAML)")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise RecipeError(f"recipe {path} is not a UTF-8 text file; give a YAML recipe") from None
    except OSError as e:
        raise RecipeError(f"recipe {path} cannot be read ({e.strerror})") from None
    recipe = parse(text, path.stem)
    recipe.source = path
    return recipe


RECIPES_DIR = Path(__file__).resolve().parent.parent / "recipes"


_FLOAT_NAMES = {"fp8": "FP8", "fp8_block": "FP8-block", "nvfp4": "NVFP4", "mxfp4": "MXFP4"}


def stores(recipe: Recipe) -> str:
    """What a recipe leaves, in the field's shorthand: weights (W4, W-NVFP4), inputs (A8, A-FP8),
    KV cache (KV4, KV-FP8), sparsity, low rank, adapters and draft heads; "dense" when it changes
    nothing."""
    weights = inputs = None
    extra = []
    for p in recipe.passes:
        o, rounding = p.options, p.rounding
        if rounding is not None:
            if rounding.format in kquant.TYPES:  # a mix of types: the file's name for it
                weights = f"GGUF {recipe.export.type.upper()}"
            else:
                weights = f"W{rounding.bits}" if rounding.format == "int" else f"W-{_FLOAT_NAMES[rounding.format]}"
        if p.name == "qlora" and p.weight_bits:
            weights = "W-NF4"
        if rounding is not None and recipe.allocate is not None:
            budget = recipe.allocate.target_bpw
            weights = f"W mixed, size of {budget.upper()}" if isinstance(budget, str) else f"W mixed {budget} bpw"
        if p.name == "smoothquant":
            inputs = "A8"
        elif p.name == "activations":
            inputs = f"A{o.bits}" if o.format == "int" else f"A-{_FLOAT_NAMES[o.format]}"
        elif p.name == "kv_cache":
            extra.append(f"KV{o.bits}")
        elif p.name == "kv_fp8":
            extra.append("KV-FP8")
        elif p.name == "lowrank":
            extra.append(f"rank: {o.ratio:.0%} of params")
        elif p.name in ("lorc", "qlora"):
            extra.append("+LoRA")
        elif p.name == "eagle":
            extra.append("+EAGLE head")
        pattern = getattr(o, "pattern", None)
        if pattern is not None:
            extra.append(pattern if ":" in pattern else f"{o.sparsity or 0.5:.0%} sparse")
    return " ".join(t for t in (weights, inputs, *dict.fromkeys(extra)) if t) or "dense"


def shipped() -> list[tuple[str, str, str]]:
    """(name, what it stores, one-line description) of every recipe in recipes/."""
    out = []
    for path in sorted(RECIPES_DIR.glob("*.yaml")):
        recipe = load(path)
        out.append((path.stem, stores(recipe), str(recipe.fields.description or "").strip()))
    return out
