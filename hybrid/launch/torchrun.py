"""torchrun, with every store it starts listening on one address only (loopback by default).

torch's ``TCPStore`` server has no bind-address option: the rendezvous store of torchrun's agent
(and the store it shares with the workers) listen on all interfaces. But ``TCPStore`` accepts an
already-listening socket (``master_listen_fd``). ``python -m hybrid.launch.torchrun --address A
TORCHRUN_ARGS...`` runs torchrun in this process with the stores it hosts built on sockets bound
to ``A``. With ``--standalone`` the rendezvous is put on ``A`` as well (torchrun's own puts it
on ``localhost``), and ``A`` is the workers' ``MASTER_ADDR`` (``--local-addr``) unless the
command names one. Workers connect as clients and listen only on their own RPC and gloo sockets
(bound to the same address by :func:`hybrid.launch.init.init_hybrid`).
"""

from __future__ import annotations

import logging
import signal
import socket
import sys
import uuid
from collections.abc import Callable
from typing import NoReturn

import torch.distributed as dist

from hybrid.launch.stopping import STOP_SIGNALS, mark_stopping, name_mark

_Real = dist.TCPStore
_SOCKETS: list[socket.socket] = []  # kept open for the life of the stores


def bound_socket(address: str, port: int) -> socket.socket:
    """A listening TCP socket on ``address:port`` (``port`` 0: one the OS picks)."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    s = socket.socket(family, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind((address, port))
    except OSError as e:
        s.close()
        # RuntimeError, as TCPStore raises it: torch's c10d rendezvous then tries to join the
        # store there as a client (another agent of the same job on this machine may host it).
        raise RuntimeError(
            f"cannot listen on {address}:{port}: {e.strerror} -- another process holds the port (another "
            f"job's store?); choose a free port for --rdzv-endpoint / --master-port, or stop that process"
        ) from e
    s.listen(2048)
    _SOCKETS.append(s)
    return s


def bound_store_class(address: str) -> type:
    """A ``TCPStore`` whose server side listens on ``address`` only."""

    class BoundTCPStore(_Real):  # type: ignore[misc, valid-type]
        def __init__(self, host_name: str, port: int, world_size: int | None = None, is_master: bool = False,
                     *args, **kwargs) -> None:
            if is_master and kwargs.get("master_listen_fd") is None and not args:
                kwargs["master_listen_fd"] = bound_socket(address, int(port)).fileno()
            super().__init__(host_name, port, world_size, is_master, *args, **kwargs)

    BoundTCPStore.__name__ = BoundTCPStore.__qualname__ = "TCPStore"
    return BoundTCPStore


def install(address: str) -> None:
    """Make every ``TCPStore`` torchrun creates in this process listen on ``address``."""
    from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend, static_tcp_rendezvous

    cls = bound_store_class(address)
    dist.TCPStore = cls
    c10d_rendezvous_backend.TCPStore = cls
    static_tcp_rendezvous.TCPStore = cls


def _command_start(argv: list[str]) -> int:
    """Where the training command starts in torchrun's arguments (``-m``, ``--module``,
    ``--no-python`` or a script): what follows is the command's own."""
    return next((i for i, a in enumerate(argv) if a in ("-m", "--module", "--no-python") or a.endswith(".py")),
                len(argv))


def _spellings(name: str) -> set[str]:
    """Torchrun flag ``--x-y`` as torchrun takes it: ``--x-y`` or ``--x_y``."""
    return {name, "--" + name[2:].replace("-", "_")}


def _flag(argv: list[str], *names: str) -> str | None:
    """The value of torchrun flag ``names`` (``--x v`` or ``--x=v``; dashes or underscores)."""
    spellings = set().union(*map(_spellings, names))
    for i, a in enumerate(argv[:_command_start(argv)]):
        key, eq, value = a.partition("=")
        if key in spellings:
            return value if eq else (argv[i + 1] if i + 1 < len(argv) else None)
    return None


def _without_flag(argv: list[str], name: str) -> list[str]:
    """``argv`` without torchrun flag ``name`` and its value (spelled as :func:`_flag` reads it)."""
    end, spellings = _command_start(argv), _spellings(name)
    out, i = [], 0
    while i < end:
        key, eq, _ = argv[i].partition("=")
        if key in spellings:
            i += 1 if eq else 2
            continue
        out.append(argv[i])
        i += 1
    return out + argv[end:]


