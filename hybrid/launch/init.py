"""Start and stop a hybrid job: RPC for everyone, one process group for the trainers.

Every process calls :func:`init_hybrid` with the same arguments (its role aside) and ends with
:func:`shutdown` in a ``finally``: trainers leave their process group first, then every process
leaves RPC, so nobody tears down a transport a peer still uses.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import math
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.distributed.rpc as rpc

from hybrid.errors import first_line
from hybrid.launch.address import gloo_on, rpc_transports
from hybrid.launch.bounded import run_bounded
from hybrid.launch.roles import Role
from hybrid.log import logger
from hybrid.ps.config import GradientPushWay, PsTransport


TENSORPIPE_TRANSPORTS = ("uv", "shm")
"""TensorPipe's transports that listen only where hybrid says: ``uv`` (TCP, bound to
``runtime.address``) and ``shm`` (this machine's shared memory)."""
TENSORPIPE_CHANNELS = ("basic", "cma", "mpt_uv", "xth", "cuda_basic", "cuda_ipc", "cuda_gdr", "cuda_xth")
"""TensorPipe's channels (the CUDA ones where it was built with CUDA)."""


@dataclass(kw_only=True)
class RuntimeOptions:
    """Transport, threads and timeouts; the training config's ``runtime`` section."""

    rpc_timeout_s: float = 60.0
    """Deadline of one RPC (a lookup, a gradient push); a dead or slow server fails the step after it."""
    pg_timeout_s: float = 300.0
    """Deadline of one collective in the trainers' process group."""
    shutdown_timeout_s: float = 60.0
    """How long a graceful RPC shutdown waits for the peers before it gives up (torch waits it
    twice over when a peer does not leave: for the peers' notes, then for their calls)."""
    heartbeat_s: float = 5.0
    """A waiting parameter server checks that every trainer still answers this often."""
    startup_timeout_s: float = 120.0
    """How long a process waits for every other process of the job to start, and then to connect
    in RPC's start-up; after it, the error names the ones that never came (or that stopped
    while the processes connected)."""
    transports: list[str] = field(default_factory=lambda: ["uv"])
    """TensorPipe transports. ``uv`` (TCP) is the measured best on small machines: the default
    shared-memory transport busy-spins and starves the trainers of CPU."""
    channels: list[str] = field(default_factory=lambda: ["cma", "basic"])
    """TensorPipe channels for tensor payloads, in order of preference. ``cma`` (cross-memory
    attach: the receiver copies the payload straight out of the sender's memory) is used between
    processes of one machine and cut a 1 MiB RPC from 9.6 ms to 1.9 ms and its CPU by 40% on a
    2-core machine; ``basic`` (over the transport) is the fallback across machines or where
    ptrace is restricted."""
    num_worker_threads: int = 8
    """RPC worker threads per process."""
    gradient_push: GradientPushWay = "rpc"
    """How the embedding rows' gradients reach the servers. ``rpc`` (default): they ride on the
    trainer's next message to each server (in sync mode, the next step's prefetched lookup, sent
    the moment they are complete): one message per server per step. ``dist_autograd``:
    ``torch.distributed.autograd`` carries them (a context per step and ``dist_autograd.backward``),
    as in PyTorch's RPC tutorials. Both train the same numbers."""
    ps_transport: PsTransport = "auto"
    """How step messages reach a parameter server (:mod:`hybrid.ps.transport`): ``auto`` through
    shared memory to a server on the trainer's own host (anonymous memfd files and a pipe
    doorbell: no TensorPipe threads, no pickling) and through a TCP connection of their own to
    the others (frames as in shared memory, on the server's ``address``); ``socket``: that
    connection to every server, its own host's too; ``rpc``: always RPC. ``dist_autograd``
    always uses RPC."""
    huge_pages: bool = True
    """Parameter servers keep tables and optimizer state in transparent huge pages (where the
    kernel allows, see :mod:`hybrid.ps.server.memory`): fewer TLB misses on the scattered rows of
    every lookup and update. The numbers trained are the same either way."""
    address: str = "127.0.0.1"
    """Address every listening socket binds to. Loopback by default; set to the node's own
    interface address for multi-node runs, on a trusted network only."""
    kill_grace_s: float = 5.0
    """Once one process of a ``hybrid launch`` job fails, the others get this long after SIGTERM
    before SIGKILL (torchrun's ``--shutdown-timeout``): a hung process ends too."""
    gloo_loop_batch: bool = True
    """Trainers run gloo's event-loop thread (the one that reads and writes its TCP connections)
    under Linux's ``SCHED_BATCH`` policy, so that its wake-ups do not preempt the thread running
    on the core it wakes on (:func:`batch_gloo_loops`). Otherwise, when that thread is a gloo worker
    holding the connection's lock, the loop finds the lock taken and polls again at once until
    the scheduler's next tick: on a machine with more runnable threads than cores, a 226 KB
    all-reduce between two trainers took 0.33 ms on average instead of 1.3, and 0.25 ms of CPU
    a process instead of 0.85 (``benchmarks.allreduce``). The numbers trained are the same. It
    applies to the trainers' group that :func:`init_hybrid` starts (the one DDP, FSDP2's mesh and
    the training loop use); a group a program makes later keeps gloo's default."""
    trainer_ring: bool = True
    """DDP sums CPU trainers' float32 gradients over connections of its own among the trainers
    (:mod:`hybrid.dense.ring`: a ring on ``address``, one native thread) instead of gloo, whose
    all-reduce costs each trainer about a millisecond of CPU and a dozen thread wake-ups per
    bucket whatever its size. The numbers trained are the same (between two trainers bit for
    bit). ``false``: gloo's all-reduce. GPUs (NCCL), ``comm_hook``\ s and FSDP always use the
    process group."""
    server_batch: bool = True
    """Parameter servers run under ``SCHED_BATCH`` (every thread a server starts inherits it), so
    that a trainer's message arriving does not preempt the thread running on the core the
    server's thread wakes on. On a server's own host, with idle cores, nothing changes; on cores
    shared with trainers, their forward and backward are not cut into by each message, and the
    server's thread, run a little later, finds more of the message arrived and reads it in fewer
    calls. Under ``benchmarks.run --network emulated`` (3 processes on 2 cores) it cut
    hybrid_async's CPU a step by about 1 ms per process in a slow hour and changed nothing
    measurable in a fast one (docs/performance.md). The numbers trained are the same."""
    server_memory_fraction: float = 0.8
    """Share of a machine's available memory (``MemAvailable``, or the cgroup's limit) that a
    parameter server's tables and optimizer state may take: a server refuses a collection that
    needs more before allocating anything, and ``hybrid launch`` refuses a plan whose servers
    together need more of this machine before starting any process."""

    def __post_init__(self) -> None:
        from hybrid.errors import PlanError

        if not 0 < self.server_memory_fraction <= 1:
            raise PlanError(f"got {self.server_memory_fraction!r}; expected a share of memory in (0, 1]",
                            category="bad_value", key="server_memory_fraction")
        for name in ("rpc_timeout_s", "pg_timeout_s", "shutdown_timeout_s", "heartbeat_s", "startup_timeout_s",
                     "kill_grace_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise PlanError(f"got {value!r}; expected a number of seconds above 0", category="bad_value",
                                key=name)
        for name in ("gloo_loop_batch", "trainer_ring", "server_batch"):
            if not isinstance(getattr(self, name), bool):
                raise PlanError(f"got {getattr(self, name)!r}; expected true or false", category="bad_value",
                                key=name)
        if not (isinstance(self.num_worker_threads, int) and self.num_worker_threads >= 1):
            raise PlanError(f"got {self.num_worker_threads!r}; expected at least 1", category="bad_value",
                            key="num_worker_threads")
        for name, known in (("transports", TENSORPIPE_TRANSPORTS), ("channels", TENSORPIPE_CHANNELS)):
            values = list(getattr(self, name))
            bad = [v for v in values if v not in known]
            if bad or not values:
                raise PlanError(f"got {values!r}; expected a non-empty list of {', '.join(map(repr, known))}",
                                category="bad_value", key=name)


GLOO_LOOP_THREAD = "gloo_tcp_loop"
"""The name gloo's TCP transport gives its event-loop thread."""


def batch_gloo_loops() -> int:
    """Put this process's gloo event-loop threads (:data:`GLOO_LOOP_THREAD`) under ``SCHED_BATCH``
    (see :attr:`RuntimeOptions.gloo_loop_batch`); how many there were. Where the policy or the
    threads' names cannot be read or set (not Linux), nothing changes."""
    done = 0
    for tid in _thread_ids():
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().strip() != GLOO_LOOP_THREAD:
                    continue
        except OSError:  # the thread ended meanwhile
            continue
        done += batch_thread(tid)
    return done


def batch_process() -> None:
    """Put every thread of this process under ``SCHED_BATCH`` (:func:`batch_thread`); the
    threads they start later inherit it (see :attr:`RuntimeOptions.server_batch`). Where the
    threads cannot be listed, the calling one."""
    for tid in _thread_ids() or [0]:
        batch_thread(tid)


def _thread_ids() -> list[int]:
    """This process's threads (Linux's ``/proc/self/task``); none where they cannot be listed."""
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return []


def batch_thread(tid: int = 0) -> bool:
    """Put thread ``tid`` (0: the calling one, whose later threads inherit it) under Linux's
    ``SCHED_BATCH``: its wake-ups do not preempt the thread running on the core. Whether it is
    (not where the policy cannot be set, or the thread has ended)."""
    if not hasattr(os, "sched_setscheduler"):
        return False
    try:
        os.sched_setscheduler(tid, os.SCHED_BATCH, os.sched_param(0))
    except OSError:
        return False
    return True


def device_type() -> str:
    """``cuda`` when a GPU is usable by this process, else ``cpu``."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def trainer_device() -> torch.device:
    """Where a trainer computes: its current CUDA device when a GPU is usable, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if device_type() == "cuda" else torch.device("cpu")


def resolve_backend(backend: str) -> str:
    """``auto`` means gloo on CPU and nccl on CUDA."""
    if backend == "auto":
        return "nccl" if device_type() == "cuda" else "gloo"
    return backend


def _pg_init_method(init_method: str) -> str:
    # The trainers' group must not reuse RPC's rendezvous file.
    if init_method.startswith("file://"):
        return init_method + ".trainers"
    return init_method


def end_with_the_agent() -> None:
    """Under torchrun, have the kernel SIGKILL this worker when its agent dies.

    torchrun starts the workers in sessions of their own and stops them itself; an agent that is
    killed outright (``kill -9`` of ``hybrid launch``, which runs torchrun in its own process, or
    the OOM killer) could not, and its workers would train on, orphaned, with nobody to report
    to. The kernel's parent-death signal (Linux) ends them with it. torchrun starts its workers
    from its main thread, whose end is the one that counts."""
    import signal
    import sys

    if "TORCHELASTIC_RUN_ID" not in os.environ or not sys.platform.startswith("linux"):
        return
    from hybrid import ops

    if not ops.die_with_parent(int(signal.SIGKILL)):  # not granted: the agent's own stop is all there is
        return
    if os.getppid() == 1:  # the agent died before the call: nobody would send the signal
        os.kill(os.getpid(), signal.SIGKILL)


class StartupError(RuntimeError):
    """Some processes of the job did not start within ``runtime.startup_timeout_s``."""


def _startup_store(init_method: str, world_size: int, timeout_s: float) -> dist.Store | None:
    timeout = datetime.timedelta(seconds=timeout_s)
    if init_method.startswith("file://"):
        return dist.FileStore(init_method[len("file://"):] + ".startup", world_size)
    if init_method == "env://" and "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ:
        return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                             timeout=timeout)
    return None


