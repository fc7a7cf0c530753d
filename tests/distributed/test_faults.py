"""Faults end cleanly: a dead or slow peer, or a failing update, ends every process with a non-zero
exit and a message naming the peer, within the configured timeout plus a margin -- never a hang.

Each test runs the real job (``hybrid.train.loop.run_process``: RPC, process group, compose,
training loop, serving) on spawned processes with a file-store rendezvous; the fault is real (a
process SIGKILLs itself at a chosen point, sleeps, or raises inside the update), injected by
patching the server's code inside that process only.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from pathlib import Path

import pytest

from tests.harness import DistributedTestError, run_distributed
from tests.support.cli import REPO, run_hybrid

RPC_TIMEOUT = 8.0
MARGIN = 25.0  # start-up on 2 busy cores and the loop's own teardown
TINY = ["model.num_embeddings=200", "model.bottom_mlp=[8,16]", "model.top_mlp=[8,1]", "train.steps=200",
        "train.eval_every=0", "data.batch_size=8", "train.progress=false", "train.plot=false",
        f"runtime.rpc_timeout_s={RPC_TIMEOUT}", "runtime.heartbeat_s=1", "runtime.pg_timeout_s=20",
        "runtime.shutdown_timeout_s=10"]


def _die_at(method: str, after: int) -> None:
    """SIGKILL this process on the ``after``-th call of ``CollectionShard.<method>``."""
    from hybrid.ps.server import shard as srv

    original = getattr(srv.CollectionShard, method)
    calls = [0]

    def wrapped(self, *args, **kwargs):
        calls[0] += 1
        if calls[0] >= after:
            logging.getLogger("hybrid").error("fault: killing myself in %s", method)
            os.kill(os.getpid(), signal.SIGKILL)
        return original(self, *args, **kwargs)

    setattr(srv.CollectionShard, method, wrapped)


def _sleep_at(method: str, after: int, seconds: float) -> None:
    from hybrid.ps.server import shard as srv

    original = getattr(srv.CollectionShard, method)
    calls = [0]

    def wrapped(self, *args, **kwargs):
        calls[0] += 1
        if calls[0] == after:
            logging.getLogger("hybrid").error("fault: sleeping %.0fs in %s", seconds, method)
            time.sleep(seconds)
        return original(self, *args, **kwargs)

    setattr(srv.CollectionShard, method, wrapped)


def _job(rank: int, world_size: int, *, tmp: str, num_servers: int, fault: dict | None, overrides: list[str]):
    from hybrid.launch.roles import role_of
    from hybrid.log import init_logging, logger
    from hybrid.train.loop import load_run, run_process

    plan, cfg, _, resolved = load_run(str(REPO / "conf/plans/dlrm.yaml"), str(REPO / "conf/train/dlrm.yaml"),
                                      [*TINY, f"train.out_dir={tmp}/out", f"plan.topology.parameter_servers={num_servers}",
                                       *overrides], world_size)
    role = role_of(rank, world_size, num_servers)
    init_logging(role.name)
    log = logging.FileHandler(Path(tmp) / f"{role.name}.log")
    log.setFormatter(logging.Formatter("%(created).3f %(message)s"))
    logger.addHandler(log)
    if fault and fault["who"] == role.name:
        kind = fault["kind"]
        if kind == "die":
            _die_at(fault["method"], fault["after"])
        elif kind == "sleep":
            _sleep_at(fault["method"], fault["after"], fault["seconds"])
        elif kind == "die_trainer":
            import threading

            def later():
                time.sleep(fault["after_s"])
                logger.error("fault: killing myself mid-step")
                os.kill(os.getpid(), signal.SIGKILL)

            threading.Thread(target=later, daemon=True).start()
    return run_process(role, plan, cfg, resolved, init_method=f"file://{tmp}/rdzv")


def _run_fault(tmp_path: Path, world_size: int, num_servers: int, fault: dict, overrides: list[str] = ()):
    t0 = time.time()
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_job, world_size, setup="none", timeout=RPC_TIMEOUT + 120, failure_grace=RPC_TIMEOUT + MARGIN,
                        tmp=str(tmp_path), num_servers=num_servers, fault=fault, overrides=list(overrides))
    logs = {p.stem: p.read_text() for p in tmp_path.glob("*.log")}
    elapsed = _time_to_end(logs, t0)
    print(f"{fault}: {elapsed:.1f}s from the fault to the last process's exit")
    return str(info.value), logs, elapsed


def _time_to_end(logs: dict[str, str], t0: float) -> float:
    """Seconds from the fault (its log line) to the last process's exit line."""
    stamps = lambda text, what: [float(line.split()[0]) for line in text.splitlines() if what in line]  # noqa: E731
    fault = min((t for text in logs.values() for t in stamps(text, "fault:")), default=t0)
    ends = [t for text in logs.values() for t in stamps(text, "exits with code")]
    return (max(ends) if ends else time.time()) - fault


