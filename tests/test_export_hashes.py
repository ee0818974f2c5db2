"""Every shipped recipe exports, byte for byte, what it exported when the hashes were recorded
(``scripts/export_hashes.py``): a change of the code's layout changes no user's files. Hashes are
kept per kind of numerics (floating-point sums differ between CPUs; ``export_hashes.numerics``), so
a recipe is compared where it was recorded; every shipped recipe must be recorded on at least one."""

import json
from pathlib import Path

import pytest

from compress import recipe as recipes

TABLE = Path(__file__).parent / "data" / "export_hashes.json"
TINY_MODELS = ("tiny-llama", "tiny-moe")


def test_every_shipped_recipe_has_export_hashes_recorded_on_some_machine():
    table = json.loads(TABLE.read_text())
    recorded = {(m, r) for by_model in table.values() for m in TINY_MODELS for r in by_model.get(m, {})}
    missing = [f"{m} {name}" for name, *_ in recipes.shipped() for m in TINY_MODELS if (m, name) not in recorded]
    assert not missing, f"record these with scripts/export_hashes.py --write --recipes NAME: {missing}"


@pytest.mark.slow
def test_every_recorded_recipe_exports_the_recorded_bytes_on_tiny_models(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "scripts"))
    import export_hashes

    recorded = json.loads(TABLE.read_text()).get(export_hashes.machine_key())
    if recorded is None:
        pytest.skip(
            f"no export hashes recorded for {export_hashes.machine_key()}: "
            "run `python scripts/export_hashes.py --write` on a commit whose exports are trusted"
        )
    names = sorted({name for m in TINY_MODELS for name in recorded.get(m, {})})
    measured = export_hashes.measure(smollm2=False, only=names)
    shipped = {name for name, *_ in recipes.shipped()}
    assert {m: set(measured[m]) for m in TINY_MODELS} == {m: set(recorded[m]) & shipped for m in TINY_MODELS}
    assert export_hashes.compare(recorded, measured) == []
