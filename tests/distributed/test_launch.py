"""Launch paths other than the one-machine default: two torchrun agents ("nodes") on localhost
with c10d rendezvous, exactly the multi-machine command of docs/training.md; and usage errors of
launch/train."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys

import pytest

from tests.support.cli import REPO, kill_tree, run_hybrid
from tests.support.sockets import cmdline_of, parent_of

TINY = ["model.num_embeddings=200", "model.bottom_mlp=[8,16]", "model.top_mlp=[8,1]", "train.steps=4",
        "train.eval_every=0", "data.batch_size=8", "data.eval_batches=1", "train.plot=false", "train.progress=false"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_torchrun_agents_with_c10d_rendezvous(tmp_path):
    port = _free_port()
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "test-two-nodes",
           "-m", "hybrid.cli", "train", "--plan", "conf/plans/dlrm.yaml", "--config", "conf/train/dlrm.yaml",
           *TINY, f"train.out_dir={out}", "runtime.address=127.0.0.1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    agents = [subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True) for _ in range(2)]
    outputs = []
    try:
        for a in agents:
            outputs.append(a.communicate(timeout=240)[0])
    finally:
        for a in agents:
            kill_tree(a.pid)
            a.wait()
    joined = "\n".join(f"--- agent {i} (exit {a.returncode}):\n{o}" for i, (a, o) in enumerate(zip(agents, outputs)))
    assert [a.returncode for a in agents] == [0, 0], joined[-12000:]
    assert "3 trainers + 1 parameter server" in joined, joined[-12000:]
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()
             if json.loads(line)["kind"] == "train"]
    assert steps[-1] == 4


def test_plan_mistake_through_launch_is_one_message_and_exit_2():
    res = run_hybrid(["launch", "-n", "3", "train", "--plan", "conf/plans/dlrm.yaml", "--config", "conf/train/dlrm.yaml",
                      "plan.modules.dense_arch.strategy=fdsp"], timeout=60)
    assert res.returncode == 2, res.output
    assert "error: " in res.stderr and "modules.dense_arch.strategy" in res.stderr and "fsdp" in res.stderr, res.output
    assert "Traceback" not in res.stderr


def test_config_mistake_names_file_line_and_key(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  name: dlrm\ntrain:\n  steps: 10\n  optimiser: sgd\n")
    res = run_hybrid(["launch", "-n", "3", "train", "--plan", "conf/plans/dlrm.yaml", "--config", str(bad)], timeout=60)
    assert res.returncode == 2, res.output
    assert f"{bad}:5" in res.stderr and "optimiser" in res.stderr and "optimizer" in res.stderr, res.output


def test_an_out_dir_that_cannot_be_made_is_refused_before_any_process_starts(tmp_path):
    (tmp_path / "taken").write_text("a file where the run's folder would go")
    res = run_hybrid(["launch", "-n", "3", "train", "--plan", "conf/plans/dlrm.yaml", "--config", "conf/train/dlrm.yaml",
                      f"train.out_dir={tmp_path / 'taken'}"], timeout=60)
    assert res.returncode == 2, res.output
    assert res.stderr.strip() == f"error: train.out_dir {tmp_path / 'taken'}: a file is there, not a folder", res.output
    assert "serving" not in res.output, res.output  # no process started


def test_launch_runs_train_only():
    res = run_hybrid(["launch", "-n", "3", "export", "runs/x", "model.pt"], timeout=60)
    assert res.returncode == 2 and res.stderr.strip().startswith("error: launch runs `train`"), res.output


def test_negative_max_restarts_is_one_line():
    res = run_hybrid(["launch", "-n", "3", "--max-restarts", "-1", "train", "--plan", "conf/plans/dlrm.yaml"],
                     timeout=60)
    assert res.returncode == 2 and res.stderr.strip() == "error: launch --max-restarts: got -1; expected 0 or more", \
        res.output


def test_train_with_half_a_torchrun_environment_says_how_to_start_it():
    """No RANK: one-process mode (tests/distributed/test_one_process.py); RANK without the rest
    of torchrun's variables is a mistake."""
    clean = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    res = subprocess.run([sys.executable, "-m", "hybrid.cli", "train", "--plan", "conf/plans/dlrm.yaml"], cwd=REPO,
                         env={**clean, "RANK": "0"}, capture_output=True, text=True, timeout=60)
    assert res.returncode == 2, res.stderr
    assert "misses WORLD_SIZE, MASTER_ADDR, MASTER_PORT" in res.stderr and "hybrid launch -n N train" in res.stderr


