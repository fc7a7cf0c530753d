"""A peer killed or stopped at other points of a job than mid-step: while the processes connect,
during an evaluation, a checkpoint save, after the last step while the others finalize, during the
shutdown. Every other process ends non-zero within the configured timeouts plus a margin, naming
the peer -- never a hang.

The job is the real one (``hybrid.train.loop.run_process``) on processes of the test harness with a
file-store rendezvous (no torchrun: nothing stops the survivors for them, as on other hosts of a
multi-node job); the fault is a function of hybrid's, wrapped inside the chosen process only, that
signals the process itself on its ``after``-th call.
"""

from __future__ import annotations

import importlib
import logging
import os
import re
import signal
import time
from pathlib import Path

import pytest

from tests.distributed.test_faults import TINY, _time_to_end
from tests.harness import DistributedTestError, run_distributed
from tests.support.cli import REPO
from tests.support.sockets import state_of

TIMEOUT = 6.0  # runtime.rpc_timeout_s, and the others below it
MARGIN = 25.0  # start-up on 2 busy cores and the loop's own teardown
FAST = [o for o in TINY if not o.startswith(("runtime.", "train.steps"))] + [
    f"runtime.rpc_timeout_s={TIMEOUT}", "runtime.heartbeat_s=1", f"runtime.pg_timeout_s={TIMEOUT}",
    f"runtime.shutdown_timeout_s={TIMEOUT}", f"runtime.startup_timeout_s={TIMEOUT}"]


def _signal_at(target: str, after: int, how: str, when: str) -> None:
    """Send this process ``how`` (SIGKILL or SIGSTOP; ``sleep:SECONDS`` sleeps instead) on the
    ``after``-th call of ``target`` (``module:attr`` or ``module:Class.attr``), ``before`` or
    ``after`` the call itself."""
    module, _, path = target.partition(":")
    owner = importlib.import_module(module)
    *outer, name = path.split(".")
    for part in outer:
        owner = getattr(owner, part)
    original = getattr(owner, name)
    calls = [0]
    sig = getattr(signal, how, None)

    def fire():
        if how.startswith("sleep"):  # "sleep:SECONDS": slow, not dead
            logging.getLogger("hybrid").error("fault: %s in %s", how, target)
            time.sleep(float(how.split(":")[1]))
            return
        logging.getLogger("hybrid").error("fault: %s to myself in %s", how, target)
        os.kill(os.getpid(), sig)

    def wrapped(*args, **kwargs):
        calls[0] += 1
        if calls[0] == after and when == "before":
            fire()
        out = original(*args, **kwargs)
        if calls[0] == after and when == "after":
            fire()
        return out

    setattr(owner, name, wrapped)


def _job(rank: int, world_size: int, *, tmp: str, num_servers: int, fault: dict, overrides: list[str]):
    from hybrid.launch.roles import role_of
    from hybrid.log import init_logging, logger
    from hybrid.train.loop import load_run, run_process

    plan, cfg, _, resolved = load_run(str(REPO / "conf/plans/dlrm.yaml"), str(REPO / "conf/train/dlrm.yaml"),
                                      [*FAST, f"train.out_dir={tmp}/out", f"plan.topology.parameter_servers={num_servers}",
                                       *overrides], world_size)
    role = role_of(rank, world_size, num_servers)
    init_logging(role.name)
    log = logging.FileHandler(Path(tmp) / f"{role.name}.log")
    log.setFormatter(logging.Formatter("%(created).3f %(message)s"))
    logger.addHandler(log)
    if fault["who"] == role.name:
        _signal_at(fault["target"], fault.get("after", 1), fault.get("signal", "SIGKILL"), fault.get("when", "before"))
    code = run_process(role, plan, cfg, resolved, init_method=f"file://{tmp}/rdzv")
    if code:  # a failure that returns rather than exits (one that could not join): the same end line
        logger.error("%s exits with code %d", role.name, code)
        raise SystemExit(code)
    return code