def _assert_all_failed_naming(report: str, logs: dict[str, str], names: list[str], peer: str) -> None:
    """Each of ``names`` exited with code 1 by itself (not killed by the harness) and its log names ``peer``."""
    for name in names:
        assert f"({name}) was killed or exited with code 1 " in report or f"({name}) raised (exit code 1)" in report, report
        text = logs.get(name, "")
        assert peer in text, f"{name} does not name {peer}:\n{text}\n---\n{report}"


POOLED = ["plan.modules.sparse_arch.embedding_bag_collection.pool_on=server",
          "plan.modules.sparse_arch.embedding_bag_collection.sharding=table_wise"]
TCP = ["runtime.ps_transport=socket"]
"""Step messages over the TCP step connection, as to a server on another host."""


@pytest.mark.serial  # bounds how long it takes: runs after the others (make test)
@pytest.mark.parametrize("method,overrides", [("gather", []), ("push", []), ("unpool", POOLED), ("gather", TCP),
                                              ("unpool", [*POOLED, *TCP])],
                         ids=["mid-forward", "mid-backward", "mid-backward-pooled-on-server", "mid-forward-over-tcp",
                              "mid-backward-pooled-over-tcp"])
def test_server_killed_ends_every_process_naming_it(tmp_path, method, overrides):
    report, logs, elapsed = _run_fault(tmp_path, 4, 2, {"who": "ps0", "kind": "die", "method": method, "after": 6},
                                       overrides)
    assert elapsed < RPC_TIMEOUT + MARGIN, elapsed
    _assert_all_failed_naming(report, logs, ["trainer0", "trainer1", "ps1"], "ps0")
    _assert_step_messages_went(logs, overrides)


def _assert_step_messages_went(logs: dict[str, str], overrides: list[str]) -> None:
    """Each trainer's step messages to ps0 took the transport the test asked for."""
    way = "TCP step connection" if TCP[0] in overrides else "shared-memory channel"
    for name in ("trainer0", "trainer1"):
        assert f"step messages to ps0 go through {way}" in logs[name], logs[name]


@pytest.mark.serial  # bounds how long it takes: runs after the others (make test)
@pytest.mark.parametrize("overrides", [[], TCP], ids=["shared-memory", "tcp"])
def test_trainer_killed_ends_every_process_naming_it(tmp_path, overrides):
    report, logs, elapsed = _run_fault(tmp_path, 3, 1, {"who": "trainer1", "kind": "die_trainer", "after_s": 12.0},
                                       ["train.steps=100000", *overrides])
    assert elapsed < RPC_TIMEOUT + MARGIN, elapsed
    _assert_all_failed_naming(report, logs, ["ps0", "trainer0"], "trainer1")
    # trainer0's first line after the death names trainer1 (not the gloo error it ran into)
    died = float(next(line for line in logs["trainer1"].splitlines() if "fault:" in line).split()[0])
    stamped = [(float(line.split()[0]), line) for line in logs["trainer0"].splitlines() if line[:1].isdigit()]
    first = next(line for t, line in stamped if t >= died)
    assert "peers not answering: trainer1" in first, logs["trainer0"]
    _assert_step_messages_went(logs, overrides)


@pytest.mark.serial  # bounds how long it takes: runs after the others (make test)
@pytest.mark.parametrize("overrides", [[], TCP], ids=["shared-memory", "tcp"])
def test_slow_server_gives_a_timeout_error_naming_it(tmp_path, overrides):
    report, logs, elapsed = _run_fault(tmp_path, 3, 1, {"who": "ps0", "kind": "sleep", "method": "gather", "after": 6,
                                                        "seconds": RPC_TIMEOUT + 10}, overrides)
    assert elapsed < RPC_TIMEOUT + 10 + MARGIN, elapsed  # the sleeper itself ends when it wakes
    # The trainer whose lookup hangs names ps0 and the timeout. The other names ps0 too, or --
    # when its own lookups were answered (each trainer has its own shared-memory channel and
    # server thread) and it waits in a collective instead -- the trainer that left it there.
    for name, other in (("trainer0", "trainer1"), ("trainer1", "trainer0")):
        assert "ps0" in logs[name] or f"peers not answering: {other}" in logs[name], logs[name]
    timed_out = [n for n in ("trainer0", "trainer1") if "lookup on parameter server ps0 failed" in logs[n]
                 and "timeout (8000 ms)" in logs[n]]
    assert timed_out, logs  # the trainer whose lookup hung says so; the other may fail on it first
    _assert_step_messages_went(logs, overrides)


