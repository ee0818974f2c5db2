"""The toy method in docs/design.md ("Adding a method") runs as written: registered, named in a
recipe, applied and exported by ``compress apply``."""

import re
from pathlib import Path

import torch
from safetensors import safe_open

from compress.apply import apply
from compress.passes import REGISTRY
from compress.recipe import parse
from tests.conftest import tiny_folder


def test_documented_toy_pass_runs_from_a_recipe(tmp_path, monkeypatch, smollm2):
    doc = (Path(__file__).parent.parent / "docs" / "design.md").read_text()
    code = re.search(r"```python\n(# compress/passes/pow2.py\n.*?)```", doc, re.S).group(1)
    namespace = {}
    exec(compile(code, "docs/design.md", "exec"), namespace)
    monkeypatch.setitem(REGISTRY, "pow2", namespace["Pow2"])  # the one line in compress/passes/__init__.py
    recipe = parse("passes:\n  - pow2: {min_input_norm: 0.0}\ncalibration: {samples: 4, seqlen: 32}\n", "pow2")
    model = tiny_folder(tmp_path / "tiny", smollm2.tokenizer)
    out = tmp_path / "out"
    apply(recipe, str(model), out, evaluate_after=False)
    with safe_open(out / "model.safetensors", "pt") as f:
        w = f.get_tensor("model.layers.0.mlp.down_proj.weight").float().abs()
        head = f.get_tensor("lm_head.weight").float().abs() if "lm_head.weight" in f.keys() else None
    assert torch.allclose(torch.log2(w), torch.round(torch.log2(w)))
    assert head is None or not torch.allclose(torch.log2(head), torch.round(torch.log2(head)))  # ignored: lm_head