STORE_STEP_TIMEOUT_S = 2.0
"""How long one read or write of the job's store may take on the way to a failure's message."""


def within(fn, default, timeout_s: float = STORE_STEP_TIMEOUT_S):  # noqa: ANN001, ANN201 - any call, its value
    """``fn()``, or ``default`` when it raises or takes over ``timeout_s``: for the job's store on
    the way to a failure's message. A store whose host hangs or whose machine is gone holds a
    read for the store's own timeout (minutes: ``set_timeout`` does not shorten a read already
    connected), so the call runs on a thread of its own, left behind if it does not return; the
    process is ending. After one step ran out of time, the later ones do not try the store."""
    if _STORE_SILENT:
        return default
    step = run_bounded(fn, timeout_s, name="hybrid-store-step")
    if not step.finished:
        _STORE_SILENT.append(True)
    # a step that raised: the store's host is gone, and the default stands
    return step.value if step.finished and step.error is None else default


_STORE_SILENT: list[bool] = []
"""Non-empty once a store step of :func:`within` ran out of time: the store's host is gone, hung
or cut off, and each further step would only wait its 2 s too (a failing process takes up to four
of them before its message), so they return their default at once."""


STAGES = ("checked in", "in the trainers' process group", "in RPC's start-up", "joined", "leaving RPC", "left")
"""The stages of a process's part in a job, joining it and leaving it, in order; each process
records the one it is in (:class:`Checkin`)."""


