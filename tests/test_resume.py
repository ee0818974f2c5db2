"""``apply --resume``: a run that stops after some blocks, resumed, writes the export an
uninterrupted run writes, byte for byte, whatever the passes left on the blocks."""

import json
import subprocess
import sys

import pytest
from conftest import tiny_folder

from compress import resume
from compress.apply import apply
from compress.recipe import parse
from compress.resume import BlockCheckpoints, ResumeError

DATA = "calibration: {samples: 4, seqlen: 64}\n"
RECIPES = {  # every kind of state a pass leaves on a block
    "gptq": "  - gptq: {bits: 4, group_size: 32}\n",
    # float values and scales, one NVFP4 global scale shared by q/k/v and by gate/up
    "awq + gptq nvfp4": "  - awq: {format: nvfp4, grid: 4, quantize: false}\n  - gptq: {format: nvfp4}\n",
    "gptq fp8 + fp8 activations": "  - gptq: {format: fp8}\n  - activations: {format: fp8}\n",
    "gptq nvfp4 + nvfp4 activations (calibrated)": "  - gptq: {format: nvfp4}\n  - activations: {format: nvfp4}\n",
    "awq + kv_cache": "  - awq: {bits: 4, group_size: 32, symmetric: true, grid: 4}\n"
    "  - kv_cache: {bits: 4, group_size: 16, residual: 0}\n",
    "sparsegpt 2:4 + W4": "  - sparsegpt: {pattern: '2:4', quantize: {bits: 4, group_size: 32, symmetric: true}}\n",
    "smoothquant W8A8": "  - smoothquant: {alpha: 0.5, activations: token}\n"
    "  - rtn: {bits: 8, group_size: -1, symmetric: true}\n",
    "svd-llm": "  - lowrank: {method: svdllm, ratio: 0.8}\n",
    "gptq + lorc": "  - gptq: {bits: 3, group_size: 32, symmetric: true}\n  - lorc: {rank: 4, method: svd}\n",
    "gptq + blockwise": "  - gptq: {bits: 3, group_size: 32, symmetric: true}\n"
    "  - blockwise: {train: [scales, norms], steps: 3, lr: 0.001, batch: 1}\n",
    # the dense model's activations, carried beside the compressed ones, start again from the originals
    "awq + gptaq": "  - awq: {bits: 4, group_size: 32, symmetric: true, grid: 4, quantize: false}\n"
    "  - gptq: {bits: 4, group_size: 32, symmetric: true, gptaq: true}\n",
    # each linear's scheme allocated to a budget: the resumed run chooses the same
    "gptq allocated to 3.5 bits": "  - gptq: {bits: 4, group_size: 32, symmetric: true}\n"
    "allocate: {target_bpw: 3.5, candidates: [w2g32, w3g32, w4g32, w8]}\n",
    # blocks rotated as they are read, one rotation online (a hook kept as a state), int4 inputs
    "rotate + gptq + int4 activations": "  - rotate: {down: true}\n"
    "  - gptq: {bits: 4, group_size: 32, symmetric: true}\n  - activations: {format: int, bits: 4}\n",
}


class Crash(Exception):
    pass


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory, smollm2):
    return tiny_folder(tmp_path_factory.mktemp("model"), smollm2.tokenizer, layers=4)


def _weights(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.rglob("*.safetensors"))} | {
        "config.json": (folder / "config.json").read_bytes()
    }


def _crash_after(block: int, monkeypatch):
    save = BlockCheckpoints.save

    def saving_then_crashing(self, i, *args):
        save(self, i, *args)
        if i == block:
            raise Crash(f"stopped after block {i}")

    monkeypatch.setattr(BlockCheckpoints, "save", saving_then_crashing)


@pytest.mark.parametrize("passes", RECIPES.values(), ids=RECIPES.keys())
def test_a_resumed_run_writes_the_uninterrupted_runs_export(passes, model_folder, tmp_path, monkeypatch):
    recipe = parse(DATA + "passes:\n" + passes)
    whole = tmp_path / "whole"
    apply(recipe, str(model_folder), whole, "cpu", evaluate_after=False)
    assert not resume.folder_for(whole).exists()  # removed once the export is in place

    out = tmp_path / "out"
    with monkeypatch.context() as patched:
        _crash_after(1, patched)
        with pytest.raises(Crash):
            apply(recipe, str(model_folder), out, "cpu", evaluate_after=False)
    kept = resume.folder_for(out)
    assert not out.exists() and json.loads((kept / resume.STATE).read_text())["blocks"] == 2
    report = apply(recipe, str(model_folder), out, "cpu", evaluate_after=False, resume_run=True)
    assert _weights(out) == _weights(whole)
    assert not kept.exists()
    if "blockwise" in passes:  # the resumed blocks' training logs are kept too
        assert len(report.training["passes[1].blockwise"]) == 4


