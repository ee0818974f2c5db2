"""The toy method in docs/design.md ("Adding a method") runs as written."""

import re
from pathlib import Path

import torch

from compress.pipeline import run_sequential
from tests.conftest import tiny


def test_documented_toy_pass_runs():
    doc = (Path(__file__).parent.parent / "docs" / "design.md").read_text()
    code = re.search(r"```python\n(# compress/passes/pow2.py\n.*?)```", doc, re.S).group(1)
    namespace = {}
    exec(compile(code, "docs/design.md", "exec"), namespace)
    Pow2 = namespace["Pow2"]
    model = tiny("llama")
    p = Pow2(Pow2.Options(min_input_norm=0.0), "passes[0].pow2")
    p.check(model)
    run_sequential(model, torch.randint(0, 128, (2, 16)), [p], torch.device("cpu"))
    w = model.model.layers[0].mlp.down_proj.weight.abs()
    assert torch.allclose(torch.log2(w), torch.round(torch.log2(w)))