class Checkin:
    """This process's record in the job's start-up store: which stage of :data:`STAGES` it has
    reached. When a stage times out, the peers furthest behind are the ones it waited for: a
    process that dies or hangs while the processes connect (or leave) stays at its stage, while
    those waiting for it have gone one further (or as far). A process that failed and said so
    (:func:`hybrid.launch.failure.fail`) is marked as such: it is named only where no other
    peer is behind (the others then failed because it left, and it has told its story)."""

    def __init__(self, role: Role, store: dist.Store) -> None:
        self.role, self.store = role, store

    def reached(self, stage: str) -> None:
        self.store.set(f"stage/{self.role.rank}", str(STAGES.index(stage)))

    def failed(self) -> None:
        self.store.set(f"failed/{self.role.rank}", "1")

    def behind(self, goal: str) -> list[str]:
        """The peers that have not reached ``goal`` and are furthest behind, as ``name (rank R,
        STAGE)``."""
        from hybrid.launch.roles import role_of

        def read() -> tuple[dict[int, int], set[int]]:
            peers = [r for r in range(self.role.world_size) if r != self.role.rank]
            return ({r: int(self.store.get(f"stage/{r}")) for r in peers},
                    {r for r in peers if self.store.check([f"failed/{r}"])})

        stages, failed = within(read, ({}, set()))
        waiting = {r: s for r, s in stages.items() if s < STAGES.index(goal)}
        waiting = {r: s for r, s in waiting.items() if r not in failed} or waiting
        if not waiting:
            return []
        last = min(waiting.values())
        return [f"{role_of(r, self.role.world_size, self.role.num_servers).name} (rank {r}, "
                f"{'failed' if r in failed else STAGES[last]})" for r, s in sorted(waiting.items()) if s == last]