def test_resume_refuses_another_recipe_and_a_plain_run_starts_over(model_folder, tmp_path, monkeypatch):
    recipe = parse(DATA + "passes:\n" + RECIPES["gptq"])
    out = tmp_path / "out"
    with monkeypatch.context() as patched:
        _crash_after(0, patched)
        with pytest.raises(Crash):
            apply(recipe, str(model_folder), out, "cpu", evaluate_after=False)
    other = parse(DATA + "passes:\n" + RECIPES["gptq"].replace("bits: 4", "bits: 3"))
    with pytest.raises(ResumeError, match="another recipe"):
        apply(other, str(model_folder), out, "cpu", evaluate_after=False, resume_run=True)
    with pytest.raises(ResumeError, match="another seed"):
        apply(recipe, str(model_folder), out, "cpu", seed=7, evaluate_after=False, resume_run=True)
    assert resume.folder_for(out).exists()  # refused: nothing removed
    apply(other, str(model_folder), out, "cpu", evaluate_after=False)  # without --resume: starts over
    assert out.is_dir() and not resume.folder_for(out).exists()


def test_resume_is_refused_where_nothing_is_kept(model_folder, tmp_path, capsys):
    recipe = parse("passes:\n  - rtn: {bits: 4, group_size: 32}\n")
    with pytest.raises(ResumeError, match="calibrates nothing"):
        apply(recipe, str(model_folder), tmp_path / "out", "cpu", evaluate_after=False, resume_run=True)
    recipe = parse(DATA + "passes:\n" + RECIPES["gptq"])
    with pytest.raises(ResumeError, match="--no-checkpoints"):
        apply(
            recipe, str(model_folder), tmp_path / "out", "cpu", evaluate_after=False, resume_run=True, keep_blocks=False
        )
    apply(recipe, str(model_folder), tmp_path / "out", "cpu", evaluate_after=False, keep_blocks=False)
    assert (tmp_path / "out").is_dir() and not resume.folder_for(tmp_path / "out").exists()
    assert "kept for --resume" not in capsys.readouterr().out
    apply(recipe, str(model_folder), tmp_path / "kept", "cpu", evaluate_after=False)
    assert "finished blocks kept for --resume ≤ 0.0 GB on disk" in capsys.readouterr().out  # the plan says it


def test_a_folder_in_the_way_that_is_not_ours_is_left_alone(model_folder, tmp_path):
    out = tmp_path / "out"
    stranger = resume.folder_for(out)
    stranger.mkdir()
    (stranger / "notes.txt").write_text("mine")
    recipe = parse(DATA + "passes:\n" + RECIPES["gptq"])
    with pytest.raises(ResumeError, match="not ours"):
        apply(recipe, str(model_folder), out, "cpu", evaluate_after=False)
    assert (stranger / "notes.txt").read_text() == "mine"


def test_the_cli_continues_a_killed_run(model_folder, tmp_path):
    """The command line end to end: a run stopped by an error after two blocks says how to go on,
    and ``--resume`` does."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text(DATA + "passes:\n" + RECIPES["gptq"])
    out = tmp_path / "out"
    crash = (
        "import sys; from compress import resume; from compress.cli import main; save = resume.BlockCheckpoints.save\n"
        "def stop(self, i, *a):\n    save(self, i, *a)\n    if i == 1: raise KeyboardInterrupt\n"
        "resume.BlockCheckpoints.save = stop; sys.exit(main())"
    )
    args = ["apply", str(recipe), "--model", str(model_folder), "--output", str(out), "--device", "cpu", "--no-eval"]
    stopped = subprocess.run([sys.executable, "-c", crash, *args], capture_output=True, text=True)
    assert stopped.returncode == 130 and "--resume continues" in stopped.stderr, stopped.stderr[-2000:]
    resumed = subprocess.run([sys.executable, "-m", "compress.cli", *args, "--resume"], capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "reading 2 finished blocks back" in resumed.stderr and (out / "model.safetensors").is_file()
