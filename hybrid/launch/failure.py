"""How a failing process of a job ends: one message that says what happened, then exit at once.

- A mistake the user can fix (:class:`~hybrid.errors.InputError`, a checkpoint that must not
  load, ...) is one ``error:`` line, printed by the first process that found it (every trainer
  reads the same data, so usually all find it), exit code 2; the others exit 2 quietly, and so
  does a process that fails afterwards because a peer left for that reason -- a server too: the
  mark is in the job's start-up store, which every process shares, and it is set before the
  process that found the mistake leaves.
- Anything else is logged with the peers that no longer answer named first: a dead trainer is
  what the others report, not the socket error it caused (gloo's ``Connection reset by peer``).

Under torchrun the agent sends SIGTERM to the other processes the moment one exits; a process
that is reporting ignores it until its message is out (the agent's SIGKILL, ``runtime.kill_grace_s``
later, still ends it). When a signal stops the whole job (Ctrl-C, a scheduler's SIGTERM, a closed
terminal) the launcher says so in one line; a process that fails on a peer the agent stopped
before it exits quietly (:mod:`hybrid.launch.stopping`).
"""

from __future__ import annotations

import signal
import traceback
from typing import NoReturn

import torch.distributed as dist

from hybrid.errors import EXIT_FAILED, EXIT_USAGE, exit_now, first_line, print_error
from hybrid.launch.address import link_down
from hybrid.launch.init import failed_peers, record_failure, within
from hybrid.launch.roles import Role
from hybrid.launch.serve import PeerFailure, unreachable_peers
from hybrid.launch.stopping import job_stopping
from hybrid.log import logger

_REPORTED = "hybrid/user_error_reported"


def fail(role: Role, e: BaseException, *, user_error: bool) -> NoReturn:
    """Report ``e`` as described in the module docstring and end this process."""
    if job_stopping():  # a peer ended because the job is being stopped: the launcher says so
        _exit(EXIT_FAILED)
    try:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    except ValueError:  # not the main thread: report without the shield
        pass
    if user_error:
        if _first_to_report():
            print_error(e)
        _exit(EXIT_USAGE)
    if _reported():  # a peer stopped for a user's mistake and said so; this failure follows from it
        _exit(EXIT_USAGE)
    record_failure()  # peers that time out leaving RPC name the one that left without failing first
    try:
        gone = unreachable_peers(role)
    except Exception:  # noqa: BLE001 - the RPC agent itself may be down
        gone = []
    down = link_down()
    if down:
        # This host is cut off: every peer looks gone, and none is to blame.
        logger.error("%s: peers not answering: %s (%s); this process stopped on: %s", role.name, ", ".join(gone),
                     down, first_line(e))
    elif gone:
        # The silent ones first: a peer that failed and said so is gone too, often because of them
        said = failed_peers(role)
        silent = [n for n in gone if n not in said] or gone
        also = [n for n in gone if n not in silent]
        first = first_line(e)
        logger.error("%s: peers not answering: %s (died or hung)%s; this process stopped on: %s",
                     role.name, ", ".join(silent), f"; {', '.join(also)} failed too, saying why" if also else "", first)
    elif isinstance(e, PeerFailure):  # it names the peer; the peer answers again by now
        logger.error("%s", e)
    else:
        logger.error("%s failed: %s\n%s", role.name, e, "".join(traceback.format_exception(e)))
    logger.error("%s exits with code %d", role.name, EXIT_FAILED)
    _exit(EXIT_FAILED)


def _store() -> dist.Store | None:
    """The job's start-up store of this attempt, which servers share (they find no user errors,
    but see a trainer leave for one); else the trainers' default store."""
    from hybrid.launch.init import startup_store

    store = startup_store()
    if store is not None:
        return store
    if not dist.is_initialized():
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - no store: every process reports for itself
        return None


def _first_to_report() -> bool:
    store = _store()
    if store is None:
        return True
    # the store's host gone or hung: say it rather than nothing
    return within(lambda: store.add(_REPORTED, 1) == 1, True)


def _reported() -> bool:
    store = _store()
    if store is None:
        return False
    return within(lambda: store.check([_REPORTED]), False)


def _exit(code: int) -> NoReturn:
    # No waiting for peers in RPC's or the process group's teardown (they may be the reason), and
    # no C++ destructors of threads still running.
    exit_now(code)