def wait_for_everyone(role: Role, init_method: str, timeout_s: float) -> Checkin | None:
    """Check in on the job's store and wait until every process has; name the missing ones.

    Without it, a process that never starts leaves the others inside torch's own rendezvous
    (RPC's waits for 30 minutes) with no word of who is missing. Returns this process's record
    in that store, or None where the job has none.
    """
    import time

    from hybrid.launch.roles import role_of

    store = _startup_store(init_method, role.world_size, timeout_s)
    if store is None:
        return None
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.PrefixStore(f"hybrid/startup/{attempt}", store)
    checkin = Checkin(role, store)
    checkin.reached("checked in")
    store.set(str(role.rank), role.name)
    deadline = time.monotonic() + timeout_s
    missing = list(range(role.world_size))
    while True:
        missing = [r for r in missing if not store.check([str(r)])]
        if not missing:
            return checkin
        if time.monotonic() > deadline:
            names = ", ".join(f"{role_of(r, role.world_size, role.num_servers).name} (rank {r})" for r in missing)
            store_at = (f" at {os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}" if init_method == "env://"
                        else "")
            raise StartupError(f"{role.name}: {names} did not start within {timeout_s:g}s "
                               f"(runtime.startup_timeout_s), or cannot reach the job's store{store_at} (its host's "
                               f"network?); check their logs, or raise the timeout")
        time.sleep(0.1)


@contextlib.contextmanager
def _joining(checkin: Checkin | None, stage: str, timeout_s: float, key: str, *, first_timeout_s: float | None = None):
    """Run one stage of joining; when it fails after waiting out a timeout (``first_timeout_s``,
    the shortest of those that apply, else ``timeout_s``), name the peers that held it up
    (:meth:`Checkin.behind`)."""
    import time

    if checkin is None:
        yield
        return
    checkin.reached(stage)
    t0 = time.monotonic()
    try:
        yield
    except Exception as e:
        waited = time.monotonic() - t0
        behind = checkin.behind("joined") if waited >= 0.9 * (first_timeout_s or timeout_s) else []
        if not behind:
            raise
        first = first_line(e)
        raise StartupError(f"{checkin.role.name}: {', '.join(behind)} did not join within {timeout_s:g}s "
                           f"(runtime.{key}): died or hung? This process stopped {stage} on: {first}") from e