def port_in_use_error(argv: list[str], address: str) -> str | None:
    """On one node this agent must host the store: if its port is taken, say so now.

    torch would try to join whatever listens there as a client and wait for its read timeout
    (a minute or more) before failing with a message that names neither the port nor the cause.
    """
    nnodes = _flag(argv, "--nnodes") or "1"
    if nnodes not in ("1", "1:1") or _flag(argv, "--standalone") is not None or "--standalone" in argv:
        return None
    endpoint = _flag(argv, "--rdzv-endpoint")
    port = endpoint.rpartition(":")[2] if endpoint and ":" in endpoint else _flag(argv, "--master-port")
    if not port or not port.isdigit() or int(port) == 0:
        return None
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((address, int(port)))
        except OSError as e:
            return (f"the rendezvous port {address}:{port} is already in use ({e.strerror}): another process "
                    f"listens there (another job's store?). Choose a free port for "
                    f"{'--rdzv-endpoint' if endpoint else '--master-port'}, stop that process, or use "
                    f"`hybrid launch` (--standalone), which picks a free port itself")
    return None


def standalone_on(argv: list[str], address: str) -> list[str]:
    """``argv`` with ``--standalone`` spelled out as a one-node c10d rendezvous hosted on
    ``address`` (a free port), and ``--local-addr address`` unless given: the stores torchrun
    hosts then listen there, and the workers dial ``address`` (their ``MASTER_ADDR``)."""
    end = _command_start(argv)
    head, tail = argv[:end], argv[end:]
    if _flag(head, "--local-addr") is None:
        head = [f"--local-addr={address}", *head]
    if "--standalone" not in head:
        return head + tail
    host = f"[{address}]" if ":" in address else address
    spelled = ["--rdzv-backend=c10d", f"--rdzv-endpoint={host}:0", f"--rdzv-id={uuid.uuid4()}"]
    if _flag(head, "--rdzv-conf") is None:  # torch guesses that it hosts only for loopback or the hostname
        spelled.append("--rdzv-conf=is_host=1")
    return [*(a for a in head if a != "--standalone"), *spelled, *tail]


