"""How a ``hybrid launch`` job ends when something goes wrong, seen from the terminal: Ctrl-C, a
trainer killed, bad data. Each test runs the real command (torchrun and its workers) with the
system temp folder pointed at a fresh directory, and checks what is printed, the exit code, the
time it took, and that nothing is left behind (processes, torchrun's ``torchelastic_*`` folders)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from tests.support.cli import run_hybrid
from tests.support.csv_data import COLUMNS, GOOD, good_with, write_csv
from tests.support.job import Job
from tests.support.sockets import cmdline_of, state_of

TINY = ["model.num_embeddings=200", "model.bottom_mlp=[8,16]", "model.top_mlp=[8,1]", "train.eval_every=0",
        "data.batch_size=8", "train.progress=false", "train.plot=false", "train.tensorboard=false",
        "train.log_every=1"]
DLRM = ["train", "--plan", "conf/plans/dlrm.yaml", "--config", "conf/train/dlrm.yaml"]
NOISE = ("Traceback", "KeyboardInterrupt", "terminate called", "Connection reset by peer")


def _fresh_tmp(tmp_path: Path) -> Path:
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    return tmp


def _assert_nothing_left(pids: list[int], tmp: Path) -> None:
    time.sleep(0.2)  # a process the kernel is still reaping
    alive = [p for p in pids if state_of(p) != "Z"]
    assert not alive, f"left running: {alive}"
    assert not list(tmp.glob("torchelastic_*")), sorted(p.name for p in tmp.iterdir())


def _fork_server(job: Job, timeout: float = 60) -> int:
    """The pid of the job's fork server, once it runs."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        server = next((p for p in job.pids() if "forkserver" in (cmdline_of(p) or "")), None)
        if server is not None:
            return server
        time.sleep(0.01)
    raise AssertionError(f"no fork server within {timeout}s:\n{job.output[-4000:]}")


def _await_forks(job: Job, n: int, timeout: float = 60) -> list[int]:
    """Until the job's fork server has forked ``n`` processes (the check, the agent, then the
    workers one by one); their pids. Polled every millisecond: the caller acts on the moment."""
    server = _fork_server(job, timeout)
    seen: list[int] = []
    deadline = time.monotonic() + timeout
    while len(seen) < n:
        try:
            children = Path(f"/proc/{server}/task/{server}/children").read_text().split()
        except OSError:
            children = []
        seen += [int(c) for c in children if int(c) not in seen]
        if time.monotonic() > deadline:
            raise AssertionError(f"the fork server forked {len(seen)} of {n} in {timeout}s:\n{job.output[-4000:]}")
        time.sleep(0.001)
    return seen


STOP_LINE = {signal.SIGINT: "interrupted", signal.SIGTERM: "stopped by SIGTERM"}


@pytest.mark.serial  # bounds how long it takes: runs after the others (make test)
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_ctrl_c_while_the_plan_is_checked_ends_the_launch_with_one_line(tmp_path, sig):
    """SIGINT (or a scheduler's SIGTERM) to the launcher's process group while the workers'
    server imports torch and the plan is checked (before torchrun starts): the launcher's one
    line, exit 128 + N, within 5 s, and the server (in a session of its own from its first line)
    and the check's process neither print a traceback nor stay behind."""
    tmp = _fresh_tmp(tmp_path)
    with Job(["launch", "-n", "3", *DLRM, *TINY, "train.steps=5", f"train.out_dir={tmp_path / 'out'}"],
             env={"TMPDIR": str(tmp)}) as job:
        _fork_server(job)
        time.sleep(0.3)  # the server is importing torch
        pids = job.pids()
        t0 = time.monotonic()
        os.killpg(job.proc.pid, sig)
        code = job.wait(timeout=60)
        took = time.monotonic() - t0
    print(f"{sig.name} during the check: exit {code} after {took:.2f}s: {job.output[-2000:]}")
    assert code == 128 + sig, job.output[-4000:]
    assert [line for _, line in job.lines_after(t0)] == [f"hybrid launch: {STOP_LINE[sig]}"], job.output[-4000:]
    assert not any(n in job.output for n in NOISE), job.output[-4000:]
    assert "serving" not in job.output, job.output[-4000:]  # no worker started
    assert took < 5.0, f"{took:.2f}s"
    _assert_nothing_left(pids, tmp)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
