"""How torchrun starts the processes of a ``hybrid`` job: forked from one server process that
imported torch, torchrec and hybrid once, rather than each a new interpreter.

torchrun runs ``python -u -m hybrid.cli ARGS`` once per worker, and each imports torch, torchrec
and fbgemm again: about 6 s of CPU a process on this project's 2-core test host, and as many
private copies of those modules in memory. Here torchrun's subprocess handler for that one command
forks the worker from ``multiprocessing``'s fork server instead. The server is a fresh interpreter
started once per agent: it imports the modules (:data:`PRELOAD`) and then only forks, so a worker
inherits no thread, process group, RPC agent or CUDA context (importing torch initializes no
GPU), only the imported modules. Each worker gets the environment its command would have had
(the agent's, with its rank's variables), a session of its own (:mod:`hybrid.launch.zygote`), the
agent's standard output and error, and runs ``hybrid ARGS``. Everything else is torchrun's own:
how it watches, stops (by process group) and restarts workers, and how it reports failures.

``HYBRID_WORKER_START=exec`` keeps torchrun's way (a new interpreter per worker).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from typing import Any

from hybrid.launch.stopping import STOP_SIGNALS, name_mark

ENV = "HYBRID_WORKER_START"

PRELOAD = ["hybrid.launch.zygote", "torch", "torch.distributed.rpc", "torch.distributed.fsdp", "torchrec",
           "hybrid.train.loop", "hybrid.launch.init", "hybrid.compose"]
"""What the fork server imports before it forks a worker (:mod:`hybrid.launch.zygote` first).
Not ``hybrid.cli``: a launcher started as ``python -m hybrid.cli`` has ``multiprocessing`` run that
module again in each worker as ``__mp_main__``, which it refuses (a warning) once imported."""

COMMAND = ("-u", "-m", "hybrid.cli")
"""The arguments before ``hybrid``'s own in the command torchrun runs for each worker."""

_started: list[bool] = []


def forked() -> bool:
    """Whether workers start from the fork server (``HYBRID_WORKER_START``, default ``fork``)."""
    return os.environ.get(ENV, "fork") != "exec"


SUN_PATH_MAX = 107
"""The longest path a Unix socket can have on Linux (108 bytes with the terminating NUL)."""


def short_socket_folder() -> None:
    """Have ``multiprocessing`` make its folder for sockets (``pymp-*``, where the fork server
    listens) in the system's temp folder when the one ``TMPDIR`` names is too deep for a socket's
    path (``AF_UNIX path too long`` otherwise), as Python 3.13's ``multiprocessing`` does. Only
    that folder moves: everything else, the workers included, keeps ``TMPDIR``."""
    import tempfile
    from multiprocessing import util

    base = tempfile.gettempdir()
    if len(os.fsencode(base)) + len("/pymp-12345678/listener-12345678") <= SUN_PATH_MAX:
        return
    usable = [d for d in ("/tmp", "/var/tmp", "/usr/tmp") if os.path.isdir(d) and os.access(d, os.W_OK | os.X_OK)]
    if not usable:
        return  # nothing shorter: multiprocessing names the path it cannot bind
    saved, tempfile.tempdir = tempfile.tempdir, usable[0]
    try:
        util.get_temp_dir()  # made now, and kept for this process's sockets
    finally:
        tempfile.tempdir = saved


def start_server() -> None:
    """Start the fork server (once a process); it then imports :data:`PRELOAD`, and the first fork
    waits for that."""
    import multiprocessing.forkserver as forkserver

    from multiprocessing import util

    from hybrid.errors import remove_at_exit

    if _started:
        return
    short_socket_folder()
    forkserver.set_forkserver_preload(PRELOAD)
    forkserver.ensure_running()
    # The server's socket folder (``/tmp/pymp-*``): multiprocessing removes it at a normal
    # interpreter exit, which a launcher that ends with ``exit_now`` skips.
    remove_at_exit(util.get_temp_dir())
    _started.append(True)