def main(argv: list[str] | None = None, handled: Callable[[], None] | None = None) -> NoReturn:
    """``python -m hybrid.launch.torchrun [--address A] [--names N0,N1,...] [--exit-barrier-timeout S]
    TORCHRUN_ARGS...``: torchrun with its stores on ``A``; messages name rank ``i`` as ``Ni`` (its
    role, e.g. ``trainer1``) when the names are given; an agent whose workers succeeded waits ``S``
    seconds at most for the other nodes' agents (:func:`_bound_exit_barrier`; default 30).

    A stop signal (:data:`~hybrid.launch.stopping.STOP_SIGNALS`) ends the job in one line from
    this function's first line on, also before torchrun starts the workers (its own handler is
    installed only then); ``handled()`` is called once that holds. Exits with the job's status."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    _name_stopping_mark()
    _quiet_stops()
    try:
        if handled is not None:
            handled()
        _run(list(sys.argv[1:] if argv is None else argv))
    except SignalException as e:  # the workers are stopped (torchrun sent them the same signal)
        from hybrid.launch import workers

        workers.kill_unclaimed()
        what = "interrupted (Ctrl-C)" if e.sigval == signal.SIGINT else f"stopped by {e.sigval.name}"
        print(f"hybrid: {what}; every process of the job has ended", file=sys.stderr)
        _exit(128 + int(e.sigval))


def _run(argv: list[str]) -> NoReturn:
    address, names, exit_barrier_s = "127.0.0.1", [], EXIT_BARRIER_S
    while argv[:1] in (["--address"], ["--names"], ["--exit-barrier-timeout"]):
        if len(argv) < 2:
            _refuse(f"{argv[0]} needs a value")
        if argv[0] == "--address":
            address = argv[1]
        elif argv[0] == "--names":
            names = argv[1].split(",")
        else:
            try:
                exit_barrier_s = float(argv[1])
            except ValueError:
                exit_barrier_s = float("nan")
            if not exit_barrier_s > 0:
                _refuse(f"--exit-barrier-timeout: got {argv[1]!r}; expected a number of seconds above 0")
        argv = argv[2:]
    from hybrid.launch.address import check_address
    from hybrid.plan import PlanError

    try:
        check_address(address)  # torchrun's stores listen there: refused here in one line, not by torch's traceback
    except PlanError as e:
        _refuse(f"--address: {e.detail}")
    argv = standalone_on(argv, address)
    problem = port_in_use_error(argv, address)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        sys.exit(2)
    install(address)
    argv = _honour_shutdown_timeout(argv)
    _bound_exit_barrier(exit_barrier_s)
    _name_restarts(names)
    from hybrid.launch import workers

    workers.install()
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main

    try:
        torchrun_main(argv)
        _exit(0)
    except ChildFailedError as e:
        _exit(_exit_status(e, names))


def _exit(code: int) -> NoReturn:
    """Exit now: the workers have ended; the interpreter's teardown of torchrun's stores and threads
    would take another second or more."""
    from hybrid.errors import exit_now

    exit_now(code)


class _QuietAboutStops(logging.Filter):
    """Drops torchrun's lines about stopping workers ("Sending process N closing signal SIGTERM",
    "Unable to shutdown process N via 15, forcefully exiting via 9", "failed (exitcode: 2)
    local_rank: 0 ..."): each hybrid process says what went wrong itself, and :func:`_exit_status`
    names one that a signal ended. Remembers the processes torchrun had to SIGKILL."""

    SENDING = "Sending process %s closing signal %s"
    FORCED = "Unable to shutdown process %s via %s, forcefully exiting via %s"
    FAILED = "failed (exitcode: %s) local_rank: %s (pid: %s) of binary: %s"
    force_killed: set[int] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg == self.FORCED:
            self.force_killed.add(int(record.args[0]))
        return record.msg not in (self.SENDING, self.FORCED, self.FAILED)


def _name_stopping_mark() -> None:
    """Name the file :func:`_quiet_stops` creates when a signal stops the job
    (:mod:`hybrid.launch.stopping`), unless the launcher did: its folder goes when this process
    exits."""
    import atexit
    import shutil

    from hybrid.errors import remove_at_exit

    folder = name_mark()
    if folder is not None:
        remove_at_exit(folder)
        atexit.register(shutil.rmtree, folder, True)


def _quiet_stops() -> None:
    """Torchrun's lines about stopping workers go (:class:`_QuietAboutStops`). On a signal to stop
    (SIGINT: Ctrl-C; SIGTERM, SIGHUP, SIGQUIT: a scheduler, a closed terminal) it logs each step
    of stopping them and raises with a traceback; the user asked for the stop, so it is said in
    one line (:func:`main`) and torch logs only errors from then on."""
    from torch.distributed.elastic.multiprocessing import api as mp_api

    from hybrid.launch import workers

    mp_api.logger.addFilter(_QuietAboutStops())
    handler = mp_api._terminate_process_handler

    def quiet_on_stop(signum: int, frame) -> None:  # noqa: ANN001 - a signal handler's signature
        if workers.defer_stop(signum, frame):  # a worker's start is under way: raised once it is done
            return
        logging.disable(logging.WARNING)
        mark_stopping()  # before any worker is stopped: the others need not report it
        handler(signum, frame)

    mp_api._terminate_process_handler = quiet_on_stop
    # torchrun installs it when it starts the workers (PContext.start); before that, from here on,
    # a stop signal raises torchrun's SignalException all the same, which main turns into one line.
    for name in STOP_SIGNALS:
        signal.signal(getattr(signal, name), quiet_on_stop)


def _name_restarts(names: list[str]) -> None:
    """Say, when torchrun restarts the workers (``--max-restarts``), which process's end made it:
    torchrun logs a restart at INFO only, a process killed outright cannot say so itself, and
    torchrun stops the others (SIGTERM) before they may notice the loss. A worker that exited 2
    (a mistake in the plan, config or data, which it named on one line) ends the job instead: a
    restart would only repeat it."""
    from torch.distributed.elastic.agent.server.api import WorkerState
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    monitor = LocalElasticAgent._monitor_workers

    def monitor_naming_restarts(self, worker_group):  # noqa: ANN001, ANN202 - torch's method
        result = monitor(self, worker_group)
        if result.state in (WorkerState.FAILED, WorkerState.UNHEALTHY) and self._remaining_restarts > 0:
            if _mistake(result.failures):
                self._remaining_restarts = 0  # torchrun then ends the job as without restarts (exit 2)
                return result
            total = worker_group.spec.max_restarts
            for rank, failure in _causes(result.failures):
                print(f"hybrid: {_who(rank, failure, names)} {_how(failure)}; torchrun restarts every worker "
                      f"(restart {total - self._remaining_restarts + 1} of {total})", file=sys.stderr, flush=True)
        return result

    LocalElasticAgent._monitor_workers = monitor_naming_restarts


def _mistake(failures: dict) -> bool:
    """Whether a worker of a failed group exited 2: a mistake in the plan, config or data that it
    named on one line (:data:`hybrid.errors.EXIT_USAGE`)."""
    from hybrid.errors import EXIT_USAGE

    return any(f.exitcode == EXIT_USAGE for f in failures.values())


def _causes(failures: dict) -> list:
    """The (rank, failure) pairs of a failed worker group that ended it: every one but those
    torchrun stopped itself (SIGTERM), by rank."""
    return [(rank, f) for rank, f in sorted(failures.items()) if f.exitcode != -signal.SIGTERM]


def _who(rank: int, failure, names: list[str]) -> str:  # noqa: ANN001 - torch's ProcessFailure
    return f"{names[rank]} (rank {rank}, pid {failure.pid})" if rank < len(names) else f"rank {rank} (pid {failure.pid})"


def _how(failure) -> str:  # noqa: ANN001 - torch's ProcessFailure
    return f"was killed by {failure.signal_name()}" if failure.exitcode < 0 else f"exited with code {failure.exitcode}"


def _honour_shutdown_timeout(argv: list[str]) -> list[str]:
    """Make ``--shutdown-timeout`` the grace between SIGTERM and SIGKILL whenever torchrun stops
    its workers, and return the arguments for torchrun. torch 2.13 passes it to the agent's final
    shutdown only: when a worker fails, the process context closes the others itself with a fixed
    30 s, so a hung worker would outlive the failure by 30 s whatever the flag says. A torchrun
    without the flag (torch 2.11's) would refuse it: there it is taken out of the arguments, and
    this grace is the only one."""
    grace = _flag(argv, "--shutdown-timeout")
    if grace is None:
        return argv
    from torch.distributed.elastic.multiprocessing import api as mp_api
    from torch.distributed.run import get_args_parser

    close = mp_api.PContext.close

    def close_within_grace(self, death_sig=None, timeout: int = 30) -> None:  # noqa: ANN001 - torch's signature
        close(self, death_sig, min(timeout, int(grace)))

    mp_api.PContext.close = close_within_grace
    _, unknown = get_args_parser().parse_known_args([f"--shutdown-timeout={grace}", "-m", "x"])
    if not unknown:
        return argv
    return _without_flag(argv, "--shutdown-timeout")


EXIT_BARRIER_S = 30.0
"""How long an agent whose workers succeeded waits for the other agents (``--exit-barrier-timeout``)."""


def _bound_exit_barrier(seconds: float) -> None:
    """An agent whose workers succeeded waits in torch's exit barrier for the other nodes' agents,
    up to 300 s, in the store on node 0. Once one node's workers succeeded, every process of the
    job has been through RPC's graceful shutdown together, so the others end within seconds; an
    agent still missing after ``seconds`` is on a node that failed or was cut off, and waiting on
    only keeps a finished job's command running for minutes. A node cut off from node 0 would
    wait longer still: the barrier's store reads do not time out while TCP keeps the connection.
    So the barrier waits ``seconds`` at most, on a thread of its own, and the agent then goes on
    (its workers' result stands)."""
    from torch.distributed.elastic.agent.server import api as agent_api

    from hybrid.launch.bounded import run_bounded

    barrier = agent_api.SimpleElasticAgent._exit_barrier
    missed: list[bool] = []

    class _Missed(logging.Filter):  # torch logs a barrier that timed out with its traceback
        def filter(self, record: logging.LogRecord) -> bool:
            if str(record.msg).startswith("Error waiting on exit barrier"):
                missed.append(True)
                return False
            return True

    agent_api.logger.addFilter(_Missed())

    def bounded(self) -> None:  # noqa: ANN001 - torch's method
        self._exit_barrier_timeout = min(self._exit_barrier_timeout, seconds)
        waited = run_bounded(lambda: barrier(self), seconds + 1.0, name="hybrid-exit-barrier")
        if not waited.finished or missed:
            print(f"hybrid: this node's workers succeeded; not every other node's agent reached the exit "
                  f"barrier within {seconds:g}s (--exit-barrier-timeout): a node failed or cannot reach node 0",
                  file=sys.stderr)

    agent_api.SimpleElasticAgent._exit_barrier = bounded


def _refuse(problem: str) -> None:
    """A mistake in this wrapper's own arguments: one line, exit code 2."""
    print(f"error: python -m hybrid.launch.torchrun: {problem}", file=sys.stderr)
    sys.exit(2)


def _exit_status(e, names: list[str]) -> int:
    """The job's exit status from torchrun's failure report, without its traceback: each hybrid
    process has said what went wrong itself. A process that exited 2 (a mistake the user can fix,
    already named on one line) makes it 2; one killed by a signal other than the SIGTERM torchrun
    stops the others with is named here, since it could not say so itself; anything else is 1."""
    for rank, failure in _causes(e.failures):
        if failure.exitcode < 0:
            why = " (by torchrun: it did not end within runtime.kill_grace_s of SIGTERM; hung?)" \
                if failure.pid in _QuietAboutStops.force_killed else ""
            print(f"error: {_who(rank, failure, names)} {_how(failure)}{why}", file=sys.stderr)
    return 2 if _mistake(e.failures) else 1


if __name__ == "__main__":
    main()