@pytest.mark.parametrize("forks", [2, 3, 5], ids=["agent", "first-worker", "last-worker"])
def test_a_stop_as_the_agent_or_a_worker_starts_ends_the_job_in_one_line(tmp_path, forks, sig):
    """SIGINT or SIGTERM to the launcher's group the moment the fork server has forked torchrun's
    agent (``agent``: the agent has no handler of its own yet, so the launcher holds the signal
    until it has), the first worker (torchrun has not recorded it yet), or the last one (it may
    not have its own process group yet): the agent's one line, exit 128 + N, no traceback, no
    worker waiting out the grace before SIGKILL (60 s here), nothing left behind."""
    tmp = _fresh_tmp(tmp_path)
    with Job(["launch", "-n", "3", *DLRM, *TINY, "train.steps=5", "runtime.kill_grace_s=60",
              f"train.out_dir={tmp_path / 'out'}"], env={"TMPDIR": str(tmp)}) as job:
        forked = _await_forks(job, forks)
        t0 = time.monotonic()
        os.killpg(job.proc.pid, sig)
        pids = job.pids()
        code = job.wait(timeout=90)
        took = time.monotonic() - t0
    after = [line for _, line in job.lines_after(t0)]
    print(f"{sig.name} at fork {forks}: exit {code} after {took:.2f}s: {after}")
    assert code == 128 + sig, job.output[-4000:]
    what = "interrupted (Ctrl-C)" if sig == signal.SIGINT else "stopped by SIGTERM"
    assert after == [f"hybrid: {what}; every process of the job has ended"], job.output[-4000:]
    assert not any(n in job.output for n in NOISE), job.output[-4000:]
    assert took < 30, f"{took:.2f}s"
    _assert_nothing_left(sorted(set(pids) | set(forked)), tmp)


def test_a_launch_started_under_nohup_trains_on_through_sighup(tmp_path):
    """``nohup hybrid launch ...``: SIGHUP (the terminal closed) is ignored, as nohup asks, not
    passed on to the job; Ctrl-C still stops it in one line."""
    tmp, out = _fresh_tmp(tmp_path), tmp_path / "out"
    with Job(["launch", "-n", "3", *DLRM, *TINY, "train.steps=100000", "runtime.kill_grace_s=1",
              f"train.out_dir={out}"], env={"TMPDIR": str(tmp)}, ignoring=(signal.SIGHUP,)) as job:
        job.wait_training(out)
        os.killpg(job.proc.pid, signal.SIGHUP)
        # A job that SIGHUP stops has ended 0.3 s later, or, as its workers ignore SIGHUP too
        # (nohup's disposition, inherited), at torchrun's SIGKILL a kill grace later.
        time.sleep(3)
        assert job.proc.poll() is None, job.output[-4000:]
        rows = len((out / "metrics.jsonl").read_text().splitlines())
        job.wait_training(out, rows=rows + 3, timeout=60)  # and it still trains
        pids = job.pids()
        t0 = time.monotonic()
        os.killpg(job.proc.pid, signal.SIGINT)
        code = job.wait(timeout=60)
        after = [line for _, line in job.lines_after(t0)]
    assert code == 130, job.output[-4000:]
    assert len(after) == 1 and "interrupted" in after[0], after
    assert "SIGHUP" not in job.output, job.output[-4000:]
    _assert_nothing_left(pids, tmp)


