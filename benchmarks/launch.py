"""Fresh processes for one system, and what each process measures about itself.

:func:`spawn` starts ``world_size`` fresh processes, each calling ``fn(rank, world_size, store,
**kwargs)`` where ``store`` is a private temp directory for file-store rendezvous (no port is ever
fixed, so runs never collide). Each rank's return value comes back in a list. A rank that raises, or
a run past its timeout, kills every child (SIGKILL) and raises :class:`BenchmarkError` with each
rank's traceback: a benchmark never hangs and never leaves a process behind. The processes are
forked from ``multiprocessing``'s fork server, which imported torch and torchrec once
(:data:`PRELOAD`): a process inherits those modules and nothing else (no thread, process group, RPC
agent or tensor of the parent's), and starts in a fraction of a second rather than the seconds of
CPU those imports take. With ``hosts`` (an :class:`~benchmarks.network.EmulatedNetwork`) rank ``r``
runs on emulated host ``r``, forked from that host's own server (:class:`HostServer`: an
interpreter started once in the host's namespaces, which imported the same modules).

:class:`Meter` measures one process over the timed window: wall seconds, CPU seconds (every
thread of the process, so a busy-spinning transport thread shows), peak RSS, and on an emulated
host the bytes its interface sent and received.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import pickle
import resource
import select
import signal
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from multiprocessing import connection as mp_connection
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from benchmarks.network import EmulatedNetwork


class BenchmarkError(RuntimeError):
    """A rank of a system failed or the system ran past its timeout."""


class Meter:
    """Wall and CPU time of this process between :meth:`start` and :meth:`stop`, and peak RSS."""

    def __init__(self) -> None:
        self.wall = [0.0, 0.0]
        self.cpu = [0.0, 0.0]
        self.wire: list[tuple[int, int] | None] = [None, None]
        self._profiler = None

    def start(self) -> None:
        self._start_profiler()
        self.wire[0] = wire_bytes()
        self.wall[0], self.cpu[0] = time.perf_counter(), time.process_time()

    def stop(self) -> None:
        self.wall[1], self.cpu[1] = time.perf_counter(), time.process_time()
        self.wire[1] = wire_bytes()
        if self._profiler is not None:
            self._profiler.send_signal(signal.SIGINT)  # py-spy writes its profile and exits
            self._profiler.wait(timeout=60)
            self._profiler = None

    def _start_profiler(self) -> None:
        """With ``BENCH_PROFILE_CMD`` set (e.g. ``py-spy record --pid {pid} -o /tmp/{name}.txt``
        or ``perf record -g --pid {pid} -o /tmp/{name}.data``), run it over this process's timed
        window; it gets SIGINT at the end. ``BENCH_PROFILE_ONLY=ps0,trainer1`` limits it to those
        processes. Profilers perturb the timings: use their profiles, not the numbers."""
        template = os.environ.get("BENCH_PROFILE_CMD")
        only = os.environ.get("BENCH_PROFILE_ONLY")
        name = _process_name()
        if not template or (only and name not in only.split(",")):
            return
        import shlex
        import subprocess

        cmd = shlex.split(template.format(pid=os.getpid(), name=name))
        self._profiler = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(1.0)  # let it attach before the window opens

    def report(self, name: str) -> dict:
        """``cpu_util`` is CPU seconds per wall second in the window (1.0 = one core busy);
        ``wire_bytes_recv``/``wire_bytes_sent``: what the host's interface carried in the window
        (emulated hosts only: IP packets with their headers, every process of the host)."""
        wall = self.wall[1] - self.wall[0]
        cpu = self.cpu[1] - self.cpu[0]
        report = {
            "name": name,
            "window_s": wall,
            "cpu_s": cpu,
            "cpu_util": cpu / wall if wall > 0 else 0.0,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        }
        if self.wire[0] is not None and self.wire[1] is not None:
            report["wire_bytes_recv"] = self.wire[1][0] - self.wire[0][0]
            report["wire_bytes_sent"] = self.wire[1][1] - self.wire[0][1]
        return report


def wire_bytes() -> tuple[int, int] | None:
    """Bytes received and sent so far by this emulated host's interface (``/proc/net/dev`` of the
    process's network namespace); None off an emulated host."""
    from benchmarks.network import ADDRESS_ENV, IFNAME

    if ADDRESS_ENV not in os.environ:
        return None
    with open("/proc/net/dev") as f:
        for line in f:
            name, _, counters = line.partition(":")
            if name.strip() == IFNAME:
                fields = counters.split()
                return int(fields[0]), int(fields[8])
    return None


