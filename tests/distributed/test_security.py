"""Nothing a run opens listens beyond the configured address (loopback by default)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from tests.support.cli import REPO, kill_tree
from tests.support.sockets import descendants, listening


def test_every_listening_socket_of_a_running_job_is_on_loopback(tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "hybrid.cli", "launch", "-n", "3", "train", "--plan", "conf/plans/dlrm.yaml",
           "--config", "conf/train/dlrm.yaml", "model.num_embeddings=200", "train.steps=100000",
           "train.eval_every=0", "data.batch_size=8", "train.progress=false", "train.log_every=1",
           f"train.out_dir={out}"]
    proc = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.time() + 180
        metrics = out / "metrics.jsonl"
        while time.time() < deadline and proc.poll() is None:
            if metrics.exists() and len(metrics.read_text().splitlines()) >= 3:
                break  # training: every process is up and connected
            time.sleep(0.5)
        assert proc.poll() is None, proc.stderr.read()
        assert metrics.exists(), "the job did not start training in 180 s"
        json.loads(metrics.read_text().splitlines()[0])
        pids = descendants(proc.pid)
        sockets = listening(pids)
    finally:
        kill_tree(proc.pid)
        proc.wait()
    # the launcher's 2 stores (rendezvous, shared with workers), RPC on all 3 workers, gloo on 2 trainers
    assert len(sockets) >= 7, sockets
    exposed = [(pid, a) for pid, a in sockets if not a.startswith("127.0.0.1:")]
    assert not exposed, f"listening beyond loopback: {exposed} (all: {sockets})"