@pytest.mark.serial  # bounds how long it takes: runs after the others (make test)
def test_ctrl_c_ends_the_job_within_3s_with_one_line(tmp_path):
    """SIGINT to the launcher's process group (what a terminal sends on Ctrl-C) mid-training."""
    tmp, out = _fresh_tmp(tmp_path), tmp_path / "out"
    with Job(["launch", "-n", "3", *DLRM, *TINY, "train.steps=100000", f"train.out_dir={out}"],
             env={"TMPDIR": str(tmp)}) as job:
        job.wait_training(out)
        pids = job.pids()
        t0 = time.monotonic()
        os.killpg(job.proc.pid, signal.SIGINT)
        code = job.wait(timeout=60)
        took = time.monotonic() - t0
        after = [line for _, line in job.lines_after(t0)]
    print(f"Ctrl-C: exit {code} after {took:.2f}s: {after}")
    assert code == 130, job.output[-4000:]
    assert len(after) == 1 and "interrupted" in after[0], after
    assert took <= 3.0, f"{took:.2f}s"
    assert not any(n in job.output for n in NOISE), job.output[-4000:]
    _assert_nothing_left(pids, tmp)


def test_a_killed_trainer_is_named_first(tmp_path):
    """SIGKILL trainer1 mid-training: the first error line after it (trainer0's, when it notices
    before torchrun stops it, else the launcher's) names trainer1, never a raw socket error."""
    tmp, out = _fresh_tmp(tmp_path), tmp_path / "out"
    with Job(["launch", "-n", "3", *DLRM, *TINY, "train.steps=100000", "runtime.heartbeat_s=1",
              f"train.out_dir={out}"], env={"TMPDIR": str(tmp)}) as job:
        job.wait_training(out)
        pids = job.pids()
        victim = job.pid_of_role("trainer1")
        t0 = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        code = job.wait(timeout=120)
        took = time.monotonic() - t0
        after = [line for _, line in job.lines_after(t0)]
    print(f"trainer1 killed: exit {code} after {took:.2f}s: {after}")
    assert code == 1, job.output[-4000:]
    errors = [line for line in after if "trainer0" in line.split("]")[0] or line.startswith("error:")]
    assert errors and "trainer1" in errors[0], after
    assert f"error: trainer1 (rank 1, pid {victim}) was killed by SIGKILL" in after[-1], after
    assert not any(n in line for line in after for n in NOISE[:3]), after
    _assert_nothing_left(pids, tmp)


def _empty(path: Path) -> Path:
    path.write_bytes(b"")
    return path


def _criteo(path: Path, bad_line: int | None = None) -> Path:
    lines = ["\t".join([str(i % 2)] + [str(i % 10)] * 13 + ["%08x" % (i * 7919)] * 26) for i in range(64)]
    if bad_line is not None:
        lines[bad_line - 1] = lines[bad_line - 1].replace("\t", "\tx", 1)  # field 2 (I1): 'x9' on line 30
    path.write_text("\n".join(lines) + "\n")
    return path


# (what, how the train file is made, words the error line must hold, found before any process starts)
DATA_ERRORS = {
    "missing column": (lambda d: write_csv(d / "t.csv", [r[:4] for r in GOOD], "label,d1,d2,a"),
                       ["t.csv", "no column 'b'", "data.sparse_columns"], True),
    "empty file": (lambda d: _empty(d / "t.csv"), ["t.csv", "empty file"], True),
    "non-number in a dense column": (lambda d: write_csv(d / "t.csv", good_with(20, (1, "abc", 1.0, 3, "1"))),
                                     ["t.csv:22", "column 'd1'", "'abc' is not a number"], True),
    "NaN label": (lambda d: write_csv(d / "t.csv", good_with(20, ("nan", 0.5, 1.0, 3, "1"))),
                  ["t.csv:22", "column 'label'", "'nan'"], True),
    "malformed Criteo line": (lambda d: _criteo(d / "t.tsv", bad_line=30),
                              ["t.tsv:30", "field 2 (I1)", "'x9' is not an integer"], True),
    "id outside its table": (lambda d: write_csv(d / "t.csv", good_with(3, (1, 0.5, 1.0, 57, "1"))),
                             ["feature 'a'", "57", "10 rows", "id_policy: modulo"], False),
    "bad line past data.check_lines": (lambda d: write_csv(d / "t.csv",
                                                           (GOOD * 160)[:9000] + [(1, "abc", 1.0, 3, "1")]),
                                       ["t.csv:9002", "column 'd1'", "'abc' is not a number"], False),
}
# more overrides for a case: the file with a bad line far down is also the held-out file, which
# the trainers read whole at their first evaluation (before step 1)
EXTRA = {"bad line past data.check_lines": lambda d: ["data.check_lines=10", f"data.eval_paths=[{d / 't.csv'}]"]}