def init_hybrid(
    role: Role,
    *,
    init_method: str = "env://",
    backend: str = "auto",
    options: RuntimeOptions | None = None,
) -> None:
    """Join RPC as ``role.name`` and, on trainers, the trainers' default process group.

    ``init_method`` is ``env://`` under torchrun (MASTER_ADDR/MASTER_PORT, the agent's store) or
    ``file:///path`` for a file store (tests). Servers are not members of the trainers' group.
    """
    options = options or RuntimeOptions()
    end_with_the_agent()
    if not role.is_trainer:
        from hybrid.ps.server import service

        if options.server_batch:
            batch_process()  # before the server's RPC and step threads start: they inherit it
        service.start(role.index, service.ServerOptions(huge_pages=options.huge_pages,
                                                        memory_fraction=options.server_memory_fraction,
                                                        address=options.address))
    checkin = wait_for_everyone(role, init_method, options.startup_timeout_s)
    _CHECKIN[:] = [checkin] if checkin is not None else []
    transports = rpc_transports(options.address, options.transports)  # RPC listens on runtime.address
    pg_store, rpc_init = None, init_method
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if init_method == "env://" and attempt is not None:
        # Under torchrun the workers share the agent's store, and a restarted group finds the
        # previous attempt's keys there (gloo would dial the dead processes' addresses): every
        # attempt gets keys of its own.
        base = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                             timeout=datetime.timedelta(seconds=options.startup_timeout_s))
        pg_store = dist.PrefixStore(f"hybrid/attempt{attempt}/trainers", base)
        rpc_init = _attempt_rendezvous(dist.PrefixStore(f"hybrid/attempt{attempt}/rpc", base))
    if role.is_trainer:
        backend = resolve_backend(backend)
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", role.index)) % torch.cuda.device_count())
        with gloo_on(options.address), _joining(checkin, STAGES[1], options.pg_timeout_s, "pg_timeout_s"):
            dist.init_process_group(
                backend,
                init_method=None if pg_store is not None else _pg_init_method(init_method),
                store=pg_store,
                rank=role.index,
                world_size=role.num_trainers,
                timeout=datetime.timedelta(seconds=options.pg_timeout_s),
            )
        if backend == "gloo" and options.gloo_loop_batch:
            logger.debug("gloo event-loop threads under SCHED_BATCH: %d", batch_gloo_loops())
        from hybrid.dense import ring

        ring.configure(dist.group.WORLD if backend == "gloo" and options.trainer_ring else None,
                       address=options.address, timeout_s=options.pg_timeout_s)
    from torch.distributed.rpc import constants as rpc_constants

    # init_rpc connects the processes through a gloo group of its own (device maps, a last
    # barrier) whose timeout torch fixes at 2**31 ms: a peer that dies while they connect would
    # hold the others there for 24 days. That group lives only inside init_rpc; it gets
    # runtime.startup_timeout_s, the bound on waiting for the job's other processes.
    fixed = rpc_constants.DEFAULT_PROCESS_GROUP_TIMEOUT
    rpc_constants.DEFAULT_PROCESS_GROUP_TIMEOUT = datetime.timedelta(seconds=options.startup_timeout_s)
    try:
        # (its store and its first round of calls wait runtime.rpc_timeout_s)
        with _joining(checkin, STAGES[2], options.startup_timeout_s, "startup_timeout_s",
                      first_timeout_s=min(options.startup_timeout_s, options.rpc_timeout_s)):
            rpc.init_rpc(
                role.name,
                rank=role.rank,
                world_size=role.world_size,
                rpc_backend_options=rpc.TensorPipeRpcBackendOptions(
                    init_method=rpc_init,
                    rpc_timeout=options.rpc_timeout_s,
                    num_worker_threads=options.num_worker_threads,
                    _transports=transports,
                    _channels=list(options.channels),
                ),
            )
    finally:
        rpc_constants.DEFAULT_PROCESS_GROUP_TIMEOUT = fixed
    if checkin is not None:
        checkin.reached(STAGES[3])
    logger.debug("joined as %s (rank %d of %d)", role.name, role.rank, role.world_size)


_CHECKIN: list[Checkin] = []
"""This process's :class:`Checkin`, for :func:`shutdown` (none where the job has no start-up store)."""


def record_failure() -> None:
    """Mark this process as failed in the job's start-up store (:meth:`Checkin.failed`)."""
    if _CHECKIN:
        within(_CHECKIN[0].failed, None)


def startup_store() -> dist.Store | None:
    """The job's start-up store of this attempt (every process of the job, servers too), or None
    where the job has none."""
    return _CHECKIN[0].store if _CHECKIN else None


def failed_peers(role: Role) -> set[str]:
    """The names of the job's processes that marked themselves failed (:func:`record_failure`):
    gone, but not silently -- each said what happened to it."""
    if not _CHECKIN:
        return set()
    names = [*role.trainer_names, *role.server_names]  # index = global rank
    store = _CHECKIN[0].store
    return within(lambda: {names[r] for r in range(role.world_size) if store.check([f"failed/{r}"])}, set())

