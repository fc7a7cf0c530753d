"""Whether a signal is stopping a ``hybrid launch`` job, as its workers can tell.

torchrun's agent stops the workers one after another. A worker may see a peer the agent has just
stopped go away before its own signal arrives, and would report the peer as failed after the
launcher's one line. So the agent marks the job as stopping before it stops any worker: it creates
a file that ``HYBRID_JOB_STOPPING``, in the workers' environment, names, in a folder the launcher
makes and removes (:func:`name_mark`). A worker that fails while the file exists exits quietly
(:func:`hybrid.launch.failure.fail`).

Also the signals a job stops on (:data:`STOP_SIGNALS`), and how the launcher unwinds on one that
comes before torchrun's agent runs (:class:`Stopped`). No torch here: the launcher imports this.
"""

from __future__ import annotations

import os
import signal
import tempfile

STOPPING_ENV = "HYBRID_JOB_STOPPING"

STOP_SIGNALS = ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT")
"""The signals a ``hybrid launch`` job stops on: a terminal's Ctrl-C, a scheduler, a closed
terminal. The launcher passes them on to torchrun's agent, which stops the workers."""


class Stopped(BaseException):
    """SIGTERM, SIGHUP or SIGQUIT to ``hybrid launch`` before its job's agent runs: unwinds the
    launcher as ``KeyboardInterrupt`` does on SIGINT, for it to say so in one line."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise_stopped(signum: int, _frame) -> None:  # noqa: ANN001 - a signal handler's signature
    raise Stopped(signum)


def stop_signals_raise() -> None:
    """SIGTERM, SIGHUP and SIGQUIT raise :class:`Stopped` in this process from now on (SIGINT
    raises ``KeyboardInterrupt`` already); one that is ignored (``nohup``) stays ignored."""
    for name in STOP_SIGNALS[1:]:
        signum = getattr(signal, name)
        if signal.getsignal(signum) is not signal.SIG_IGN:
            signal.signal(signum, _raise_stopped)


def job_stopping() -> bool:
    """Whether a signal is stopping this job (its agent created the :data:`STOPPING_ENV` file)."""
    path = os.environ.get(STOPPING_ENV)
    return bool(path) and os.path.exists(path)


def mark_stopping() -> None:
    """In the agent, on a signal that stops the job, before the workers are stopped."""
    path = os.environ.get(STOPPING_ENV)
    if path:
        try:
            open(path, "a").close()
        except OSError:  # the workers report their peers' ends as they would otherwise
            pass


def name_mark() -> str | None:
    """Name the mark in this process's environment (which the agent and the workers inherit), in a
    new temporary folder; that folder, for the caller to remove when the job has ended. None where
    the mark is named already (the launcher's agent) or no temporary folder can be made (the
    workers then report their peers' ends as they would otherwise)."""
    if os.environ.get(STOPPING_ENV):
        return None
    try:
        folder = tempfile.mkdtemp(prefix=f"hybrid-job-{os.getpid()}-")  # whose it is, should it be left
    except OSError:
        return None
    os.environ[STOPPING_ENV] = os.path.join(folder, "stopping")
    return folder
