"""Network faults between hosts: each process of a job (2 trainers + 1 server) on an emulated host
of its own (benchmarks/network.py: a network namespace per host, veth links to a bridge), run by a
torchrun agent per host as on several machines (docs/training.md), the rendezvous and the job's
store on host 0. A host's link is taken down mid-training: every process ends non-zero within
the timeouts plus a few seconds, naming the peer it lost (or, on the host cut off, its own link)
-- never a hang, never a crash. Needs root, iproute2 and unshare (skipped otherwise); the
namespaces are removed and every process killed however the test ends."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks.network import EmulatedNetwork, NetworkSpec, of_process
from tests.distributed.test_faults import TINY
from tests.support.cli import REPO, kill_tree
from tests.support.network import needs_root

pytestmark = needs_root

TIMEOUT = 6.0  # runtime.rpc_timeout_s, pg_timeout_s, shutdown_timeout_s
MARGIN = 5.0  # the peers' 1 s ping, one 2 s store step, polling on 2 busy cores
RUNTIME = [f"runtime.rpc_timeout_s={TIMEOUT}", "runtime.heartbeat_s=1", f"runtime.pg_timeout_s={TIMEOUT}",
           f"runtime.shutdown_timeout_s={TIMEOUT}", "runtime.startup_timeout_s=60", "runtime.kill_grace_s=3"]
NAMES = ["trainer0", "trainer1", "ps0"]  # host i runs rank i


def _start(net: EmulatedNetwork, tmp: Path, steps: int, agent: list[str]) -> list[subprocess.Popen]:
    """One torchrun agent per host, node rank = host, static rendezvous on host 0."""
    tiny = [o for o in TINY if not o.startswith(("runtime.", "train.steps"))]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp), "PYTHONUNBUFFERED": "1"}
    procs = []
    for i in range(3):
        addr = net.address(i)
        cmd = [net.executable(i), "-m", "hybrid.launch.torchrun", "--address", addr, *agent, "--nnodes", "3",
               "--nproc-per-node", "1", "--node-rank", str(i), "--master-addr", net.address(0), "--master-port",
               "29500", "--max-restarts", "0", "--log-dir", "/dev/null", "-m", "hybrid.cli", "train",
               "--plan", "conf/plans/dlrm.yaml", "--config", "conf/train/dlrm.yaml", *tiny, *RUNTIME,
               f"train.steps={steps}", f"train.out_dir={tmp}/out", f"runtime.address={addr}"]
        with open(tmp / f"h{i}.out", "w") as out:
            procs.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                                          start_new_session=True))
    return procs


def _cut(tmp: Path, host: int, when, *, steps: int, wait_s: float, agent: list[str] = ()):
    """Run the job, take ``host``'s link down for good once ``when(tmp)`` holds, and wait up to
    ``wait_s`` for every agent to end. Returns (exit codes, seconds from the cut to each end or
    None, outputs, report); everything is killed and the namespaces removed however it ends."""
    with EmulatedNetwork(NetworkSpec(rate_bit_s=10**9, delay_s=0.0), hosts=3) as net:
        procs = _start(net, tmp, steps, list(agent))
        ended: dict[int, float] = {}
        try:
            deadline = time.time() + 240
            while not when(tmp):
                assert time.time() < deadline, "the job did not reach the point of the fault in time"
                assert all(p.poll() is None for p in procs), f"ended before the fault: {[p.poll() for p in procs]}"
                time.sleep(0.05)
            subprocess.run(["ip", "-n", net.host_namespace(host), "link", "set", "eth0", "down"], check=True)
            t_cut = time.time()
            while len(ended) < 3 and time.time() < t_cut + wait_s:
                for i, p in enumerate(procs):
                    if i not in ended and p.poll() is not None:
                        ended[i] = time.time() - t_cut
                time.sleep(0.05)
        finally:
            for p in procs:
                kill_tree(p.pid)
                p.wait()
    outs = [(tmp / f"h{i}.out").read_text() for i in range(3)]
    codes = [p.returncode if i in ended else None for i, p in enumerate(procs)]
    report = "\n".join(f"=== host {i} ({NAMES[i]}): exit {codes[i]}, ended "
                       f"{f'{ended[i]:.1f}s after the cut' if i in ended else 'never (killed)'}\n{outs[i][-3000:]}"
                       for i in range(3))
    print(report)
    assert of_process(os.getpid()) == []
    return codes, [ended.get(i) for i in range(3)], outs, report


def _after_steps(n: int):
    def reached(tmp: Path) -> bool:
        metrics = tmp / "out" / "metrics.jsonl"
        return metrics.exists() and metrics.read_text().count("\n") >= n
    return reached


@pytest.mark.serial  # bounds how long it takes: runs after the others (make test)
def test_a_host_whose_link_goes_down_mid_step_ends_every_process_naming_it(tmp_path):
    """Host 0 -- trainer0, and the job's store in its torchrun agent -- loses its link for good in
    the middle of training. trainer0 says its own link is down (it crashed inside TensorPipe,
    SIGABRT after "terminate called ... network is unreachable", when it pinged its peers to name
    them); trainer1 and ps0 name trainer0 within the timeout plus a few seconds (each of their
    steps in the unreachable store no longer waits its 2 s over again)."""
    codes, ended, outs, report = _cut(tmp_path, 0, _after_steps(5), steps=2000, wait_s=4 * TIMEOUT + 30)
    assert None not in ended and 0 not in codes, report
    assert "terminate called" not in report and "SIGABRT" not in report and "Traceback" not in report, report
    assert "trainer0: peers not answering: trainer1, ps0 (this host's network interface eth0 (runtime.address " \
           "192.0.2.1) is down)" in outs[0], report
    for i in (1, 2):
        assert f"{NAMES[i]}: peers not answering: trainer0 (died or hung)" in outs[i], report
        assert ended[i] < TIMEOUT + MARGIN + 1.0, report  # + the server's 1 s heartbeat


@pytest.mark.parametrize("host", [1, 2])
def test_a_host_cut_off_while_the_job_ends_holds_no_process(tmp_path, host):
    """A host loses its link once trainer0 printed the run's summary: the processes are leaving
    RPC (ps0's host, 2: the trainers time out leaving, and ps0 sat in RPC's graceful shutdown,
    which counts the calls in flight through the job's store with no timeout of its own), or
    have left and their agents meet in torchrun's exit barrier on node 0 (trainer1's host, 1:
    the agents waited there for 300 s). Every agent ends within twice the shutdown timeout plus
    the exit barrier's bound."""
    barrier = 5.0
    codes, ended, outs, report = _cut(tmp_path, host, lambda tmp: "hybrid run summary" in (tmp / "h0.out").read_text(),
                                      steps=20, wait_s=2 * TIMEOUT + barrier + 60,
                                      agent=["--exit-barrier-timeout", str(barrier)])
    assert None not in ended, report
    assert max(ended) < 2 * TIMEOUT + 2 + barrier + 3 * MARGIN, report  # 20 s to 23 s measured
    assert "Traceback" not in report and "terminate called" not in report, report
    for i in range(3):  # a process that failed says why in one line; the others finished
        assert codes[i] == 0 or "exits with code 1" in outs[i] or "is down" in outs[i], report