def _csv(path, rows):
    header = "label,d1,d2,a,b\n"
    path.write_text(header + "".join(",".join(map(str, r)) + "\n" for r in rows))


def _csv_train(tmp_path, train_rows, eval_rows, steps: int) -> list[str]:
    """``hybrid train`` arguments for the demo DLRM on these rows (written as CSV), 8 samples per
    trainer, a train row every step."""
    _csv(tmp_path / "train.csv", train_rows)
    _csv(tmp_path / "eval.csv", eval_rows)
    return ["train", "--plan", "conf/plans/dlrm.yaml", "--config", "conf/train/dlrm.yaml",
            "model.features=[a,b]", "model.num_dense=2", "model.num_embeddings=10", "model.bottom_mlp=[8,16]",
            "model.top_mlp=[8,1]", "data.source=csv", f"data.train_paths=[{tmp_path}/train.csv]",
            f"data.eval_paths=[{tmp_path}/eval.csv]", "data.dense_columns=[d1,d2]", "data.sparse_columns=[a,b]",
            "data.batch_size=8", f"train.steps={steps}", "train.eval_every=0", "train.log_every=1",
            "train.progress=false", "train.plot=false"]


def test_csv_data_with_a_nan_batch_is_refused_or_skipped_and_changes_nothing(tmp_path):
    good = [(i % 2, 0.5 * i, 1.0, i % 7, f"{i % 5}|{(i + 1) % 5}") for i in range(64)]
    bad = list(good)
    bad[20] = (1, "nan", 1.0, 3, "1")  # global batch 1 (16 rows per global batch)
    common = _csv_train(tmp_path, bad, good[:16], steps=3)
    res = run_hybrid(["launch", "-n", "3", *common, f"train.out_dir={tmp_path}/err"], timeout=240)
    assert res.returncode != 0, res.output
    assert "NaN or inf" in res.stderr and "train.nonfinite=skip" in res.stderr, res.output
    res = run_hybrid(["launch", "-n", "3", *common, "train.nonfinite=skip", f"train.out_dir={tmp_path}/skip"],
                     timeout=240)
    assert res.returncode == 0, res.output
    assert "3 (48 samples, 1 batches skipped)" in res.stdout, res.output


def _train_rows(out) -> dict[int, tuple[float, int]]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: (r["loss"], r["skipped_batches"]) for r in rows if r["kind"] == "train"}