def _never_started_server(rank: int, world_size: int, *, tmp: str):
    from hybrid.launch.init import RuntimeOptions, init_hybrid
    from hybrid.launch.roles import role_of

    role = role_of(rank, world_size, 1)
    if not role.is_trainer:
        time.sleep(12)  # "never" starts: stays away past the trainers' start-up timeout
        return None
    t0 = time.time()
    try:
        init_hybrid(role, init_method=f"file://{tmp}/rdzv", options=RuntimeOptions(startup_timeout_s=4))
    except Exception as e:  # noqa: BLE001 - the point is what it says and when
        return time.time() - t0, f"{type(e).__name__}: {e}"
    return None


@pytest.mark.serial  # bounds how long it takes: runs after the others (make test)
def test_a_server_that_never_starts_is_named_within_the_startup_timeout(tmp_path):
    for waited, err in run_distributed(_never_started_server, 3, setup="none", timeout=60, tmp=str(tmp_path))[:2]:
        print(f"a trainer named the missing server after {waited:.1f}s (startup_timeout_s=4)")
        assert 4 <= waited < 10, waited
        assert "StartupError" in err and "ps0 (rank 2) did not start within 4s" in err and "startup_timeout_s" in err


def _train_losses(out: Path) -> dict[int, float]:
    import json

    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train = [r for r in rows if r["kind"] == "train"]
    steps = [r["step"] for r in train]
    assert len(steps) == len(set(steps)), f"a step was logged twice: {steps}"
    return {r["step"]: r["loss"] for r in train}


@pytest.mark.slow
def test_torchrun_restart_after_a_killed_server_resumes_from_the_last_checkpoint(tmp_path):
    """``hybrid launch --max-restarts 1`` with checkpoints every 10 steps: the server is SIGKILLed
    at step 25; torchrun restarts the group, which resumes at step 20 and finishes -- with exactly
    the losses of a run that never failed."""
    from tests.support.cli import run_hybrid

    steps = ["train.steps=30", "train.log_every=1", "checkpoint.every=10", "checkpoint.resume=latest"]
    common = ["launch", "-n", "3", "--max-restarts", "1", "train", "--plan", "conf/plans/dlrm.yaml",
              "--config", "conf/train/dlrm.yaml", *TINY[:3], "train.eval_every=0", "data.batch_size=8",
              "train.progress=false", "train.plot=false", f"runtime.rpc_timeout_s={RPC_TIMEOUT}",
              "runtime.heartbeat_s=1", "runtime.pg_timeout_s=20", "runtime.shutdown_timeout_s=10", *steps]
    straight, failed = tmp_path / "straight", tmp_path / "failed"
    res = run_hybrid([*common, f"train.out_dir={straight}", f"checkpoint.dir={straight}/ckpt"], timeout=240)
    assert res.returncode == 0, res.output
    want = _train_losses(straight)
    assert sorted(want) == list(range(1, 31))

    # Rank 2 is the server; its 50th gradient push (2 trainers a step) is in step 25.
    env = {"HYBRID_TEST_FAULT": "2:push:50", "PYTHONPATH": f"{REPO / 'tests/support/inject'}:{REPO}"}
    t0 = time.monotonic()
    res = run_hybrid([*common, f"train.out_dir={failed}", f"checkpoint.dir={failed}/ckpt"], timeout=300, env=env)
    assert res.returncode == 0, res.output
    log = res.stdout + res.stderr
    assert "fault injection: rank 2 kills itself in CollectionShard.push" in log, res.output
    # The agent names the dead server and the restart (the trainers, stopped by torchrun within
    # milliseconds of the death, may not have said anything).
    assert "hybrid: ps0 (rank 2, pid " in log and "was killed by SIGKILL; torchrun restarts every worker " \
        "(restart 1 of 1)" in log, res.output
    assert "resuming at step 20" in log, res.output
    got = _train_losses(failed)
    assert sorted(got) == list(range(1, 31)), sorted(got)
    assert got == want  # bit for bit: the restarted job continued from step 20's checkpoint exactly
    ckpts = sorted(p.name for p in (failed / "ckpt").iterdir() if p.name.startswith("step_"))
    assert ckpts[-1] == "step_00000030", ckpts
    print(f"restarted run took {time.monotonic() - t0:.1f}s")