def _run(tmp_path: Path, fault: dict, overrides: list[str] = (), world_size: int = 3, num_servers: int = 1):
    t0 = time.time()
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_job, world_size, setup="none", timeout=TIMEOUT + 150, failure_grace=TIMEOUT + MARGIN,
                        tmp=str(tmp_path), num_servers=num_servers, fault=fault, overrides=list(overrides))
    logs = {p.stem: p.read_text() for p in tmp_path.glob("*.log")}
    elapsed = _time_to_end(logs, t0)
    print(f"{fault}: {elapsed:.1f}s from the fault to the last process's exit\n{info.value}")
    for name, text in sorted(logs.items()):
        print(f"=== {name}\n{text[-3000:]}")
    return str(info.value), logs, elapsed


def _assert_survivors_named(report: str, logs: dict[str, str], survivors: list[str], peer: str, elapsed: float,
                            bound: float) -> None:
    """Each survivor ended by itself with exit code 1 (not killed by the harness), its log names
    ``peer``, and the last one ended within ``bound`` seconds of the fault."""
    for name in survivors:
        assert f"({name}) raised (exit code 1)" in report or f"({name}) was killed or exited with code 1 " in report, report
        assert peer in logs.get(name, ""), f"{name} does not name {peer}:\n{logs.get(name)}"
    assert elapsed < bound, f"{elapsed:.1f}s from the fault to the last exit (bound {bound:.0f}s)"


@pytest.mark.serial  # bounds how long it takes: runs after the others (make test)
@pytest.mark.parametrize("who", ["trainer1", "ps0"])
def test_a_process_killed_while_the_processes_connect_is_named_within_the_startup_timeout(tmp_path, who):
    """The process dies after every process checked in, before RPC is up: the others are inside
    the trainers' group or RPC's start-up (whose own gloo group torch gives a timeout of 24 days).
    Each ends within ``runtime.startup_timeout_s`` (or ``pg_timeout_s`` in the trainers' group),
    naming it and the stage it stopped at."""
    fault = {"who": who, "target": "hybrid.launch.init:wait_for_everyone", "when": "after"}
    report, logs, elapsed = _run(tmp_path, fault)
    survivors = [n for n in ("trainer0", "trainer1", "ps0") if n != who]
    _assert_survivors_named(report, logs, survivors, f"{who} (rank ", elapsed, TIMEOUT + 10)
    for name in survivors:
        assert f"{who} (rank {1 if who == 'trainer1' else 2}, checked in) did not join within 6s" in logs[name], logs[name]


@pytest.mark.serial  # bounds how long it takes: runs after the others (make test)
def test_a_server_killed_during_a_checkpoint_save_is_a_failed_process_not_bad_input(tmp_path):
    """The server dies while it writes its shards of a checkpoint: the trainers exit 1 naming it
    (a failed process), not 2 with a checkpoint ``error:`` line (a mistake the user could fix)."""
    fault = {"who": "ps0", "target": "hybrid.checkpoint.server_io:save_tensors"}
    report, logs, elapsed = _run(tmp_path, fault, ["train.steps=40", "checkpoint.every=10",
                                                   f"checkpoint.dir={tmp_path}/ckpt"])
    _assert_survivors_named(report, logs, ["trainer0", "trainer1"], "ps0", elapsed, TIMEOUT + 10)
    for name in ("trainer0", "trainer1"):
        assert re.search(r"peers not answering: [^(]*\bps0\b", logs[name]), logs[name]
        assert "ps0 stopped answering while writing its shards" in logs[name], logs[name]


