"""Every shipped recipe exports, byte for byte, what it exported when the hashes were recorded
(``scripts/export_hashes.py``): a change of the code's layout changes no user's files. Hashes are
kept per machine (floating-point sums differ between CPUs); on a machine with none recorded the
test says how to record them and skips."""

from pathlib import Path

import pytest


@pytest.mark.slow
def test_every_shipped_recipe_exports_the_recorded_bytes_on_tiny_models(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "scripts"))
    import json

    import export_hashes

    table = json.loads(export_hashes.TABLE.read_text())
    recorded = table.get(export_hashes.machine_key())
    if recorded is None:
        pytest.skip(
            f"no export hashes recorded for {export_hashes.machine_key()}: "
            "run `python scripts/export_hashes.py --write` on a commit whose exports are trusted"
        )
    measured = export_hashes.measure(smollm2=False)
    assert set(measured) == {"tiny-llama", "tiny-moe"}
    unrecorded = {f"{m} {r}" for m, by_recipe in measured.items() for r in by_recipe if r not in recorded.get(m, {})}
    assert not unrecorded, f"record these with scripts/export_hashes.py --write --recipes NAME: {sorted(unrecorded)}"
    assert export_hashes.compare(recorded, measured) == []