def _worker(argv: list[str], env: dict[str, str], stdout: str | None, stderr: str | None) -> None:
    """The forked worker: the command's environment and output files, then ``hybrid ARGV``; ends
    with its exit code and without the interpreter's teardown, as ``python -m hybrid.cli`` does."""
    from hybrid.errors import exit_now

    os.environ.clear()
    os.environ.update(env)
    for path, fd in ((stdout, 1), (stderr, 2)):
        if path:
            with open(path, "w") as f:
                os.dup2(f.fileno(), fd)
    # `python -u`, as torchrun runs the command: each line is out as it is written
    sys.stdout.reconfigure(line_buffering=True)
    sys.stderr.reconfigure(line_buffering=True)
    # `multiprocessing` as in a new interpreter: a child of the fork server inherits its start
    # method, under which every lock the worker makes (tqdm's progress bar makes one) is a named
    # semaphore left to the launcher's resource tracker, which a worker ending at once never
    # releases (the tracker then warns of "leaked semaphore objects" as the job ends).
    import multiprocessing

    multiprocessing.set_start_method(None, force=True)
    import torch

    if torch.cuda._is_in_bad_fork():  # an import initialized CUDA in the server: unusable here
        print(f"error: this worker was forked after CUDA was initialized in the process it was forked from, so "
              f"it cannot use a GPU; start the workers as new processes with {ENV}=exec", file=sys.stderr)
        exit_now(1)
    from hybrid.cli import main

    exit_now(main(argv))


def call(target: str, *args: Any) -> Any:
    """``module:function(*args)`` in a process forked from the fork server; its return value.

    ``hybrid launch`` checks the plan, config and data this way: the check imports torchrec and
    builds the model, which the server has imported already, and the launcher itself then never
    imports torchrec (a few seconds of CPU less a job). The process shares this one's standard
    output and error; a check that fails prints its own message there and returns its status."""
    import multiprocessing

    start_server()
    ctx = multiprocessing.get_context("forkserver")
    receive, send = ctx.Pipe(duplex=False)
    process = ctx.Process(target=_call, args=(send, target, args), name="hybrid-check")
    process.start()
    send.close()
    try:
        result = receive.recv()
    except EOFError:
        process.join()
        raise RuntimeError(f"{target} ended without an answer (exit code {process.exitcode})") from None
    except BaseException:  # Ctrl-C or a stop signal: the answer is not wanted, and the call only reads
        process.kill()
        process.join()
        raise
    process.join()
    return result


def _call(send, target: str, args: tuple) -> None:  # noqa: ANN001 - a Connection
    import importlib

    from hybrid.errors import exit_now

    module, _, name = target.partition(":")
    result = getattr(importlib.import_module(module), name)(*args)
    try:
        send.send(result)
    except BrokenPipeError:  # the caller has ended (a signal stopped it): nobody waits for the answer
        exit_now(1)
    send.close()
    exit_now(0)


READY_WAIT_S = 5.0
"""How long a stop signal waits for the agent to handle it before it is passed on regardless."""


