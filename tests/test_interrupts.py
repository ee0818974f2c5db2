"""A run killed at any point leaves either no output or a complete one (report included), and
the next run succeeds and clears what the killed one left."""

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest
from conftest import tiny_folder

from compress import resume
from compress.export import MANIFEST

RECIPE = (
    "passes:\n  - gptq: {bits: 4, group_size: 32}\ncalibration: {samples: 4, seqlen: 64}\n"
    "evaluation: {windows: 2, seqlen: 64}\n"
)
# printed at successive stages of `apply`: before calibration, in the sweep, after it (the export is
# being finished), in the evaluation of the export and in that of the reference
STAGES = ["memory plan", "compressing blocks:", "compressing blocks: 100%", "evaluating model", "evaluating reference"]


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory, smollm2):
    return tiny_folder(tmp_path_factory.mktemp("model"), smollm2.tokenizer, layers=4)


def _apply(recipe, model, out, *extra):
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "compress.cli",
            "apply",
            str(recipe),
            "--model",
            str(model),
            "--output",
            str(out),
            "--device",
            "cpu",
            *extra,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )


def _kill_at(process, marker: str, timeout: float = 300) -> str:
    """SIGKILL ``process`` as soon as ``marker`` appears in its output; returns the output so far."""
    seen = bytearray()

    def read():
        while chunk := os.read(process.stdout.fileno(), 4096):
            seen.extend(chunk)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    deadline = time.monotonic() + timeout
    while marker.encode() not in seen and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    if process.poll() is None:
        process.send_signal(signal.SIGKILL)
    process.wait()
    reader.join(timeout=5)
    return seen.decode(errors="replace")


def test_a_killed_apply_leaves_nothing_half_written_and_the_next_run_cleans_up(model_folder, tmp_path):
    """Runs killed at each stage in turn, each after the one before left its temporary folder;
    after each, the output is absent or complete; then a run to the end."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text(RECIPE)
    out = tmp_path / "out"
    for stage in STAGES:
        output = _kill_at(_apply(recipe, model_folder, out), stage)
        assert stage in output, output[-2000:]
        assert not out.exists() or ((out / "report.json").is_file() and (out / MANIFEST).is_file()), stage
        if out.exists():  # it finished before the kill landed: start the next one afresh
            shutil.rmtree(out)
    final = _apply(recipe, model_folder, out)
    text = final.communicate()[0].decode(errors="replace")
    assert final.returncode == 0, text[-2000:]
    assert json.loads((out / "report.json").read_text())["eval"]["ppl"] > 0
    assert not list(tmp_path.glob(".out.*"))  # what the killed runs left is gone


def test_a_run_killed_mid_sweep_and_resumed_writes_the_uninterrupted_export(model_folder, tmp_path):
    """SIGKILL once two of the four blocks are kept, then ``--resume``: the export is byte for
    byte an uninterrupted run's."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text(RECIPE)
    whole = _apply(recipe, model_folder, tmp_path / "whole", "--no-eval")
    assert whole.wait() == 0, whole.communicate()[0].decode(errors="replace")[-2000:]
    out = tmp_path / "out"
    state = resume.folder_for(out) / resume.STATE
    run = _apply(recipe, model_folder, out, "--no-eval")
    deadline = time.monotonic() + 300
    while run.poll() is None and time.monotonic() < deadline:
        if state.is_file() and json.loads(state.read_text())["blocks"] >= 2:
            run.send_signal(signal.SIGKILL)
            break
        time.sleep(0.005)
    assert run.wait() == -signal.SIGKILL and not out.exists()
    resumed = _apply(recipe, model_folder, out, "--no-eval", "--resume")
    text = resumed.communicate()[0].decode(errors="replace")
    assert resumed.returncode == 0 and "finished blocks back" in text, text[-2000:]
    assert (out / "model.safetensors").read_bytes() == (tmp_path / "whole" / "model.safetensors").read_bytes()
    assert not resume.folder_for(out).exists()