def test_a_mistake_in_the_data_ends_the_job_whatever_max_restarts_allows(tmp_path):
    """A worker that exits 2 (an id outside its table, found as the trainers read the batch) ends
    the job with its one line and exit 2: torchrun restarting the workers would only repeat it."""
    from tests.support.csv_data import COLUMNS, GOOD, good_with, write_csv

    train = write_csv(tmp_path / "train.csv", good_with(3, (1, 0.5, 1.0, 57, "1")))
    held_out = write_csv(tmp_path / "eval.csv", GOOD)
    res = run_hybrid(["launch", "-n", "3", "--max-restarts", "2", "train", "--plan", "conf/plans/dlrm.yaml",
                      "--config", "conf/train/dlrm.yaml", *TINY, *COLUMNS, "model.num_embeddings=10", "train.steps=6",
                      "data.source=csv", f"data.train_paths=[{train}]", f"data.eval_paths=[{held_out}]",
                      f"train.out_dir={tmp_path / 'out'}"], timeout=120)
    assert res.returncode == 2, res.output
    errors = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "feature 'a'" in errors[0] and "57" in errors[0], res.output
    assert "restarts every worker" not in res.output and res.output.count("serving;") == 1, res.output


def _busy(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


def _shutdown_in_flight(rank: int, world_size: int, *, tmp: str, busy_s: float):
    """Trainers leave RPCs running on the server and shut down at once; each process times its own
    ``shutdown``. Returns (seconds in shutdown, whether every in-flight RPC had completed)."""
    import torch.distributed.rpc as rpc

    from hybrid.launch.init import RuntimeOptions, init_hybrid, shutdown
    from hybrid.launch.roles import role_of

    role = role_of(rank, world_size, 1)
    options = RuntimeOptions(rpc_timeout_s=30, shutdown_timeout_s=30)
    init_hybrid(role, init_method=f"file://{tmp}/rdzv", options=options)
    futs = []
    if role.is_trainer:
        futs = [rpc.rpc_async("ps0", _busy, args=(busy_s,)) for _ in range(4)]
    pending = sum(not f.done() for f in futs)
    t0 = time.monotonic()
    shutdown(role, graceful=True, timeout_s=options.shutdown_timeout_s)
    took = time.monotonic() - t0
    return took, all(f.done() and f.value() == busy_s for f in futs), pending


@pytest.mark.serial  # bounds how long it takes: runs after the others (make test)
def test_shutdown_with_rpcs_in_flight_returns_within_a_bound(tmp_path):
    """8 RPCs of 1.5 s each are still running on the server when every process shuts down: the
    in-flight calls finish (the server runs them on its worker threads, 8 by default, in
    parallel), and every process leaves ``shutdown`` within the work plus a margin."""
    busy = 1.5
    out = run_distributed(_shutdown_in_flight, 3, setup="none", timeout=90, tmp=str(tmp_path), busy_s=busy)
    assert out[0][2] > 0 and out[1][2] > 0, out  # the trainers' calls were running when shutdown began
    for rank, (took, completed, _) in enumerate(out):
        assert completed, f"rank {rank}: an in-flight RPC did not complete before shutdown returned"
        assert took < busy + 15, f"rank {rank} took {took:.1f}s to shut down"


@pytest.mark.serial  # bounds how long it takes: runs after the others (make test)
def test_a_hung_server_ends_the_whole_launch_within_the_timeout_and_the_kill_grace(tmp_path):
    """SIGSTOP the server mid-run (it neither answers nor dies): the trainers fail after
    ``rpc_timeout_s`` naming it, and ``hybrid launch`` has ended every process, the stopped one
    included, ``kill_grace_s`` later. Nothing is left in the temp folder."""
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    timeout_s, grace_s = 6.0, 5.0
    env = {"HYBRID_TEST_FAULT": "2:gather:30", "HYBRID_TEST_FAULT_SIGNAL": "SIGSTOP", "TMPDIR": str(tmpdir),
           "PYTHONPATH": f"{REPO / 'tests/support/inject'}:{REPO}"}
    args = ["launch", "-n", "3", "train", "--plan", "conf/plans/dlrm.yaml", "--config", "conf/train/dlrm.yaml",
            *[o for o in TINY if not o.startswith(("runtime.rpc_timeout_s", "runtime.shutdown_timeout_s"))],
            f"runtime.rpc_timeout_s={timeout_s}", "runtime.shutdown_timeout_s=10", f"runtime.kill_grace_s={grace_s}",
            f"train.out_dir={tmp_path / 'out'}"]
    res = run_hybrid(args, timeout=240, env=env)
    ended = time.time()
    log = res.stdout + res.stderr
    stopped = [float(line.rsplit(" at ", 1)[1]) for line in log.splitlines() if "rank 2 stops itself" in line]
    assert res.returncode != 0 and stopped, res.output
    assert "ps0" in log, res.output  # named
    took = ended - stopped[0]
    print(f"{took:.1f}s from the stop to the end of the launch")
    # margin 5 s: the trainers' 1 s ping naming the peers that do not answer, torchrun's polling,
    # start-up of the failure path on 2 busy cores (measured: 12.4 to 13.9 s in all)
    assert took <= timeout_s + grace_s + 5.0, f"{took:.1f}s from the stop to the end of the launch\n{res.output}"
    assert not list(tmpdir.glob("torchelastic_*")) and not list(tmpdir.glob("hybrid-job-*")), list(tmpdir.iterdir())


def _trainers_die(rank, world_size, *, num_servers, log_path):
    from hybrid.launch.failure import fail
    from hybrid.launch.roles import role_of
    from hybrid.launch.serve import PeerFailure, serve

    role = role_of(rank, world_size, num_servers)
    if role.is_trainer:
        os.kill(os.getpid(), signal.SIGKILL)
    said = logging.FileHandler(log_path)
    said.setLevel(logging.WARNING)  # what the process reports, not its progress
    logging.getLogger("hybrid").addHandler(said)
    try:
        serve(role, heartbeat_s=0.1, timeout_s=2.0)
    except PeerFailure as e:
        fail(role, e, user_error=False)


@pytest.mark.parametrize("stopping", [True, False], ids=["job stopping", "job running"])
def test_a_process_that_loses_its_peers_while_a_signal_stops_the_job_says_nothing(tmp_path, stopping):
    """The trainers die. Once a signal stops the job (Ctrl-C, a scheduler's SIGTERM), torchrun's
    agent creates the file ``HYBRID_JOB_STOPPING`` names before it stops the workers, and the
    launcher alone says what happened: the server, failing on its trainers' end, exits 1 without a
    word. While the job runs, it names them."""
    from hybrid.launch.stopping import STOPPING_ENV

    mark, log = tmp_path / "stopping", tmp_path / "ps0.log"
    if stopping:
        mark.touch()
    with pytest.raises(DistributedTestError) as raised:
        run_distributed(_trainers_die, 3, setup="hybrid", num_servers=1, timeout=60, env={STOPPING_ENV: str(mark)},
                        log_path=str(log))
    assert "(ps0) was killed or exited with code 1 " in str(raised.value), raised.value
    said = log.read_text()
    if stopping:
        assert said == "", said
    else:
        assert "ps0: peers not answering: trainer0, trainer1 (died or hung)" in said, said


def _trainers_leave_for_a_user_error(rank, world_size, *, num_servers):
    from hybrid.errors import InputError
    from hybrid.launch.failure import fail
    from hybrid.launch.roles import role_of
    from hybrid.launch.serve import PeerFailure, serve

    role = role_of(rank, world_size, num_servers)
    if role.is_trainer:
        fail(role, InputError("t.csv:9002: column 'd1': 'abc' is not a number"), user_error=True)
    try:
        serve(role, heartbeat_s=0.1, timeout_s=2.0)
    except PeerFailure as e:
        fail(role, e, user_error=False)


def test_a_server_whose_trainers_left_for_a_user_error_exits_2_quietly():
    """Without torchrun's agent to stop it first, the server sees its trainers go: they left for
    a mistake one of them reported, so it exits 2 and names no peer (exit 1 with a peers-not-
    answering message is for a peer that died)."""
    with pytest.raises(DistributedTestError) as raised:
        run_distributed(_trainers_leave_for_a_user_error, 3, setup="hybrid", num_servers=1, timeout=60)
    text = str(raised.value)
    for who in ("trainer0", "trainer1", "ps0"):
        assert f"{who}) was killed or exited with code 2 " in text, text
