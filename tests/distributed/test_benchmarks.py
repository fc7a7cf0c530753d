"""The benchmarks run, with a tiny workload, as a user runs them (``python -m benchmarks.run`` and
``python -m benchmarks.memory`` in subprocesses). Nothing here is timed: the checks are that every
system trains the same model on the same data -- the same first loss everywhere (async: within
what another trainer's first push may change), and for the
synchronous systems the same final loss as one process -- and that FSDP holds a shard of what
DDP holds. Speed is the benchmark's business (docs/performance.md)."""

from __future__ import annotations

import json
import math
import pickle
import signal
import subprocess
import sys
import time

import pytest

from benchmarks.launch import BenchmarkError, HostServer, kill_all
from benchmarks.network import namespaces, stale
from benchmarks.systems import DEFAULT_SYSTEMS, SYSTEMS
from tests.support.cli import REPO, kill_tree, run_hybrid
from tests.support.network import needs_root, root_links
from tests.support.sockets import cmdline_of, descendants, state_of

TINY = ["--tables", "2", "--rows", "200", "--dim", "8", "--bottom-mlp", "16,8", "--top-mlp", "16,1",
        "--batch", "16", "--warmup", "1", "--steps", "3", "--repeat", "1"]


def _lines(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


@pytest.mark.slow
def test_every_system_trains_the_same_model_on_the_same_batches():
    res = run_hybrid(TINY, module="benchmarks.run", timeout=400)
    assert res.returncode == 0, res.output
    lines = {l["system"]: l for l in _lines(res.stdout)}
    assert list(lines) == DEFAULT_SYSTEMS, res.output
    for name, l in lines.items():
        assert "error" not in l, l
        assert math.isfinite(l["first_loss"]) and math.isfinite(l["final_loss"]), l
        assert l["samples_per_s"] > 0 and l["median_step_s"] > 0, l
        assert all(p["peak_rss_mb"] > 0 for p in l["processes"].values()), l
        assert l["runs_samples_per_s"] == [l["samples_per_s"]], l
    first = lines["local"]["first_loss"]
    for name, l in lines.items():  # same initial weights, same first batch
        # Async pushes apply on arrival and staleness bounds a lookup's rows from below only: a
        # trainer whose step 0 starts late may read the other's step-0 push (seen in about one
        # run in four of this tiny, fast workload, 6e-6 apart; seeds 1 and 2 instead of 0 move
        # local's first loss by 0.4% and more).
        rel = 1e-4 if name == "hybrid_async" else 1e-6
        assert l["first_loss"] == pytest.approx(first, rel=rel), (name, l["first_loss"], first)
    final = lines["local"]["final_loss"]
    for name in ("hybrid_sync", "hybrid_sync_fsdp", "hybrid_sync_dynamic"):  # same updates as one process
        assert lines[name]["final_loss"] == pytest.approx(final, rel=1e-5), (name, lines[name]["final_loss"], final)
    assert lines["torchrec_dmp"]["final_loss"] == pytest.approx(final, rel=1e-3)  # FBGEMM's fused kernel
    # The tutorial's pattern has no step barrier on the server: one trainer's next lookup may
    # read a table before the other trainer's DistributedOptimizer step of it lands (measured:
    # up to 2e-5 relative after 3 steps), so it is the same training only approximately.
    assert lines["rpc_tutorial"]["final_loss"] == pytest.approx(final, rel=1e-3)
    for name in ("hybrid_sync", "hybrid_async", "hybrid_sync_fsdp"):
        servers = lines[name]["servers"]
        assert list(servers) == ["ps0"], servers
        s = servers["ps0"]
        # Per step: one lookup and one gradient push from each of the 2 trainers. Every system
        # prefetches each next batch's rows (hybrid_async two batches ahead), so at the edges of
        # the 3-step window up to one step's lookups per trainer (two for hybrid_async) fall on
        # the other side (sync: the first window step's rows were asked for with the last
        # warm-up step's push).
        ahead = 2 if name == "hybrid_async" else 1
        assert 2 * (3 - ahead) / 3 <= s["lookups_per_step"] <= 2 * (3 + 1) / 3, s
        if name == "hybrid_async":
            assert 2 * (3 - 1) / 3 <= s["gradient_pushes_per_step"] <= 2 * (3 + 1) / 3, s
        else:
            assert s["gradient_pushes_per_step"] == 2, s
            # Each push carries the next step's lookups in one message; only the window's last
            # push (no next batch) goes alone: (2 trainers x 2 + 2) / 3 steps = 2 messages.
            assert s["rpcs_per_step"] + s["channel_messages_per_step"] <= 2 + 1e-9, s
        # Trainers and server share this host: every lookup goes through shared memory.
        assert s["channel_messages_per_step"] == s["lookups_per_step"], s
        assert s["bytes_sent_per_step"] > 0 and s["bytes_recv_per_step"] > 0, s
        assert 0 < s["unique_id_ratio"] <= 1, s
        assert set(lines[name]["breakdown_s"]) >= {"lookup", "dense", "optimizer"}, lines[name]["breakdown_s"]
    assert "hybrid_sync >= 1.4x torchrec_dmp" in res.stderr  # the ratio table


def test_dmp_with_gloos_event_loop_as_hybrid_runs_it_trains_the_same():
    """``torchrec_dmp_batch`` (not a default system): DMP with its gloo event-loop thread under
    SCHED_BATCH (its run fails where no such thread is found) trains exactly as DMP does, and the
    ratio table gets a column for it."""
    res = run_hybrid([*TINY, "--systems", "torchrec_dmp,torchrec_dmp_batch"], module="benchmarks.run", timeout=200)
    assert res.returncode == 0, res.output
    lines = {l["system"]: l for l in _lines(res.stdout)}
    assert list(lines) == ["torchrec_dmp", "torchrec_dmp_batch"] and "torchrec_dmp_batch" in SYSTEMS
    assert all("error" not in l for l in lines.values()), lines
    for key in ("first_loss", "final_loss"):
        assert lines["torchrec_dmp_batch"][key] == lines["torchrec_dmp"][key], (key, lines)
    assert "/torchrec_dmp_batch" in res.stderr, res.stderr


def test_a_run_longer_than_the_shutdown_timeout_keeps_its_server():
    """The server serves until trainer 0 releases it, as under `hybrid train`: with only its RPC
    shutdown to wait in, it left after runtime.shutdown_timeout_s and a longer run failed (seen
    at --steps 6000: 'closed the shared-memory channel'). Here the trainers' set-up and steps
    outlast a 0.5 s shutdown timeout at least three times over (the processes start in a fraction
    of a second: the steps make the run long; 300 steps took 2.4 s on a fast day)."""
    from benchmarks.systems.hybrid_ps import run_hybrid_sync
    from benchmarks.workload import Workload

    timeout = 0.5
    w = Workload(tables=2, rows=200, dim=8, bottom_mlp=[16, 8], top_mlp=[16, 1], batch=16, warmup=1, steps=500)
    t0 = time.monotonic()
    reports = run_hybrid_sync(w, timeout_s=300, runtime={"shutdown_timeout_s": timeout})
    assert time.monotonic() - t0 > 3 * timeout  # the run outlasted the shutdown timeout by far
    trainers = [r for r in reports if r["name"].startswith("trainer")]
    assert len(trainers) == 2 and all(len(r["losses"]) == 501 for r in trainers), reports  # warm-up and steps


def test_wire_dtype_bfloat16_halves_the_rows_bytes_and_their_minimum():
    res = run_hybrid([*TINY, "--systems", "hybrid_sync", "--wire-dtype", "bfloat16"], module="benchmarks.run",
                     timeout=300)
    assert res.returncode == 0, res.output
    (line,) = _lines(res.stdout)
    assert line["wire_dtype"] == "bfloat16", line
    s = line["servers"]["ps0"]
    # The minimum counts 2 bytes an element each way; the rows the server sent are exactly that.
    assert s["min_bytes_per_step"] == pytest.approx(s["unique_rows_per_step"] * 8 * 2), s
    assert s["bytes_sent_per_step"] == pytest.approx(s["min_bytes_per_step"]) and s["bytes_sent_over_min"] == 1, s
    # In: the gradients (2 bytes an element) and the lookups' ids (8 bytes each).
    assert s["bytes_recv_per_step"] > s["min_bytes_per_step"], s


def test_pool_on_server_sends_bags_and_trains_as_one_process():
    res = run_hybrid([*TINY, "--systems", "local,hybrid_sync", "--pool-on", "server"], module="benchmarks.run",
                     timeout=300)
    assert res.returncode == 0, res.output
    local, line = _lines(res.stdout)
    assert line["pool_on"] == "server", line
    assert line["final_loss"] == pytest.approx(local["final_loss"], rel=1e-5), (line, local)
    s = line["servers"]["ps0"]
    # Every lookup's answer is its trainer's bags pooled: 16 samples x 2 tables x dim 8, float32.
    assert s["bytes_sent_per_step"] == pytest.approx(s["lookups_per_step"] * 16 * 2 * 8 * 4), s


def test_memory_benchmark_fsdp_holds_a_shard_of_what_ddp_holds():
    res = run_hybrid(["--width", "64", "--layers", "2", "--trainers", "2", "--steps", "2", "--rows", "100"],
                     module="benchmarks.memory", timeout=300)
    assert res.returncode == 0, res.output
    by = {l["strategy"]: l for l in _lines(res.stdout)}
    ddp, fsdp = by["ddp"], by["fsdp"]
    assert ddp["dense_params"] == fsdp["dense_params"]
    # DDP: every trainer holds the whole dense model, its gradients and Adam's two moments.
    assert ddp["param_bytes"] == 4 * ddp["dense_params"]
    assert ddp["grad_bytes"] == ddp["param_bytes"]
    assert ddp["optim_bytes"] >= 2 * ddp["param_bytes"]
    # FSDP at 2 trainers: about half (dim-0 shards, padded).
    assert fsdp["total_bytes"] <= 0.55 * ddp["total_bytes"], (fsdp, ddp)
    assert fsdp["total_bytes"] >= 0.45 * ddp["total_bytes"], (fsdp, ddp)
    assert "targets" in res.stderr
    # The plan report's per-trainer estimate (`hybrid plan show`) is what the trainers hold.
    for line in (ddp, fsdp):
        assert line["plan_estimate_bytes"] == pytest.approx(line["total_bytes"], rel=0.10), line


def _new_networks(before: set[str]) -> list[str]:
    """Namespaces a finished run left behind (other tests' live networks are not counted)."""
    return [n for n in stale() if n not in before]


@pytest.mark.slow
@needs_root
def test_on_the_emulated_network_every_system_crosses_the_links_from_the_same_loss():
    before, links = set(namespaces()), root_links()
    systems = ["local", "rpc_tutorial", "torchrec_dmp", "hybrid_sync"]  # one of each way to talk
    res = run_hybrid([*TINY, "--network", "emulated:rate=1gbit,delay=100us", "--systems", ",".join(systems)],
                     module="benchmarks.run", timeout=400)
    assert res.returncode == 0, res.output
    lines = {l["system"]: l for l in _lines(res.stdout)}
    assert list(lines) == systems, res.output
    first, final = lines["local"]["first_loss"], lines["local"]["final_loss"]
    for name, l in lines.items():
        assert "error" not in l, l
        held = l["network"].pop("delay_line")  # what this system's run sent through the delay line
        assert l["network"] == {"kind": "emulated", "rate_bit_s": 10**9, "delay_us": 100.0, "hosts": 3}, l
        assert held["dropped"] == 0 and (held["frames"] > 0) == (name != "local"), (name, held)
        if name != "local":  # frames may leave up to half the delay line's lateness at waking early
            assert held["held_us"]["p10"] >= 80, (name, held)
        assert l["first_loss"] == pytest.approx(first, rel=1e-6), (name, l["first_loss"], first)
        for proc, p in l["processes"].items():  # one host per process: only others' traffic crosses eth0
            crossed = p["wire_bytes_sent_per_step"] > 0 and p["wire_bytes_recv_per_step"] > 0
            assert crossed == (name != "local"), (name, proc, p)
    assert lines["hybrid_sync"]["final_loss"] == pytest.approx(final, rel=1e-5)
    s = lines["hybrid_sync"]["servers"]["ps0"]
    # The server is another host: no shared memory, every lookup goes over the TCP step
    # connection, not RPC, and pool_on: auto (the default) has the server pool the trainers'
    # bags: each answer 16 samples x 2 tables x dim 8 in float32, fewer bytes than the rows.
    assert lines["hybrid_sync"]["pool_on"] == "server", lines["hybrid_sync"]
    assert s["channel_messages_per_step"] == s["lookups_per_step"] > 0, s
    assert s["bytes_sent_per_step"] == pytest.approx(s["lookups_per_step"] * 16 * 2 * 8 * 4), s
    assert s["min_bytes_per_step"] == pytest.approx(s["unique_rows_per_step"] * 8 * 4), s  # rows, as ever
    # The wire carries at least the payload the server counted.
    assert s["wire_bytes_sent_per_step"] >= s["bytes_sent_per_step"] > 0, s
    assert s["wire_bytes_recv_per_step"] >= s["bytes_recv_per_step"] > 0, s
    assert s["wire_bytes_sent_over_min"] == pytest.approx(s["wire_bytes_sent_per_step"] / s["min_bytes_per_step"])
    assert "bytes on the wire per step / minimum" in res.stderr
    assert _new_networks(before) == [] and root_links() == links


@needs_root
def test_a_failed_system_and_an_interrupted_run_leave_no_network_and_no_process(tmp_path):
    """One emulated run of two systems, each far more steps than its 4 s timeout allows: the first
    system's ranks are killed at the timeout and the run goes on to the second; SIGTERM while the
    second's ranks run kills every process (the hosts' servers and their ranks) and removes the
    network."""
    before, links = set(namespaces()), root_links()
    err_path = tmp_path / "stderr"
    with open(err_path, "w") as err_file:
        proc = subprocess.Popen([sys.executable, "-m", "benchmarks.run", *TINY, "--steps", "100000", "--network",
                                 "emulated", "--systems", "hybrid_sync,hybrid_async", "--timeout", "4"],
                                cwd=REPO, stdout=subprocess.PIPE, stderr=err_file, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        seen: set[int] = set()  # before the first system's failure: the hosts' servers and its ranks
        while True:
            failed = "run 1/1: hybrid_sync failed" in err_path.read_text()  # printed before the next starts
            running = set(_ranks(proc.pid))
            if not failed:
                seen |= running
            elif len(running - seen) >= 3:
                break
            assert proc.poll() is None and time.monotonic() < deadline, (proc.poll(), err_path.read_text())
            time.sleep(0.05)
        assert len(seen) >= 6, seen
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)
    finally:
        kill_tree(proc.pid)
    err = err_path.read_text()
    assert proc.returncode == 130, err
    assert "passed the 4s timeout" in err, err
    assert err.strip().splitlines()[-1] == "benchmarks.run: interrupted; its processes were killed and its network removed"
    assert not [p for p in seen | running if state_of(p) != "Z"], (seen, running)
    assert _new_networks(before) == [] and root_links() == links


def _ranks(pid: int) -> list[int]:
    """The processes below ``pid`` that multiprocessing spawned (not its resource tracker): the
    emulated hosts' servers, and the ranks they forked."""
    return [p for p in descendants(pid)[1:] if "spawn_main" in (cmdline_of(p) or "")]


def _sleep_rank(rank: int, world_size: int, store: str) -> None:
    time.sleep(120)


def _wait_stopped(pid: int, timeout_s: float = 20.0) -> bool:
    """Whether ``pid`` ended (gone, or a zombie its parent has not reaped) within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while state_of(pid) != "Z" and time.monotonic() < deadline:
        time.sleep(0.05)
    return state_of(pid) == "Z"


def test_an_emulated_hosts_server_out_of_step_or_gone_leaves_no_rank_running():
    """The server that forks an emulated host's ranks (run here on this host): a running rank's
    liveness asks the server nothing; a request interrupted between its sending and its answer (a
    signal's KeyboardInterrupt) leaves the pipe out of step, so the next request fails at once
    rather than read the stale answer;
    ``kill_all`` then still kills the rank, by its pid, and raises nothing (an interrupted run's
    KeyboardInterrupt must reach the caller); and a rank dies with its server."""
    server = HostServer(None)
    try:
        args = pickle.dumps((_sleep_rank, 0, 1, "/nonexistent", 1, True, {}, {}))
        a, b = server.fork(args), server.fork(args)
        assert a.is_alive() and b.is_alive()
        real = server._conn

        class Interrupted:
            def send(self, obj: object) -> None:
                real.send(obj)

            def poll(self, timeout: float) -> bool:
                raise KeyboardInterrupt

        server._conn = Interrupted()
        # A running rank's liveness is its pidfd's: no request goes to the server (a run's wait
        # takes no CPU from the ranks it measures).
        assert a.is_alive() and b.is_alive()
        with pytest.raises(KeyboardInterrupt):
            server.exitcode(a.pid)
        server._conn = real
        with pytest.raises(BenchmarkError, match="stopped answering"):
            server.exitcode(b.pid)
        kill_all([a])
        assert _wait_stopped(a.pid), a.pid
        assert state_of(b.pid) != "Z"
    finally:
        server.stop()
    assert _wait_stopped(b.pid), b.pid