def batch_gloo_loops() -> None:
    """Put this process's gloo event-loop thread under ``SCHED_BATCH`` as hybrid's trainers run it
    (:func:`hybrid.launch.init.batch_gloo_loops`); a benchmark that asked for it fails where there
    is none to set, rather than measure the stock policy under the other's name."""
    from hybrid.launch.init import batch_gloo_loops as batch

    if not batch():
        raise RuntimeError("no gloo event-loop thread found to put under SCHED_BATCH")


def _process_name() -> str:
    """``trainer0``, ``ps0``, ... (the RPC name, else the trainer rank), or ``local``."""
    import torch.distributed as dist
    import torch.distributed.rpc as rpc

    if rpc.api._is_current_rpc_agent_set():
        return rpc.get_worker_info().name
    if dist.is_initialized():
        return f"trainer{dist.get_rank()}"
    return "local"


METER = Meter()
"""This process's meter; servers have theirs started and stopped by trainer 0 (:func:`rpc_mark`)."""


def rpc_mark(what: str) -> None:
    """Start or stop the meter of the process this runs in (called over RPC on servers)."""
    METER.start() if what == "start" else METER.stop()


def mark_servers(names: list[str], what: str) -> None:
    """Start or stop the meters of the RPC workers ``names`` (from trainer 0)."""
    import torch.distributed.rpc as rpc

    for name in names:
        rpc.rpc_sync(name, rpc_mark, args=(what,))


PRELOAD = ["torch", "torch.distributed.rpc", "torch.distributed.fsdp", "torchrec"]
"""What the fork server imports once, before it forks any process. Not hybrid: each system imports
its own code, so the baselines' processes (torchrec's DMP, the RPC tutorial's pattern) run plain
torch and torchrec, without hybrid's native library loaded."""


