"""A job that ends abruptly leaves nothing in /dev/shm. A trainer is SIGKILLed at the worst moment
for the same-host channel: while it holds the channel's files open during the channel's set-up
(before the server has opened them). The channel's memory has no name in any file system, so the
kernel frees it with the processes; nothing the job's processes held open is left behind."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from tests.support.job import Job

TINY = ["model.num_embeddings=200", "model.bottom_mlp=[8,16]", "model.top_mlp=[8,1]", "train.eval_every=0",
        "data.batch_size=8", "train.progress=false", "train.plot=false", "train.tensorboard=false"]
CHANNEL = ("/dev/shm/hybrid-ps-", "/memfd:hybrid-ps-")
"""How a channel's file shows among a process's descriptors (a named file or an anonymous one)."""


def _children(pid: int) -> list[int]:
    found = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                for child in f.read().split():
                    found += [int(child), *_children(int(child))]
    except OSError:
        pass
    return found


def _open_files(pid: int) -> list[str]:
    got = []
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                got.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
            except OSError:
                pass
    except OSError:
        pass
    return got


def test_a_trainer_killed_while_it_sets_up_its_channel_leaves_nothing_in_dev_shm(tmp_path):
    tmp, out = tmp_path / "tmp", tmp_path / "out"
    tmp.mkdir()
    seen: set[str] = set()  # every /dev/shm path a process of the job had open
    victim = None
    with Job(["launch", "-n", "3", "train", "--plan", "conf/plans/dlrm.yaml", "--config", "conf/train/dlrm.yaml",
              *TINY, "train.steps=100000", f"train.out_dir={out}"], env={"TMPDIR": str(tmp)}) as job:
        deadline = time.monotonic() + 120
        while victim is None and time.monotonic() < deadline and job.proc.poll() is None:
            for pid in _children(job.proc.pid):
                files = _open_files(pid)
                seen.update(f for f in files if f.startswith("/dev/shm/"))
                if any(f.startswith(CHANNEL) for f in files):
                    os.kill(pid, signal.SIGKILL)
                    victim = pid
                    break
        assert victim is not None, f"no process of the job was seen setting up a channel:\n{job.output[-4000:]}"
        code = job.wait(timeout=120)
    assert code != 0, job.output[-4000:]
    assert f"pid {victim}) was killed by SIGKILL" in job.output, job.output[-4000:]
    time.sleep(0.2)
    tops = {Path("/dev/shm", Path(p).relative_to("/dev/shm").parts[0]) for p in seen}  # what each opened file is in
    left = sorted(str(t) for t in tops if t.exists())
    assert not left, f"left in /dev/shm: {left}"