@pytest.mark.serial  # bounds how long it takes: runs after the others (make test)
@pytest.mark.parametrize("what", list(DATA_ERRORS))
def test_a_data_error_is_one_line_and_exit_2(tmp_path, what):
    """Errors in the files' make-up and in their first ``data.check_lines`` lines are found by the
    launcher before any process starts, within 5 s of the command; errors further down (and ids
    outside a table) are found by the trainers as they read them (every trainer reads every
    line), reported once, and the job ends within 5 s of the report."""
    make, words, before_start = DATA_ERRORS[what]
    tmp = _fresh_tmp(tmp_path)
    train = make(tmp_path)
    criteo = train.suffix == ".tsv"
    columns = [] if criteo else COLUMNS
    source = "criteo" if criteo else "csv"
    good = _criteo(tmp_path / "e.tsv") if criteo else write_csv(tmp_path / "e.csv", GOOD)
    args = ["launch", "-n", "3", *DLRM, *TINY, *columns, "model.num_embeddings=10", "train.steps=6",
            f"data.source={source}", f"data.train_paths=[{train}]", f"data.eval_paths=[{good}]",
            f"train.out_dir={tmp_path / 'out'}", *EXTRA.get(what, lambda d: [])(tmp_path)]
    t0 = time.monotonic()
    with Job(args, env={"TMPDIR": str(tmp)}) as job:
        code = job.wait(timeout=240)
        ended = time.monotonic()
        pids = job.pids()
    errors = [(when, line) for when, line in job.lines if line.startswith("error:")]
    print(f"{what}: exit {code}, {ended - t0:.2f}s in all, "
          f"{ended - errors[0][0] if errors else float('nan'):.2f}s after the error line: {errors}")
    assert code == 2, job.output[-6000:]
    assert len(errors) == 1 and all(w in errors[0][1] for w in words), job.output[-6000:]
    assert not any(n in job.output for n in NOISE), job.output[-6000:]
    started = "serving" in job.output
    assert started != before_start, job.output[-6000:]  # checked by the launcher: no process started
    if before_start:
        # 6 s on an idle 2-core machine (the workers' fork server imports torch and torchrec, then
        # the check runs in a process forked from it), up to 15 s with another serial test beside
        # it; a job whose workers started would also print "serving" (checked above)
        assert ended - t0 < 30.0, f"{ended - t0:.2f}s from the command to its end"
    if not before_start:
        # one line, by one trainer: the other trainer and the server say nothing after it
        others = [line for when, line in job.lines if when >= errors[0][0] and line.startswith("[hybrid")]
        assert not others, others
    assert ended - errors[0][0] < 5.0, f"{ended - errors[0][0]:.2f}s from the error line to the end"
    _assert_nothing_left(pids, tmp)


def test_debug_shows_the_traceback_of_a_user_error(tmp_path):
    res = run_hybrid(["--debug", "launch", "-n", "3", *DLRM, "runtime.address=no.such.host.invalid"], timeout=120)
    assert res.returncode == 2, res.output
    assert "Traceback" in res.stderr and res.stderr.rstrip().splitlines()[-1].startswith("error: "), res.output
