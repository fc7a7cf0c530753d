"""The lifetime of a parameter-server process, and how trainers release the servers at the end.

A server has no loop of its own: RPC worker threads answer the trainers. Its main thread waits
until trainer 0 says the trainers are done (:func:`release_servers`), then takes part in the
ordered shutdown. While it waits it checks, every ``heartbeat_s``, that every trainer still
answers; a trainer that died or hangs past the RPC timeout ends the server with
:class:`PeerFailure`, which names it (under torchrun the agent would also stop the group, but a
server must not depend on that to exit).
"""

from __future__ import annotations

import threading
import time

import torch.distributed.rpc as rpc

from hybrid.launch.address import link_down
from hybrid.launch.roles import Role
from hybrid.log import logger

_DONE = threading.Event()


class PeerFailure(RuntimeError):
    """A peer process died or stopped answering."""


def _release() -> None:
    _DONE.set()


def _ping() -> bool:
    return True


def serve(role: Role, *, heartbeat_s: float, timeout_s: float) -> None:
    """Block this server until the trainers release it; raise :class:`PeerFailure` if one dies."""
    logger.info("serving; waiting for the trainers (%s)", ", ".join(role.trainer_names))
    while not _DONE.wait(heartbeat_s):
        for name in role.trainer_names:
            t0 = time.monotonic()
            try:
                down = _ping_within(name, timeout_s)
            except Exception as e:  # noqa: BLE001 - any failure to reach a peer is the same news
                if _DONE.is_set():
                    return
                from hybrid.launch.init import failed_peers

                waited = time.monotonic() - t0
                why = "it failed, saying why" if name in failed_peers(role) else "it probably died"
                raise PeerFailure(
                    f"{role.name}: trainer {name} is unreachable (no answer after {waited:.1f}s: "
                    f"{str(e).splitlines()[0] if str(e) else type(e).__name__}); {why}"
                ) from None
            if down:
                raise PeerFailure(f"{role.name}: cannot reach trainer {name} for {timeout_s:g}s: {down}")
    logger.info("released by the trainers")


def release_servers(role: Role, timeout_s: float) -> None:
    """Trainer 0, after every trainer finished: let each server proceed to shutdown."""
    futs = [rpc.rpc_async(name, _release, timeout=timeout_s) for name in role.server_names]
    for f in futs:
        f.wait()


def _link_back_by(deadline: float) -> str | None:
    """None once this host's link is up (at once, mostly), or what :func:`link_down` says if it is
    still down at ``deadline`` (``time.monotonic()``): a ping sent meanwhile could abort this
    process, and a link down for less than the timeout must not end the job."""
    while down := link_down():
        if time.monotonic() >= deadline:
            return down
        time.sleep(0.1)
    return None


def _ping_within(name: str, timeout_s: float) -> str | None:
    """Ping process ``name``, all within ``timeout_s``: None once it answered, or what
    :func:`link_down` says if this host's link stayed down all that time (then no ping is sent:
    :func:`_link_back_by`). A ping that fails raises its error."""
    deadline = time.monotonic() + timeout_s
    if down := _link_back_by(deadline):
        return down
    rpc.rpc_sync(name, _ping, timeout=max(deadline - time.monotonic(), 0.1))
    return None


def answers(name: str, timeout_s: float = 1.0) -> bool:
    """Whether process ``name`` answers a ping within ``timeout_s`` (not while this host's link
    is down: :func:`~hybrid.launch.address.link_down`)."""
    try:
        return _ping_within(name, timeout_s) is None
    except Exception:  # noqa: BLE001 - any failure to reach it is the same news
        return False


def unreachable_peers(role: Role, timeout_s: float = 1.0) -> list[str]:
    """The other processes of the job that do not answer a ping within ``timeout_s`` (for the
    message of a failing process: which peer is gone, whatever error this process saw first).
    None of them once this process has left RPC: it cannot tell."""
    if not rpc.api._is_current_rpc_agent_set():
        return []
    names = [n for n in [*role.trainer_names, *role.server_names] if n != role.name]
    if link_down():  # none can be reached, and trying would abort this process
        return names
    futs = {}
    for n in names:
        try:
            futs[n] = rpc.rpc_async(n, _ping, timeout=timeout_s)
        except Exception:  # noqa: BLE001 - cannot even send: gone
            futs[n] = None
    gone = []
    for n, f in futs.items():
        try:
            if f is None:
                raise RuntimeError
            f.wait()
        except Exception:  # noqa: BLE001
            gone.append(n)
    return gone