@pytest.mark.serial  # bounds how long it takes: runs after the others (make test)
@pytest.mark.parametrize("who", ["trainer1", "ps0"])
def test_a_process_killed_after_the_last_step_is_named_by_the_others_leaving(tmp_path, who):
    """Training is over and the servers are released; the process dies as it starts to leave RPC.
    The others, whose graceful shutdown waits for every process, end within twice
    ``runtime.shutdown_timeout_s`` (torch's shutdown waits for the peers' notes, then for their
    calls to end, each as long) with one line naming it (not a traceback of RPC's ``Wait
    timeout``)."""
    fault = {"who": who, "target": "hybrid.train.loop:shutdown"}
    report, logs, elapsed = _run(tmp_path, fault, ["train.steps=10"])
    survivors = [n for n in ("trainer0", "trainer1", "ps0") if n != who]
    _assert_survivors_named(report, logs, survivors, who, elapsed, 2 * TIMEOUT + 10)
    assert "Traceback" not in report, report
    for name in survivors:
        text = logs[name]
        # a survivor that tried to reach it first names it as not answering; the others, leaving
        # RPC, name it as the one that did not leave
        assert (f"{who} (rank {1 if who == 'trainer1' else 2}, joined) did not leave RPC (this process waits 6s at most" in text
                or re.search(rf"peers not answering: [^(]*\b{who}\b", text)), text


@pytest.mark.serial  # bounds how long it takes: runs after the others (make test)
@pytest.mark.parametrize("killed", ["launcher", "agent"])
def test_the_workers_end_with_a_launcher_or_agent_killed_outright(tmp_path, killed):
    """``kill -9`` of ``hybrid launch``, or of the torchrun agent it runs in a process forked from
    the workers' server: nobody is left to stop the workers, and they end with it rather than
    train on orphaned. A killed agent is named by the launcher, which exits 137."""
    from tests.distributed.test_stops import DLRM
    from tests.distributed.test_stops import TINY as LAUNCH_TINY
    from tests.support.job import Job

    import shutil

    from tests.support.cli import fork_server_folders, stopping_mark_folders
    from tests.support.sockets import parent_of

    out = tmp_path / "out"
    with Job(["launch", "-n", "3", *DLRM, *LAUNCH_TINY, "train.steps=100000", f"train.out_dir={out}"]) as job:
        job.wait_training(out)
        workers = [job.pid_of_role(name) for name in ("trainer0", "trainer1", "ps0")]
        # what a launcher killed outright leaves (docs/training.md)
        left = fork_server_folders(job.pids()) | stopping_mark_folders(job.pids())
        # the launcher's children: the fork server and multiprocessing's resource tracker
        below = [p for p in job.pids() if parent_of(p) == job.proc.pid]
        agent = [p for p in job.pids() if parent_of(p) in below and p not in workers]
        assert len(agent) == 1, (below, agent, workers)
        os.kill(job.proc.pid if killed == "launcher" else agent[0], signal.SIGKILL)
        t0 = time.monotonic()
        alive = workers
        while alive and time.monotonic() < t0 + 10:
            time.sleep(0.05)
            alive = [p for p in workers if _running(p)]
        print(f"workers still running {time.monotonic() - t0:.2f}s after the {killed}'s SIGKILL: {alive}")
        for pid in alive:  # orphans are no longer below the job: the Job cannot end them
            os.kill(pid, signal.SIGKILL)
        code = job.wait(timeout=10)
    if killed == "launcher":
        for folder in left:
            shutil.rmtree(folder, ignore_errors=True)
    assert not alive, f"workers still running 10s after the {killed} was killed: {alive}"
    if killed == "agent":
        assert code == 137, job.output[-4000:]
        assert f"error: torchrun's agent (pid {agent[0]}) was killed by SIGKILL" in job.output, job.output[-4000:]
        assert left and not any(Path(f).exists() for f in left), left  # the launcher removed its server's folder


def _running(pid: int) -> bool:
    return state_of(pid) != "Z"