def run_agent(argv: list[str]) -> int:
    """torchrun's agent (:func:`hybrid.launch.torchrun.main` with ``argv``) in a process forked
    from the fork server, which has imported torch already: the launcher itself then never
    imports torch (about 3 s of CPU and 300 MB a job). The agent forks the workers from the same
    server; it has the launcher's environment, standard output and error. The signals the job
    stops on (:data:`~hybrid.launch.stopping.STOP_SIGNALS`), which the launcher's session gets (a
    terminal's Ctrl-C, a scheduler), are passed on to the agent, which stops the workers and says
    so itself: those that come before the agent handles them (it says when, over a pipe) wait
    here until it does, so that each ends the job in the agent's one line wherever it lands. One
    that this process ignores (``nohup``'s SIGHUP) is not passed on. Returns the agent's exit
    status (128 + N where signal N ended it)."""
    import multiprocessing
    import multiprocessing.forkserver as forkserver
    import time

    start_server()
    ctx = multiprocessing.get_context("forkserver")
    folder = name_mark()  # in the environment the agent gets (hybrid.launch.stopping)
    ready, says_ready = ctx.Pipe(duplex=False)
    agent = ctx.Process(target=_agent, name="hybrid-agent",
                        args=(argv, dict(os.environ), forkserver._forkserver._forkserver_address, says_ready))

    passed: set[int] = set()
    held: list[tuple[int, float]] = []
    """Signals that came before the agent handled them, and when: passed on once it does."""
    handles: list[bool] = []

    def forward(signum: int, _frame) -> None:  # noqa: ANN001 - a signal handler's signature
        passed.add(signum)
        if not handles:
            held.append((signum, time.monotonic()))
            return
        try:  # (not agent.exitcode: that reads the pipe join may be reading)
            os.kill(agent.pid, signum)
        except ProcessLookupError:  # it ended: join returns
            pass

    for name in STOP_SIGNALS:
        signum = getattr(signal, name)
        if signal.getsignal(signum) is not signal.SIG_IGN:
            signal.signal(signum, forward)
    try:
        agent.start()
        says_ready.close()
        # Until the agent's handlers are in place, or it ended (EOF: join says how); a signal held
        # for READY_WAIT_S goes on anyway (an agent stuck before then ends on its defaults).
        while not ready.poll(0.1):
            if held and time.monotonic() - held[0][1] > READY_WAIT_S:
                break
        handles.append(True)
        for signum, _ in held:
            forward(signum, None)
        agent.join()
    finally:
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)
    if agent.exitcode >= 0:
        return agent.exitcode
    if -agent.exitcode not in passed:  # killed outright (the OOM killer, kill -9): it could not say so
        print(f"error: torchrun's agent (pid {agent.pid}) was killed by {signal.Signals(-agent.exitcode).name}; "
              f"the job's processes end with it", file=sys.stderr)
    return 128 - agent.exitcode


def _agent(argv: list[str], env: dict[str, str], server_address: str, says_ready) -> None:  # noqa: ANN001 - a Connection
    """The agent's process: the launcher's environment (the server set its own for its imports),
    workers forked from the server at ``server_address``, and ended with the server (and so with
    the launcher: the server's parent-death signal). ``says_ready`` tells the launcher when the
    stop signals it passes on are handled here."""
    import multiprocessing.forkserver as forkserver

    from hybrid import ops

    os.environ.clear()
    os.environ.update(env)
    import multiprocessing

    multiprocessing.set_start_method(None, force=True)  # as in a new interpreter (see _worker)
    # multiprocessing gives every child of the server the launcher's pipe that keeps the server
    # running, but not its address, and would start a server of its own: this process asks the
    # launcher's, which runs as long as the launcher (waiting for this process) does.
    server = forkserver._forkserver
    server._forkserver_address = server_address
    server.ensure_running = lambda: None
    _started.append(True)
    if ops.die_with_parent(int(signal.SIGKILL)) and os.getppid() == 1:  # the server is gone already
        os.kill(os.getpid(), signal.SIGKILL)
    from hybrid.launch import torchrun

    def handled() -> None:
        try:
            says_ready.send(True)
        except OSError:  # the launcher is gone: this process ends with the server (parent-death signal)
            pass
        says_ready.close()

    from hybrid.errors import exit_now

    try:
        torchrun.main(argv, handled=handled)  # exits with the job's status
    except SystemExit as e:  # a refusal main said in one line (exit 2)
        exit_now(e.code if isinstance(e.code, int) else 1)
    except BaseException:  # a bug: said as it is, and multiprocessing must not wait for the workers
        import traceback

        traceback.print_exc()
        kill_unclaimed()
        exit_now(1)