def test_batches_drawn_in_groups_train_as_batches_drawn_one_a_step(tmp_path):
    """``data.read_ahead``: the trainers agree on groups of batches in one all-reduce. Groups of 3
    here cross a skipped NaN batch, an unevenly split last batch and the passes' ends (70 rows:
    per pass global batches of 16, 16 (one NaN: skipped), 16, 16 and 6, split 3 + 3); every step's
    loss and skipped count equal drawing one batch a step, and a run resumed from step 3 (its next
    batch drawn in the middle of a group) continues with the same losses."""
    rows = [(i % 2, 0.5 * (i % 64), 1.0, i % 7, f"{i % 5}|{(i + 1) % 5}") for i in range(70)]
    rows[20] = (1, "nan", 1.0, 3, "1")
    common = [*_csv_train(tmp_path, rows, rows[:16], steps=9), "data.drop_last=false", "train.nonfinite=skip"]
    runs = {}
    for name, extra in [("one", ["data.read_ahead=1"]),
                        ("groups", ["data.read_ahead=3", f"checkpoint.dir={tmp_path}/ckpt", "checkpoint.every=3"])]:
        res = run_hybrid(["launch", "-n", "3", *common, *extra, f"train.out_dir={tmp_path}/{name}"], timeout=240)
        assert res.returncode == 0, res.output
        runs[name] = _train_rows(tmp_path / name)
    assert sorted(runs["one"]) == list(range(1, 10))
    assert runs["groups"] == runs["one"]  # float equality: the same batches, shares and skips
    assert runs["one"][9][1] == 2  # the NaN batch of the first two passes (the third stops before it)
    res = run_hybrid(["launch", "-n", "3", *common, "data.read_ahead=3",
                      f"checkpoint.resume={tmp_path}/ckpt/step_00000003", f"train.out_dir={tmp_path}/resumed"],
                     timeout=240)
    assert res.returncode == 0, res.output
    resumed = _train_rows(tmp_path / "resumed")
    assert resumed == {s: runs["one"][s] for s in range(4, 10)}
    # Async mode under DDP prefetches two batches ahead: the same batches and skips step by step
    # (the first step's loss equal, up to what one trainer's first push may change when the
    # other's first lookup is answered after it: async pushes apply on arrival).
    plan = tmp_path / "async.yaml"
    plan.write_text((REPO / "conf/plans/dlrm.yaml").read_text().replace("staleness: 0", "staleness: 1"))
    res = run_hybrid(["launch", "-n", "3", *[str(plan) if a == "conf/plans/dlrm.yaml" else a for a in common],
                      "data.read_ahead=3", f"train.out_dir={tmp_path}/async"], timeout=240)
    assert res.returncode == 0, res.output
    assert "prefetch depth 2" in res.output, res.output
    two_ahead = _train_rows(tmp_path / "async")
    assert {s: k for s, (_, k) in two_ahead.items()} == {s: k for s, (_, k) in runs["one"].items()}
    assert two_ahead[1][0] == pytest.approx(runs["one"][1][0], rel=1e-4)


@pytest.mark.serial  # bounds how long it takes: runs after the others (make test)
def test_a_rendezvous_port_in_use_is_named_at_once():
    """One node must host the rendezvous store; a taken port is an immediate, clear error (torch
    alone would try to join whatever listens there and fail a minute later without naming it)."""
    import time

    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        cmd = [sys.executable, "-m", "hybrid.launch.torchrun", "--address", "127.0.0.1", "--nnodes", "1",
               "--nproc-per-node", "3", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
               "-m", "hybrid.cli", "train", "--plan", "conf/plans/dlrm.yaml", *TINY]
        t0 = time.monotonic()
        res = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=60)
        took = time.monotonic() - t0
    assert res.returncode == 2, res.stderr[-4000:]
    assert f"127.0.0.1:{port} is already in use" in res.stderr and "--rdzv-endpoint" in res.stderr, res.stderr
    assert "Traceback" not in res.stderr
    assert took < 30, took


def test_a_refusal_of_the_forked_agent_is_its_one_line_and_exit_2():
    """torchrun's agent, forked from the workers' server as ``hybrid launch`` runs it, refusing its
    own arguments: its one line and exit 2 reach the launcher, no traceback."""
    code = ("import sys; from hybrid.launch import workers; sys.exit(workers.run_agent(['--exit-barrier-timeout', "
            "'abc', '--standalone', '--nproc-per-node=1', '-m', 'hybrid.cli', 'train']))")
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2, res.stderr[-4000:]
    assert res.stderr.strip().splitlines() == [
        "error: python -m hybrid.launch.torchrun: --exit-barrier-timeout: got 'abc'; expected a number of seconds "
        "above 0"], res.stderr[-4000:]


PLAN_MISTAKES = {
    "unknown module path": (["plan.modules.dense_ach.strategy=ddp"], ["dense_ach", "dense_arch"]),
    "parameter_server on a dense module": (["plan.modules.dense_arch.strategy=parameter_server",
                                            "plan.modules.dense_arch.optimizer.name=sgd"],
                                           ["dense_arch", "parameter_server", "EmbeddingBagCollection"]),
    "unknown option": (["plan.modules.dense_arch.bucket_cap=10"], ["bucket_cap", "bucket_cap_mb"]),
    "wrong type": (["plan.modules.dense_arch.bucket_cap_mb=big"], ["bucket_cap_mb", "big"]),
    "optimizer unknown to the server": (["plan.modules.sparse_arch.embedding_bag_collection.optimizer.name=adamw"],
                                        ["adamw", "rowwise_adagrad"]),
    "topology that cannot fit": (["plan.topology.parameter_servers=3"], ["parameter_servers", "trainer"]),
}