@pytest.mark.serial  # bounds how long it takes: runs after the others (make test)
@pytest.mark.parametrize("sig", ["SIGTERM", "SIGHUP"])
def test_a_launcher_stopped_by_a_scheduler_or_a_closed_terminal_says_so_in_one_line(tmp_path, sig):
    """SIGTERM (a scheduler stopping the job) or SIGHUP (the terminal closed) to ``hybrid launch``
    alone, mid-training: as on Ctrl-C, every process ends within 3 s and the one line after the
    signal is the launcher's (not torchrun's ``Received 15 death signal`` warning besides)."""
    from tests.distributed.test_stops import DLRM
    from tests.distributed.test_stops import TINY as LAUNCH_TINY
    from tests.support.job import Job

    out = tmp_path / "out"
    with Job(["launch", "-n", "3", *DLRM, *LAUNCH_TINY, "train.steps=100000", f"train.out_dir={out}"]) as job:
        job.wait_training(out)
        workers = [job.pid_of_role(name) for name in ("trainer0", "trainer1", "ps0")]
        t0 = time.monotonic()
        os.kill(job.proc.pid, getattr(signal, sig))
        code = job.wait(timeout=60)
        took = time.monotonic() - t0
        after = [line for _, line in job.lines_after(t0)]
    print(f"{sig}: exit {code} after {took:.2f}s: {after}")
    assert code == 128 + getattr(signal, sig), job.output[-4000:]
    assert after == [f"hybrid: stopped by {sig}; every process of the job has ended"], after
    assert took <= 3.0, f"{took:.2f}s"
    time.sleep(0.2)
    assert not [p for p in workers if _running(p)]


@pytest.mark.serial  # bounds how long it takes: runs after the others (make test)
def test_a_server_hung_during_a_checkpoint_save_is_named_within_the_rpc_timeout(tmp_path):
    """The server stops (SIGSTOP) while it writes its shards: trainer 0, waiting for its answer
    (a call that may take up to 30 minutes for large tables), names it within
    ``runtime.rpc_timeout_s`` (it pings the server meanwhile), not after the call's timeout; the
    other trainer, waiting for trainer 0 in a collective (``pg_timeout_s`` 30 here), names it too."""
    fault = {"who": "ps0", "target": "hybrid.checkpoint.server_io:save_tensors", "signal": "SIGSTOP"}
    report, logs, elapsed = _run(tmp_path, fault, ["train.steps=40", "checkpoint.every=10",
                                                   f"checkpoint.dir={tmp_path}/ckpt", "runtime.pg_timeout_s=30"])
    _assert_survivors_named(report, logs, ["trainer0", "trainer1"], "ps0", elapsed, TIMEOUT + 10)
    for name in ("trainer0", "trainer1"):
        assert "ps0 stopped answering while writing its shards" in logs[name], logs[name]
        assert "no answer to a ping within 6s (runtime.rpc_timeout_s)" in logs[name], logs[name]


@pytest.mark.serial  # bounds how long it takes: runs after the others (make test)
def test_a_server_names_the_trainer_that_died_not_the_one_that_failed_on_it(tmp_path):
    """trainer1 is killed mid-run; trainer0 fails on it and exits, saying so, before the server's
    heartbeat notices either. The server's line names trainer1 as the peer that died and trainer0
    as one that failed too (not both as died or hung, trainer0 first)."""
    fault = {"who": "trainer1", "target": "hybrid.train.loop:Trainer._log_train", "after": 5}
    report, logs, elapsed = _run(tmp_path, fault, ["train.steps=100000", "train.log_every=1"])
    _assert_survivors_named(report, logs, ["trainer0", "ps0"], "trainer1", elapsed, TIMEOUT + 10)
    line = next(x for x in logs["ps0"].splitlines() if "peers not answering" in x)
    assert "peers not answering: trainer1 (died or hung);" in line, line
    assert "trainer0 failed too, saying why" in line or "trainer0" not in line.split("stopped on:")[0], line