class ForkedProcess:
    """The part of ``subprocess.Popen`` torchrun uses (``pid``, ``poll``, ``wait``,
    ``send_signal``), for a worker forked from the fork server."""

    def __init__(self, argv: list[str], env: dict[str, str], stdout: str | None, stderr: str | None) -> None:
        import multiprocessing

        start_server()
        self._process = multiprocessing.get_context("forkserver").Process(
            target=_worker, args=(argv, env, stdout, stderr), name="hybrid-worker")
        self.args = [sys.executable, *COMMAND, *argv]
        # A stop signal waits until the server has the worker's arguments (defer_stop): one that
        # raised midway would leave the server or the new worker reading a cut connection (a
        # traceback on the job's output; the server's ends the job).
        _starting.append(True)
        try:
            self._process.start()
            self.pid = self._process.pid
            _forked.append(self)
        finally:
            _starting.clear()
        if _deferred:
            signum, frame = _deferred[0]
            _deferred.clear()
            signal.getsignal(signum)(signum, frame)

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self._process.exitcode

    def send_signal(self, sig: int) -> None:
        if self._process.exitcode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:  # ended, and reaped by the fork server, since the check
                pass


_forked: list[ForkedProcess] = []
_starting: list[bool] = []
_deferred: list[tuple[int, Any]] = []


def defer_stop(signum: int, frame: Any) -> bool:
    """For the agent's stop-signal handler: whether a worker's start is under way, and the signal
    then waits for it to end (its handler is called again then). Python runs a handler between
    any two bytecodes of the main thread, whichever thread the kernel gave the signal to, so no
    signal mask can hold it off."""
    if _starting:
        _deferred.append((signum, frame))
        return True
    return False


def kill_unclaimed() -> None:
    """SIGKILL every worker this process forked that is still running: on a stop signal, after
    torchrun stopped the workers it knows of. One the signal interrupted torchrun in starting
    (the worker had started; torchrun had not recorded it yet) would run on, waiting for the
    rendezvous of a job that has ended. Such a worker is milliseconds old and has done nothing."""
    for worker in _forked:
        if worker.poll() is None:
            worker.send_signal(signal.SIGKILL)


def install() -> None:
    """Have torchrun, in this process, fork the workers of ``python -u -m hybrid.cli ...`` from the
    fork server (:class:`ForkedProcess`); any other command it runs as before."""
    from torch.distributed.elastic.multiprocessing import api
    from torch.distributed.elastic.multiprocessing.subprocess_handler import SubprocessHandler

    if not forked():
        return

    class ForkedHandler(SubprocessHandler):
        def _popen(self, args: tuple, env: dict[str, str]):  # noqa: ANN202 - a Popen stand-in
            return ForkedProcess([str(a) for a in args[1 + len(COMMAND):]], env, self._stdout and self._stdout.name,
                                 self._stderr and self._stderr.name)

        def close(self, death_sig=None) -> None:  # noqa: ANN001 - torch's signature
            # torchrun signals the worker's process group, which exists from the moment the
            # fork server's child made its session until the worker ends (the server reaps it):
            # outside that, the signal goes to the worker alone, if it runs.
            try:
                super().close(death_sig)
            except ProcessLookupError:
                self.proc.send_signal(death_sig or signal.SIGTERM)
                for f in (self._stdout, self._stderr):
                    if f:
                        f.close()

    get_handler = api.get_subprocess_handler

    def handler(entrypoint: str, args: tuple, *rest, **kwargs) -> SubprocessHandler:
        if entrypoint == sys.executable and tuple(args[:len(COMMAND)]) == COMMAND and not kwargs.get("numa_options"):
            return ForkedHandler(entrypoint, args, *rest, **kwargs)
        return get_handler(entrypoint, args, *rest, **kwargs)

    api.get_subprocess_handler = handler