@pytest.mark.parametrize("mistake", list(PLAN_MISTAKES))
def test_plan_error_categories_end_to_end_exit_2_without_traceback(mistake):
    overrides, must = PLAN_MISTAKES[mistake]
    res = run_hybrid(["launch", "-n", "3", "train", "--plan", "conf/plans/dlrm.yaml", "--config", "conf/train/dlrm.yaml",
                      *overrides], timeout=60)
    assert res.returncode == 2, res.output
    assert res.stderr.startswith("error: ") or "\nerror: " in res.stderr, res.output
    assert all(m in res.stderr for m in must), res.output
    assert "Traceback" not in res.stderr, res.output


@pytest.mark.parametrize("text,must", [
    ("model: dlrm\nmodules:\n  dense_arch: !!python/object/apply:os.system [\"touch PWNED\"]\n", ["python"]),
    ("model: dlrm\nmodules:\n  dense_arch: {strategy: ddp\n  over_arch: x\n", [":4:", "invalid YAML"]),
], ids=["python tag", "bad YAML syntax"])
def test_plan_files_that_must_not_load_exit_2(tmp_path, text, must):
    plan = tmp_path / "plan.yaml"
    plan.write_text(text)
    res = run_hybrid(["launch", "-n", "3", "train", "--plan", str(plan), "--config", "conf/train/dlrm.yaml"],
                     timeout=60, cwd=tmp_path)
    assert res.returncode == 2, res.output
    assert str(plan) in res.stderr and all(m in res.stderr for m in must), res.output
    assert "Traceback" not in res.stderr, res.output
    assert not (tmp_path / "PWNED").exists()  # the tag's code never ran


def test_tables_that_do_not_fit_are_refused_by_launch_and_by_the_server():
    """``hybrid launch`` refuses, before starting any process, servers that do not fit this
    machine; started without that check (torchrun directly), the server refuses to allocate its
    shard and trainer 0 says so: one line naming the table, the bytes and the memory, exit 2."""
    from hybrid.cli import launch_command

    res = run_hybrid(["launch", "-n", "3", "train", "--plan", "conf/plans/dlrm.yaml", "--config",
                      "conf/train/dlrm.yaml", "model.num_embeddings=100000000"], timeout=60)
    assert res.returncode == 2, res.output
    assert res.stderr.startswith("error: ps0 on this machine: tables need 164.66 GiB"), res.output
    assert "t_C1 on ps0: 6.33 GiB" in res.stderr and "GiB available (" in res.stderr, res.output
    cmd = launch_command(3, ["train", "--plan", "conf/plans/dlrm.yaml", *TINY, "runtime.server_memory_fraction=1e-7"])
    res = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    errors = [line for line in res.stderr.splitlines() if line.startswith("error: ")]
    assert res.returncode == 2, res.stderr[-4000:]
    assert len(errors) == 1 and errors[0].startswith("error: ps0 (sparse_arch.embedding_bag_collection): tables "
                                                     "need "), res.stderr[-4000:]
    assert "runtime.server_memory_fraction=1e-07" in errors[0] and "the largest, t_C" in errors[0], errors
    assert "Traceback" not in res.stderr


def _named_semaphores(pid: int) -> list[str]:
    """The POSIX semaphores process ``pid`` has mapped that still have a name in /dev/shm."""
    mapped = set()
    for line in open(f"/proc/{pid}/maps"):
        fields = line.split()
        if len(fields) >= 6 and fields[5].startswith("/dev/shm/sem."):
            mapped.add(int(fields[4]))
    named = []
    for entry in os.scandir("/dev/shm"):
        try:
            if entry.name.startswith("sem.") and entry.inode() in mapped:
                named.append(entry.name)
        except OSError:  # removed meanwhile
            pass
    return named