@pytest.mark.serial  # bounds how long it takes: runs after the others (make test)
def test_a_trainer_killed_while_the_store_host_hangs_ends_the_others_within_seconds(tmp_path):
    """The job's store lives in torchrun's agent (on another machine: node 0's). With the agent
    stopped (SIGSTOP: as a lost machine, it neither answers nor closes its connections), trainer1
    is killed: trainer0 and the server end by themselves within the timeouts plus a few seconds,
    rather than wait in a read of the store (whose own timeout is minutes). Every process of the
    job but the workers is stopped -- the launcher, its workers' server and the agent forked from
    it -- so no agent stops the workers itself (with a live agent, its SIGTERM may end them
    before they say why)."""
    from tests.distributed.test_stops import DLRM
    from tests.distributed.test_stops import TINY as LAUNCH_TINY
    from tests.support.job import Job

    out = tmp_path / "out"
    args = ["launch", "-n", "3", *DLRM, *LAUNCH_TINY, "train.steps=100000", f"train.out_dir={out}",
            "runtime.heartbeat_s=1", f"runtime.rpc_timeout_s={TIMEOUT}", f"runtime.pg_timeout_s={TIMEOUT}"]
    with Job(args) as job:
        job.wait_training(out)
        workers = {name: job.pid_of_role(name) for name in ("trainer0", "trainer1", "ps0")}
        stopped = [pid for pid in job.pids() if pid not in workers.values()]
        assert job.proc.pid in stopped and len(stopped) >= 3, stopped  # the launcher, the server, the agent
        for pid in stopped:
            os.kill(pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            os.kill(workers["trainer1"], signal.SIGKILL)
            ended: dict[str, float] = {}
            while time.monotonic() - t0 < TIMEOUT + 30 and len(ended) < 2:
                for name in ("trainer0", "ps0"):
                    if name not in ended and not _running(workers[name]):
                        ended[name] = time.monotonic() - t0
                time.sleep(0.1)
        finally:
            for pid in workers.values():
                if _running(pid):
                    os.kill(pid, signal.SIGKILL)
            for pid in stopped:
                os.kill(pid, signal.SIGCONT)
    print(f"with the store host stopped, after trainer1's death: {ended}")
    assert set(ended) == {"trainer0", "ps0"}, f"still running {TIMEOUT + 30:.0f}s after: {set(workers) - set(ended)}"
    assert max(ended.values()) < TIMEOUT + 10, ended
    assert "trainer0: peers not answering: trainer1" in job.output, job.output[-4000:]


@pytest.mark.serial  # bounds how long it takes: runs after the others (make test)
def test_a_checkpoint_save_longer_than_the_collective_timeout_succeeds(tmp_path):
    """A healthy server takes 12 s to write its shards (large tables on a slow disk) with
    ``pg_timeout_s`` 6: the save completes and training goes on. The trainers other than trainer 0
    (which waits for the servers) wait for it outside any collective, pinging it."""
    from tests.harness import run_distributed

    fault = {"who": "ps0", "target": "hybrid.checkpoint.server_io:save_tensors", "signal": "sleep:12"}
    out = run_distributed(_job, 3, setup="none", timeout=150, failure_grace=TIMEOUT + MARGIN, tmp=str(tmp_path),
                          num_servers=1, fault=fault,
                          overrides=["train.steps=20", "checkpoint.every=10", f"checkpoint.dir={tmp_path}/ckpt"])
    assert out == [0, 0, 0], out
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir() if p.name.startswith("step_")) == \
        ["step_00000010", "step_00000020"]
    assert "fault: sleep:12" in (tmp_path / "ps0.log").read_text()


@pytest.mark.serial  # bounds how long it takes: runs after the others (make test)
def test_a_checkpoint_restore_longer_than_the_collective_timeout_succeeds(tmp_path):
    """The same for a resume: the server takes 12 s to load its tables, ``pg_timeout_s`` 6."""
    from tests.harness import run_distributed

    ckpt = [f"checkpoint.dir={tmp_path}/ckpt", "checkpoint.every=10"]
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    out = run_distributed(_job, 3, setup="none", timeout=150, failure_grace=TIMEOUT + MARGIN, tmp=str(first),
                          num_servers=1, fault={"who": "nobody"}, overrides=["train.steps=10", *ckpt])
    assert out == [0, 0, 0], out
    fault = {"who": "ps0", "target": "hybrid.checkpoint.server_io:_load_collection", "signal": "sleep:12"}
    out = run_distributed(_job, 3, setup="none", timeout=150, failure_grace=TIMEOUT + MARGIN, tmp=str(second),
                          num_servers=1, fault=fault, overrides=["train.steps=20", "checkpoint.resume=latest", *ckpt])
    assert out == [0, 0, 0], out
    assert "fault: sleep:12" in (second / "ps0.log").read_text()
    assert "resuming at step 10" in (second / "trainer0.log").read_text()
