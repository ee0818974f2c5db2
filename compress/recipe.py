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
from typing import Optional

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .models import DEFAULT_MODEL
from .passes import REGISTRY, LayerPass, RecipeError


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Calibration(_Strict):
    source: str = "wikitext2"
    samples: int = Field(128, gt=0)
    seqlen: int = Field(512, gt=1)


class Evaluation(_Strict):
    ppl: Optional[str] = "wikitext2"
    seqlen: int = Field(2048, gt=1)
    windows: int = Field(40, gt=0)
    kl: bool = True  # KL divergence and top-1 agreement against the uncompressed model


class Export(_Strict):
    format: str = Field("compressed-tensors", pattern="^compressed-tensors$")


class _RecipeFields(_Strict):
    description: str = ""
    model: str = DEFAULT_MODEL
    seed: int = 0
    calibration: Calibration = Calibration()
    passes: list = Field(min_length=1)
    export: Export = Export()
    evaluation: Evaluation = Evaluation()


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
        return any(p.needs_data for p in self.passes)


def _format(err: ValidationError, prefix: str = "") -> str:
    first = err.errors()[0]
    path = prefix
    for part in first["loc"]:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    msg = first["msg"]
    if first["type"] == "extra_forbidden":
        msg = "unknown key"
    elif "input" in first and not isinstance(first["input"], (dict, list)):
        msg += f" (got {first['input']!r})"
    return f"{path or 'recipe'}: {msg}"


def _parse_pass(i: int, entry) -> LayerPass:
    where = f"passes[{i}]"
    if not isinstance(entry, dict) or len(entry) != 1:
        raise RecipeError(f"{where}: each pass is a mapping with one key, the pass name, e.g. '- rtn: {{bits: 4}}'")
    (name, options), = entry.items()
    if name not in REGISTRY:
        raise RecipeError(f"{where}: unknown pass {name!r}; known passes: {', '.join(sorted(REGISTRY))}")
    cls = REGISTRY[name]
    try:
        opts = cls.Options.model_validate(options or {})
    except ValidationError as e:
        raise RecipeError(_format(e, f"{where}.{name}")) from None
    return cls(opts, f"{where}.{name}")


def parse(text: str, name: str = "recipe") -> Recipe:
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise RecipeError(f"{name}: not valid YAML{where} ({problem})") from None
    if not isinstance(data, dict):
        raise RecipeError(f"{name}: a recipe is a YAML mapping with at least a 'passes' list")
    try:
        fields = _RecipeFields.model_validate(data)
    except ValidationError as e:
        raise RecipeError(_format(e)) from None
    passes = [_parse_pass(i, entry) for i, entry in enumerate(fields.passes)]
    _check_factoring(passes)
    _check_lorc(passes)
    _check_w8a8(passes)
    _check_recovery(passes)
    return Recipe(fields, passes, text, name)


def _check_lorc(passes: list[LayerPass]) -> None:
    """LoRC corrects a quantization pass before it and is folded into the weights: nothing may follow."""
    from .passes.base import WeightQuantPass
    from .passes.lorc import LoRC
    from .passes.sparsegpt import SparseGPT

    for i, p in enumerate(passes):
        if not isinstance(p, LoRC):
            continue
        if not any(isinstance(q, WeightQuantPass) or (isinstance(q, SparseGPT) and q.options.quantize)
                   for q in passes[:i]):
            raise RecipeError(f"{p.where}: LoRC corrects quantization error; put a quantization pass before it")
        if i != len(passes) - 1:
            raise RecipeError(f"{p.where}: LoRC must be the last pass (its correction is not a quantized weight)")


def _check_w8a8(passes: list[LayerPass]) -> None:
    """int8 activations need int8 weights after them: W8A8 is one kernel (and one export format)."""
    from .passes.base import WeightQuantPass
    from .passes.smoothquant import SmoothQuant

    for i, p in enumerate(passes):
        if isinstance(p, SmoothQuant) and not any(isinstance(q, WeightQuantPass) and q.options.bits == 8
                                                  for q in passes[i + 1:]):
            raise RecipeError(f"{p.where}: int8 activations need int8 weights; follow it with rtn or gptq, bits: 8")


def _check_recovery(passes: list[LayerPass]) -> None:
    """Model passes train the result of the block sweep, so they come after every layer-pass;
    recovery needs something compressed to recover, and LoRA needs a quantized base."""
    from .passes import ModelPass
    from .passes.base import WeightQuantPass
    from .passes.blockwise import Blockwise
    from .passes.kv_cache import KVCachePass
    from .passes.qlora import QLoRA
    from .passes.sparsegpt import SparseGPT

    def quantizes(q):
        return isinstance(q, WeightQuantPass) or (isinstance(q, SparseGPT) and q.options.quantize)

    def compresses(q):
        return not isinstance(q, (ModelPass, Blockwise, KVCachePass))

    for i, p in enumerate(passes):
        if isinstance(p, ModelPass) and (later := [q for q in passes[i + 1:] if not isinstance(q, ModelPass)]):
            raise RecipeError(f"{p.where}: trains the whole compressed model, so it must follow every "
                              f"block pass ({later[0].where} comes after it)")
        if isinstance(p, (ModelPass, Blockwise)) and not any(compresses(q) for q in passes[:i]):
            raise RecipeError(f"{p.where}: recovers what compression lost; put a compression pass before it")
        if (isinstance(p, QLoRA) or "lora" in getattr(p.options, "train", [])) and \
                not any(quantizes(q) for q in passes[:i]):
            raise RecipeError(f"{p.where}: LoRA trains on a frozen quantized base; put a quantization pass before it")


def _check_factoring(passes: list[LayerPass]) -> None:
    """Factored layers are dense pairs that nothing after can transform, and they export in our
    own layout, which cannot carry quantized tensors: factoring comes last and alone."""
    from .passes.lowrank import LowRank

    factoring = [p for p in passes if isinstance(p, LowRank) and not p.options.merge]
    if not factoring:
        return
    others = [p for p in passes if p is not factoring[0] and not isinstance(p, LowRank)]
    if others or len(factoring) > 1:
        raise RecipeError(f"{factoring[0].where}: factored layers cannot be combined with other passes "
                          f"({(others or factoring[1:])[0].where}); set merge: true to export dense weights")


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


def shipped() -> list[tuple[str, str]]:
    """(name, one-line description) of every recipe in recipes/."""
    out = []
    for path in sorted(RECIPES_DIR.glob("*.yaml")):
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        out.append((path.stem, str(data.get("description", "")).strip()))
    return out