@pytest.mark.parametrize("start", ["fork", "exec"])
def test_workers_are_forked_from_one_server_each_in_a_session_of_its_own(tmp_path, start):
    """``hybrid launch``'s workers (and its check of the plan) are forked from one fork server
    below the launcher, which imported torch and torchrec once; with ``HYBRID_WORKER_START=exec``
    each is a new ``python -m hybrid.cli`` (torchrun's own way). Either way each worker leads a session of its
    own (torchrun stops a worker by signalling its group), and the fork server too (a signal to
    the launcher's group must not end it, and with it the workers).

    ``TMPDIR`` is deeper than a Unix socket's path allows below it: the server's socket folder is
    made in the system's temp folder (and removed at the end), the workers keep ``TMPDIR``."""
    from tests.distributed.test_stops import DLRM
    from tests.distributed.test_stops import TINY as LAUNCH_TINY
    from tests.support.job import Job
    from tests.support.sockets import unix_socket_paths

    out = tmp_path / "out"
    deep = tmp_path / ("deep-" + "d" * max(1, 90 - len(str(tmp_path))))
    deep.mkdir()
    with Job(["launch", "-n", "3", *DLRM, *LAUNCH_TINY, "train.progress=true", "train.steps=100000", f"train.out_dir={out}"],
             env={"HYBRID_WORKER_START": start, "TMPDIR": str(deep)}) as job:
        job.wait_training(out)
        workers = {name: job.pid_of_role(name) for name in ("trainer0", "trainer1", "ps0")}
        for name, pid in workers.items():
            assert f"TMPDIR={deep}\0" in open(f"/proc/{pid}/environ").read(), name
        parents = {name: parent_of(pid) for name, pid in workers.items()}
        for name, pid in workers.items():
            assert os.getsid(pid) == pid, (name, pid, os.getsid(pid))
            # multiprocessing as in a new interpreter: its locks (trainer0's progress bar makes
            # one) are semaphores unlinked at once, not named ones left to the launcher's
            # resource tracker, which would warn of them as leaked when the job ends
            assert not _named_semaphores(pid), (name, _named_semaphores(pid))
        if start == "exec":
            assert set(parents.values()) == {job.proc.pid}, parents
            for name, pid in workers.items():
                assert " -m hybrid.cli train " in cmdline_of(pid), (name, cmdline_of(pid))
        else:
            (server,) = set(parents.values())
            assert "multiprocessing.forkserver" in cmdline_of(server), cmdline_of(server)
            assert "'torchrec'" in cmdline_of(server), cmdline_of(server)  # imported before any fork
            assert parent_of(server) == job.proc.pid and os.getsid(server) == server, (server, parent_of(server))
            # the plan was checked in a process forked from the server: the launcher never loaded
            # torchrec (nor fbgemm_gpu's library, which torchrec loads), the server did
            assert "fbgemm_gpu" in open(f"/proc/{server}/maps").read()
            assert "fbgemm_gpu" not in open(f"/proc/{job.proc.pid}/maps").read()
            (socket,) = unix_socket_paths([server])
            folder = os.path.dirname(socket)
            assert os.path.dirname(folder) == "/tmp" and os.path.basename(folder).startswith("pymp-"), socket
            os.killpg(job.proc.pid, signal.SIGINT)  # Ctrl-C: the launcher ends the job and removes the folder
            assert job.wait(timeout=60) == 130, job.output[-4000:]
            assert not os.path.exists(folder), f"{folder} left after the job"


def test_a_forked_worker_that_ended_is_closed_without_error(tmp_path):
    """torchrun signals the workers it polled as running; the fork server reaps a worker the moment
    it ends, so one that ended in between has no process group left to signal: closing its
    handler is no error (it was a ProcessLookupError traceback from the launcher, exit 1)."""
    from torch.distributed.elastic.multiprocessing import api

    from hybrid.launch import workers

    if not workers.forked():
        pytest.skip(f"{workers.ENV}=exec: no forked workers")
    workers.install()
    handler = api.get_subprocess_handler(sys.executable, (*workers.COMMAND, "plan", "--help"), dict(os.environ),
                                         str(tmp_path / "out"), str(tmp_path / "err"), 0, None)
    assert type(handler).__name__ == "ForkedHandler"
    assert handler.proc.wait(120) == 0, (tmp_path / "err").read_text()
    handler.close(signal.SIGTERM)
    assert "usage: hybrid plan" in (tmp_path / "out").read_text()