def _child(fn, rank, world_size, store, threads, quiet, env, kwargs) -> None:
    os.environ.update(env)  # a forked process has the fork server's environment, from its start
    code = 0
    if quiet:
        # Deprecation notes and info lines of torch, torchrec and hybrid would bury the results.
        warnings.simplefilter("ignore")
        logging.disable(logging.WARNING)
    try:
        import torch

        torch.set_num_threads(threads)
        result = fn(rank, world_size, store, **kwargs)
        with open(Path(store) / f"result{rank}.pkl", "wb") as f:
            pickle.dump(result, f)
    except BaseException:  # noqa: BLE001 - reported by the parent
        code = 1
        (Path(store) / f"error{rank}.txt").write_text(traceback.format_exc())
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def kill_all(procs: list) -> None:
    """SIGKILL every live process of ``procs`` and reap them (also used by the test harness).
    Never raises: it runs on the way out of an interrupted run, whose KeyboardInterrupt must
    reach the caller. A rank whose emulated host's server no longer answers is killed by its pid
    (the server reaps its ranks only when asked, so until then the pid is still the rank's)."""
    for p in procs:
        try:
            alive = p.is_alive()
        except BenchmarkError:
            alive = True
        if alive:
            try:
                os.kill(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for p in procs:
        try:
            p.join(timeout=5)
        except BenchmarkError:
            pass


class HostServer:
    """The process that forks every rank run on one emulated host.

    A new interpreter started once in the host's namespaces (``multiprocessing`` spawn, with the
    host's script as its executable) imports :data:`PRELOAD`, then forks one process per request,
    as ``multiprocessing``'s fork server does where there is one host: a rank starts in a fraction
    of a second rather than importing torch and torchrec again, and every system's rank ``r`` runs
    on the same host ``r``. The rank's function and arguments are unpickled in the rank, so the
    server itself imports no system's code. When this end closes (:meth:`stop`, or the benchmark
    dies), the server kills what it forked and exits; a rank the server forked also dies with
    the server however that ends (:func:`_die_with`).
    """

    def __init__(self, executable: str | None) -> None:
        ctx = mp.get_context("spawn")
        self._conn, theirs = ctx.Pipe()
        self._in_step = True  # False once a request went unanswered (see _ask)
        self._process = ctx.Process(target=_serve_host, args=(theirs,), name="hybrid-bench-host", daemon=True)
        with _executable(ctx, executable):
            self._process.start()
        theirs.close()

    def fork(self, payload: bytes) -> HostProcess:
        """A process running ``_child(*pickle.loads(payload))`` on this host."""
        return HostProcess(self, self._ask(("fork", payload)))

    def exitcode(self, pid: int) -> int | None:
        """The exit code of ``pid`` (minus the signal that killed it), or None while it runs."""
        return self._ask(("poll", pid))

    def _ask(self, request: tuple) -> Any:
        """The server's answer to ``request``. Anything that stops this between the request and
        its answer (a signal's KeyboardInterrupt in the middle of a send or a receive) leaves the
        pipe out of step, so every later request fails at once rather than read a stale or
        partial answer."""
        if self._in_step:
            self._in_step = False
            try:
                self._conn.send(request)
                if self._conn.poll(300):  # a fork waits for the server's imports, on busy cores too
                    answer = self._conn.recv()
                    self._in_step = True
                    return answer
            except (OSError, EOFError):
                pass
        raise BenchmarkError(f"the server of an emulated host (pid {self._process.pid}) stopped answering "
                             f"(exit code {self._process.exitcode})")

    def stop(self) -> None:
        """End the server, and with it (:func:`_die_with`) any rank it forked that :func:`spawn`
        has not killed already."""
        self._conn.close()
        self._process.kill()
        self._process.join()


class HostProcess:
    """The part of ``multiprocessing.Process`` :func:`spawn` uses, for a rank a
    :class:`HostServer` forked (its parent is that server, not this process)."""

    def __init__(self, server: HostServer, pid: int) -> None:
        self._server = server
        self.pid = pid
        self._code: int | None = None
        # Readable once the rank has exited (a pidfd): the server answers for a rank only after
        # that, so a run's wait asks no host anything while its ranks train. The server reaps
        # its ranks only when asked, so until then the pid is still the rank's. None where the
        # kernel has no pidfd_open (every look then asks the server).
        try:
            self.sentinel: int | None = os.pidfd_open(pid)
        except (OSError, AttributeError):
            self.sentinel = None

    @property
    def exitcode(self) -> int | None:
        if self._code is None and (self.sentinel is None or _readable(self.sentinel)):
            self._code = self._server.exitcode(self.pid)
            if self._code is not None and self.sentinel is not None:
                os.close(self.sentinel)
                self.sentinel = None
        return self._code

    def is_alive(self) -> bool:
        return self.exitcode is None

    def join(self, timeout: float | None = None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.exitcode is None and (deadline is None or time.monotonic() < deadline):
            if self.sentinel is not None:
                _readable(self.sentinel, None if deadline is None else max(0.0, deadline - time.monotonic()))
            else:
                time.sleep(0.02)


def _readable(fd: int, timeout: float | None = 0.0) -> bool:
    return bool(select.select([fd], [], [], timeout)[0])


def _serve_host(conn) -> None:  # noqa: ANN001 - a Connection
    """:class:`HostServer`'s process: import, then fork on request and report exit codes."""
    import importlib

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the benchmark's to handle: it ends this via stop()
    for name in PRELOAD:
        importlib.import_module(name)
    codes: dict[int, int | None] = {}
    try:
        while True:
            try:
                op, arg = conn.recv()
            except (EOFError, OSError):
                return
            if op == "fork":
                server = os.getpid()
                pid = os.fork()
                if pid == 0:  # the rank: it never returns into this loop (whose finally kills its siblings)
                    try:
                        conn.close()
                        _die_with(server)
                        signal.signal(signal.SIGINT, signal.default_int_handler)
                        args = pickle.loads(arg)
                    except BaseException:  # noqa: BLE001 - the parent sees exit code 1
                        traceback.print_exc()
                        os._exit(1)
                    _child(*args)  # never returns: os._exit
                codes[pid] = None
                conn.send(pid)
            elif op == "poll":
                if codes.get(arg) is None:
                    done, status = os.waitpid(arg, os.WNOHANG)
                    if done:
                        codes[arg] = os.waitstatus_to_exitcode(status)
                conn.send(codes[arg])
    finally:
        for pid, code in codes.items():
            if code is None:
                try:
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
                except (ProcessLookupError, ChildProcessError):
                    pass
        os._exit(0)


def _die_with(parent: int) -> None:
    """Have the kernel SIGKILL this process when ``parent``, the host's server that forked it,
    dies (Linux ``PR_SET_PDEATHSIG``): :meth:`HostServer.stop` kills the server outright, and
    its ranks must not outlive it (they hold the benchmark's stdout, and a core). Through ctypes:
    the baselines' ranks do not load hybrid's native library."""
    import ctypes

    pr_set_pdeathsig = 1
    if ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGKILL), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent:  # the server died before the request took effect
        os._exit(1)


@contextmanager
def _executable(ctx, path: str | None) -> Iterator[None]:
    """Within the block, ``ctx`` starts processes with ``path`` instead of this Python (a script
    that execs this Python on an emulated host); multiprocessing's resource tracker is started
    first, with this Python, where this process is."""
    if path is None:
        yield
        return
    from multiprocessing import resource_tracker, spawn as mp_spawn

    resource_tracker.ensure_running()
    saved = mp_spawn.get_executable()
    ctx.set_executable(path)
    try:
        yield
    finally:
        ctx.set_executable(saved)


def spawn(
    fn: Callable[..., Any],
    world_size: int,
    *,
    timeout_s: float,
    threads: int = 1,
    grace_s: float = 10.0,
    quiet: bool = True,
    hosts: EmulatedNetwork | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(rank, world_size, store, **kwargs)`` on ``world_size`` fresh processes.

    ``threads`` is every process's ``OMP_NUM_THREADS`` and ``torch.set_num_threads``. After one
    rank fails the others get ``grace_s`` to finish (a dead peer often leaves them waiting).
    ``quiet`` silences warnings and log lines below ERROR in the children. ``hosts``: rank ``r``
    runs on the network's host ``r``.
    """
    if hosts is None:
        from hybrid.launch.workers import short_socket_folder

        short_socket_folder()
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
    env = {"OMP_NUM_THREADS": str(threads)}  # the children's too (a spawned one's torch reads it at import)
    if quiet:
        env["PYTHONWARNINGS"] = "ignore"  # also for warnings raised before _child runs
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    with tempfile.TemporaryDirectory(prefix="hybrid-bench-") as store:
        procs: list = []
        servers = [hosts.server(r) for r in range(world_size)] if hosts is not None else []  # importing at once
        try:
            for r in range(world_size):
                args = (fn, r, world_size, store, threads, quiet, env, kwargs)
                if hosts is None:
                    proc = ctx.Process(target=_child, args=args)
                    proc.start()  # listed once started: one that failed to start has nothing to reap
                    procs.append(proc)
                else:
                    procs.append(servers[r].fork(pickle.dumps(args)))
        except BaseException:
            kill_all(procs)
            raise
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        deadline = time.monotonic() + timeout_s
        failed_at = None
        timed_out = False
        try:
            # Asleep until a rank exits or a time is up (polling the hosts' servers would take
            # CPU from the ranks being measured); every 20 ms where a rank has no sentinel.
            while alive := [p for p in procs if p.is_alive()]:
                now = time.monotonic()
                if failed_at is None and any(p.exitcode not in (None, 0) for p in procs):
                    failed_at = now
                end = deadline if failed_at is None else min(deadline, failed_at + grace_s)
                if now > end:
                    timed_out = now > deadline
                    break
                sentinels = [p.sentinel for p in alive]
                if None in sentinels:
                    time.sleep(0.02)
                else:
                    mp_connection.wait(sentinels, timeout=end - now)
        finally:
            kill_all(procs)
        problems = []
        for r, p in enumerate(procs):
            err = Path(store) / f"error{r}.txt"
            if err.exists():
                problems.append(f"--- rank {r} raised:\n{err.read_text()}")
            elif p.exitcode != 0:
                why = f"passed the {timeout_s:.0f}s timeout" if timed_out else f"exited with {p.exitcode}"
                problems.append(f"--- rank {r} {why} and was killed")
        if problems:
            raise BenchmarkError(f"{len(problems)} of {world_size} ranks failed:\n" + "\n".join(problems))
        out = []
        for r in range(world_size):
            with open(Path(store) / f"result{r}.pkl", "rb") as f:
                out.append(pickle.load(f))
        return out
