"""Several processes (torchrun, gloo on the CPU): each rank calibrates and evaluates on its share,
statistics are combined, sweeps split by rows, and the export equals one process's."""

import json
import os
import signal
import socket
import subprocess
import sys

import pytest
import torch
from conftest import tiny_folder
from safetensors.torch import load_file

from compress import distributed
from compress.apply import apply
from compress.recipe import parse

# every statistic and split: Hessians, GPTAQ's asymmetry and sweep rows, AWQ's means, grid and clip rows, maxima
PASSES = {
    "awq scales + gptq actorder gptaq": "  - awq: {bits: 4, group_size: 32, grid: 4, quantize: false}\n"
    "  - gptq: {bits: 4, group_size: 32, actorder: true, gptaq: true}\n",
    "sparsegpt 2:4, smoothquant, gptq W8": "  - sparsegpt: {pattern: '2:4'}\n  - smoothquant: {alpha: 0.5}\n"
    "  - gptq: {bits: 8, group_size: -1}\n",
}
RECIPE = "calibration: {samples: 5, seqlen: 64}\nevaluation: {windows: 3, seqlen: 64}\npasses:\n"


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory, smollm2):
    return tiny_folder(tmp_path_factory.mktemp("model"), smollm2.tokenizer)


def _start(command: list[str]) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.getcwd())
    return subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True
    )


def _finish(run: subprocess.Popen) -> subprocess.CompletedProcess:
    with run:
        try:
            out, err = run.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            os.killpg(run.pid, signal.SIGKILL)  # the launcher and its workers: none is left waiting
            raise
    return subprocess.CompletedProcess(run.args, run.returncode, out, err)


def _run(args, processes: int, program=("-m", "compress")):
    """``compress`` (or a script) as one process or under torchrun, one thread each."""
    launcher = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={processes}", "--standalone"]
    return _finish(_start((launcher if processes > 1 else [sys.executable]) + [*program, *args]))


def _same_exports(one, two):
    first, second = (load_file(folder / "model.safetensors") for folder in (one, two))
    assert first.keys() == second.keys()
    for name in first:
        assert torch.equal(first[name], second[name]), name
    assert sorted(p.name for p in two.iterdir()) == sorted(p.name for p in one.iterdir())


@pytest.mark.skipif(not torch.distributed.is_available(), reason="no torch.distributed in this build")
@pytest.mark.parametrize("passes", PASSES.values(), ids=PASSES.keys())
def test_two_processes_write_the_export_one_process_writes(passes, model_folder, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(RECIPE + passes)
    outputs = {}
    for processes in (1, 2):
        out = tmp_path / f"out{processes}"
        done = _run(
            ["apply", str(recipe), "--model", str(model_folder), "--output", str(out), "--device", "cpu"], processes
        )
        assert done.returncode == 0, done.stderr[-3000:]
        outputs[processes] = out
    _same_exports(outputs[1], outputs[2])
    reports = [json.loads((outputs[n] / "report.json").read_text())["eval"] for n in (1, 2)]
    for key in ("ppl", "ref_ppl", "kl", "top1", "ppl_se", "increase_se"):  # windows split across ranks, sums combined
        assert reports[1][key] == pytest.approx(reports[0][key], rel=1e-9, abs=1e-12), key


@pytest.mark.skipif(not torch.distributed.is_available(), reason="no torch.distributed in this build")
def test_two_nodes_over_loopback_write_the_export_one_process_writes(model_folder, tmp_path):
    """The documented multi-node command, its two node ranks on one machine (one process each,
    talking over 127.0.0.1)."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text(RECIPE + PASSES["awq scales + gptq actorder gptaq"])
    args = ["apply", str(recipe), "--model", str(model_folder), "--device", "cpu"]
    alone = _run([*args, "--output", str(tmp_path / "one")], 1)
    assert alone.returncode == 0, alone.stderr[-3000:]
    with socket.socket() as s:  # a free port for the rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    nodes = [
        _start(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(rank)]
            + ["--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(port)]
            + ["-m", "compress", *args, "--output", str(tmp_path / "two")]
        )
        for rank in (0, 1)
    ]
    for done in [_finish(node) for node in nodes]:
        assert done.returncode == 0, done.stderr[-3000:]
    _same_exports(tmp_path / "one", tmp_path / "two")


def test_a_refused_run_of_two_processes_says_why_in_one_line_and_writes_nothing(model_folder, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(RECIPE + PASSES["awq scales + gptq actorder gptaq"])
    out = tmp_path / "out"
    done = _run(["apply", str(recipe), "--model", str(model_folder), "--output", str(out), "--samples", "1"], 2)
    assert done.returncode != 0
    assert "compress: error (rank 0 of 2): --samples 1 is fewer than the 2 processes" in done.stderr
    assert not out.exists() and not list(tmp_path.glob(".out*"))


FAIL_ON_RANK_1 = """
import os, sys
from compress.cli import main
from compress.data import DataError
from compress.passes.gptq import GPTQ
if os.environ["RANK"] == "1":
    def fail(self, block, data, prefix):
        raise DataError("a failure on rank 1 alone")
    GPTQ.apply = fail
sys.exit(main())
"""


def test_a_failure_on_one_rank_stops_every_rank_and_leaves_nothing(model_folder, tmp_path):
    script = tmp_path / "fail.py"
    script.write_text(FAIL_ON_RANK_1)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(RECIPE + PASSES["awq scales + gptq actorder gptaq"])
    out = tmp_path / "out"
    args = ["apply", str(recipe), "--model", str(model_folder), "--output", str(out), "--device", "cpu"]
    done = _run(args, 2, program=(str(script),))
    assert done.returncode != 0
    assert "compress: error (rank 1 of 2): a failure on rank 1 alone" in done.stderr
    assert not out.exists() and not list(tmp_path.glob(".out*"))


@pytest.mark.parametrize(
    "passes, flag, message",
    [
        ("  - gptq: {bits: 3}\n  - distill: {steps: 2}\n", {}, "passes[1].distill trains the model"),
        ("  - gptq: {bits: 3}\n  - blockwise: {steps: 2}\n", {}, "passes[1].blockwise trains the model"),
        ("  - gptq: {bits: 4}\n", {"resume_run": True}, "--resume: a run of several processes"),
        ("  - gptq: {bits: 4}\n", {"eval_windows": 1}, "--windows 1 is fewer than the 2 processes"),
    ],
)
def test_what_several_processes_cannot_do_is_refused_before_compute(
    passes, flag, message, model_folder, tmp_path, monkeypatch
):
    monkeypatch.setattr(distributed, "size", lambda: 2)  # the checks, without starting two processes
    recipe = parse(RECIPE + passes)
    with pytest.raises(distributed.DistributedError, match=message.replace("[", r"\[").replace("]", r"\]")):
        apply(recipe, str(model_folder), tmp_path / "out", "cpu", **flag)
    assert not (tmp_path / "out").exists()


def test_shares_are_contiguous_and_cover_everything(monkeypatch):
    monkeypatch.setattr(distributed, "size", lambda: 3)
    assert distributed.shares(8) == [range(0, 3), range(3, 6), range(6, 8)]
    assert distributed.shares(2) == [range(0, 1), range(1, 2), range(2, 2)]


def test_a_single_process_starts_no_process_group(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert not distributed.launched() and distributed.start("cpu") == "cpu"
    assert distributed.size() == 1 and distributed.rank() == 0 and not torch.distributed.is_initialized()