_ATTEMPT_STORE: list[dist.Store] = []


def _attempt_rendezvous(store: dist.Store) -> str:
    """An ``init_method`` (``hybrid-attempt://``) whose rendezvous hands RPC ``store``.

    ``rpc.init_rpc`` takes its store only from a rendezvous URL; this registers (once) a handler
    for a scheme of ours that yields the store of the current torchrun attempt.
    """
    import importlib

    rdzv = importlib.import_module("torch.distributed.rendezvous")  # the module, not its function
    _ATTEMPT_STORE[:] = [store]
    if "hybrid-attempt" not in rdzv._rendezvous_handlers:
        def handler(url: str, **kwargs):
            from urllib.parse import parse_qs, urlparse

            query = parse_qs(urlparse(url).query)
            yield _ATTEMPT_STORE[0], int(query["rank"][0]), int(query["world_size"][0])

        rdzv.register_rendezvous_handler("hybrid-attempt", handler)
    return "hybrid-attempt://"


def shutdown(role: Role, *, graceful: bool = True, timeout_s: float = 60.0) -> None:
    """Leave the trainers' group, then RPC. Safe to call after a failed init or twice.

    A graceful shutdown waits for every process of the job to leave RPC too; when one died or
    hangs meanwhile, it fails after ``timeout_s`` with a :class:`~hybrid.launch.serve.PeerFailure`
    that names the peers furthest behind in leaving (:class:`Checkin`)."""
    try:
        if role.is_trainer and dist.is_initialized():
            from hybrid.dense import ring

            ring.close_all()
            dist.destroy_process_group()
    finally:
        try:
            if rpc.api._is_current_rpc_agent_set():
                if graceful:
                    _leave_rpc(role, timeout_s)
                else:
                    rpc.shutdown(graceful=False)
        finally:
            from hybrid.ps.server import service

            # A server -- or a trainer holding the tables in one process -- serves until RPC is
            # down (its rows are still being made in the background meanwhile); then the fill's
            # thread ends before the process does: a daemon thread still inside a native call
            # when the interpreter exits aborts the process ("terminate called without an
            # active exception"). A process without a server has nothing to stop.
            service.close()


def _leave_rpc(role: Role, timeout_s: float) -> None:
    from hybrid.launch.serve import PeerFailure

    checkin = _CHECKIN[0] if _CHECKIN else None
    if checkin is not None:  # (a store whose host is gone must not hold the shutdown)
        within(lambda: checkin.reached("leaving RPC"), None)
    # torch logs its own traceback of a peer that did not leave ("Failed to respond to 'Shutdown
    # Proceed' in time") before it raises; the PeerFailure below says it in one line
    quiet = logging.getLogger("torch.distributed.rpc.api")
    level = quiet.level
    quiet.setLevel(logging.CRITICAL)
    try:
        _leave_within(timeout_s)
    except Exception as e:
        behind = checkin.behind("left") if checkin is not None else []
        first = first_line(e)
        who = f"{', '.join(behind)} did not leave RPC" if behind else "the job's processes did not all leave RPC"
        from hybrid.launch.address import link_down

        down = link_down()
        raise PeerFailure(f"{role.name}: {who} (this process waits {timeout_s:g}s at most: "
                          f"runtime.shutdown_timeout_s): {f'{down}.' if down else 'died or hung?'} This process stopped leaving on: "
                          f"{first}") from e
    finally:
        quiet.setLevel(level)
    if checkin is not None:
        within(lambda: checkin.reached("left"), None)


def _leave_within(timeout_s: float) -> None:
    """``rpc.shutdown(graceful=True, timeout=timeout_s)``, given up after twice ``timeout_s`` plus
    2 s (torch waits up to twice: for the peers' notes, then for their calls). Its count of the
    calls in flight goes through the job's store with no timeout of its own: a process cut off from
    the store's host (node 0's link down) would sit in that read for as long as TCP keeps the
    connection (minutes). So it runs on a thread of its own, left behind when it does not return;
    the process is ending."""
    bound_s = 2 * timeout_s + 2.0
    left = run_bounded(lambda: rpc.shutdown(graceful=True, timeout=timeout_s), bound_s, name="hybrid-leave-rpc")
    if not left.finished:
        raise TimeoutError(f"RPC's shutdown did not return within {bound_s:g}s (the job's store unreachable?)")
    if left.error is not None:
        raise left.error
