"""scripts/bench_peers.py's process handling: a peer past --timeout is stopped and reported with
how far it got, not waited on forever."""

import signal
import sys
from pathlib import Path

import pytest


@pytest.mark.slow
def test_a_peer_past_its_timeout_is_killed_and_its_progress_bar_names_where(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "scripts"))
    import bench_peers

    script = "import sys, time; sys.stdout.write('layer 1 of 30\\rlayer 2 of 30'); sys.stdout.flush(); time.sleep(60)"
    status, _, _, output = bench_peers.run([sys.executable, "-c", script], tmp_path / "peer.log", timeout=5)
    assert status == -signal.SIGKILL  # killed at the timeout, not waited on for its 60 s
    assert bench_peers.last_line(output) == "layer 2 of 30"
    status, _, _, output = bench_peers.run([sys.executable, "-c", "print('done')"], tmp_path / "ok.log", timeout=30)
    assert status == 0 and bench_peers.last_line(output) == "done"
