"""Run the real ``hybrid`` command (and torchrun under it) in a subprocess that cannot outlive the test."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

_PR_SET_PDEATHSIG = 1
_SIG_DFL = 0
_SIG_IGN = 1
_STOP_SIGNALS = (signal.SIGINT, signal.SIGHUP, signal.SIGTERM, signal.SIGQUIT)
_libc = ctypes.CDLL(None, use_errno=True)


def die_with_test() -> None:
    """``preexec_fn`` of a job a test starts: the kernel SIGKILLs it when the test's process
    ends, also when that process is killed outright (a run cut off by an outer timeout), so no
    job trains on unattended; its workers die with it (``hybrid launch`` asks the same for them).
    The signals a terminal or a scheduler sends are at their defaults, as in a terminal's
    foreground job, however the suite was started: ``nohup`` leaves SIGHUP ignored, a script's
    ``&`` SIGINT, and an ignored signal stays ignored across exec (a test's Ctrl-C would then be
    lost). System calls only, safe between fork and exec."""
    _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    for sig in _STOP_SIGNALS:
        _libc.signal(int(sig), _SIG_DFL)


def die_with_test_ignoring(*signals: int):  # noqa: ANN201 - a preexec_fn
    """:func:`die_with_test`, with ``signals`` ignored (a job started under ``nohup``: SIGHUP)."""

    def preexec() -> None:
        die_with_test()
        for sig in signals:
            _libc.signal(int(sig), _SIG_IGN)

    return preexec


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str

    @property
    def output(self) -> str:
        return f"--- exit code {self.returncode}\n--- stdout:\n{self.stdout}\n--- stderr:\n{self.stderr}"


def run_hybrid(args: list[str], *, timeout: float, cwd: Path | None = None, env: dict[str, str] | None = None,
               module: str = "hybrid.cli") -> Result:
    """``python -m hybrid.cli ARGS``; on timeout it and every process below it are SIGKILLed.

    Whatever is still alive below it when it returns is killed too: nothing is left behind.
    """
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    proc = subprocess.Popen([sys.executable, "-m", module, *args], cwd=cwd or REPO, env=full_env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=die_with_test)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        out, err = proc.communicate()
        raise AssertionError(f"`hybrid {' '.join(args)}` did not finish in {timeout}s\n--- stdout:\n{out}\n"
                             f"--- stderr:\n{err[-8000:]}") from None
    finally:
        kill_tree(proc.pid)  # stragglers of a finished run, if any
    return Result(proc.returncode, out, err)


def kill_tree(root: int) -> None:
    """SIGKILL ``root`` and every process below it (torchrun puts its workers in new sessions),
    and remove the socket folder of a fork server among them (``multiprocessing`` removes it when
    the process that started the server exits, not when that process is killed) and the folder of
    the job's stopping mark."""
    import shutil

    from tests.support.sockets import descendants

    pids = descendants(root)
    folders = fork_server_folders(pids) | stopping_mark_folders(pids)
    for pid in pids[::-1]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for folder in folders:
        shutil.rmtree(folder, ignore_errors=True)


def stopping_mark_folders(pids: list[int]) -> set[str]:
    """The folders of the stopping marks (``hybrid.launch.stopping``) that ``pids`` made in the
    temp folder: the launcher removes its own, unless it is killed outright."""
    import glob
    import tempfile

    return {f for pid in pids for f in glob.glob(os.path.join(tempfile.gettempdir(), f"hybrid-job-{pid}-*"))}


def fork_server_folders(pids: list[int]) -> set[str]:
    """The socket folders (``/tmp/pymp-*``) of the ``multiprocessing`` fork servers in ``pids``."""
    import tempfile

    from tests.support.sockets import unix_socket_paths

    return {os.path.dirname(p) for p in unix_socket_paths(pids)
            if os.path.dirname(os.path.dirname(p)) == tempfile.gettempdir()
            and os.path.basename(os.path.dirname(p)).startswith("pymp-")}
