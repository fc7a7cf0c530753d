"""Nothing a run opens listens beyond ``runtime.address`` (loopback by default; ::1, 127.0.0.2 too),
and an address the machine does not have is refused before anything starts."""

from __future__ import annotations

import socket
import time

import pytest

from tests.support.cli import run_hybrid
from tests.support.job import Job
from tests.support.sockets import listening

JOB = ["launch", "-n", "3", "train", "--plan", "conf/plans/dlrm.yaml", "--config", "conf/train/dlrm.yaml",
       "model.num_embeddings=200", "train.steps=100000", "train.eval_every=0", "data.batch_size=8",
       "train.progress=false", "train.log_every=1"]


def _can_listen(address: str) -> bool:
    try:
        with socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET) as s:
            s.bind((address, 0))
    except OSError:
        return False
    return True


@pytest.mark.parametrize("address", ["127.0.0.1", "::1", "127.0.0.2"])
def test_every_listening_socket_of_a_running_job_is_on_the_configured_address(tmp_path, address):
    if not _can_listen(address):
        pytest.skip(f"this machine cannot listen on {address}")
    out = tmp_path / "run"
    with Job([*JOB, f"train.out_dir={out}", f"runtime.address={address}"]) as job:
        job.wait_training(out)
        sockets = listening(job.pids())
    # the launcher's 2 stores (rendezvous, shared with workers), RPC on all 3 workers, gloo on 2 trainers
    assert len(sockets) >= 7, sockets
    assert len({pid for pid, _ in sockets}) == 4, sockets  # torchrun and each of the 3 workers
    elsewhere = [(pid, a) for pid, a in sockets if a.rpartition(":")[0] != address]
    assert not elsewhere, f"listening beyond {address}: {elsewhere} (all: {sockets})"


@pytest.mark.serial  # bounds how long it takes: runs after the others (make test)
def test_an_address_this_machine_does_not_have_is_refused_at_once(tmp_path):
    address = "192.0.2.1"  # TEST-NET-1 (RFC 5737): documentation only, on no ordinary machine
    if _can_listen(address):
        pytest.skip(f"this machine has {address}")
    t0 = time.monotonic()
    res = run_hybrid([*JOB, f"train.out_dir={tmp_path}", f"runtime.address={address}"], timeout=120)
    took = time.monotonic() - t0
    print(f"{address} refused in {took:.1f}s")
    assert res.returncode == 2, res.output
    errors = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "runtime.address" in errors[0] and address in errors[0], res.output
    assert "Traceback" not in res.output and "serving" not in res.output, res.output  # no process started
    assert took < 30, took  # the launcher's own start-up (importing torch) only
