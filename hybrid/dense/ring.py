"""DDP's gradient all-reduce on CPU trainers over connections of their own (``runtime.trainer_ring``).

A gloo all-reduce of a small bucket costs each trainer about a millisecond of CPU and a dozen
thread wake-ups, whatever its size: gloo's worker and event-loop threads trade many small
control messages per call. On CPU trainers that is much of a step (docs/performance.md). A
:class:`TrainerRing` connects each trainer to the next over TCP, on ``runtime.address``, once,
and its native thread (``torch.classes.hybrid.Ring``, ``csrc/ring.cpp``) sums a bucket around
the ring: reduce-scatter then all-gather, the bytes of gloo's ring algorithm, a header per
message, no other traffic. DDP gets it as a communication hook (``hybrid.dense.ddp``): the
same mean of the trainers' gradients that DDP's own reduction computes, bit for bit between two
trainers.

Set-up, on the first DDP of the trainers' group: every trainer listens on its address (an
ephemeral port), the trainers all-gather their (address, port, token) over the group, each
connects to the next and sends that trainer's 32-byte token and its own rank; the listener
accepts the one connection that carries both and closes.

Failures: a trainer that dies closes its connections, and its neighbours' all-reduce fails at
once naming it; one that neither sends nor takes data for ``runtime.pg_timeout_s`` is named
after it. The error is DDP's backward's.

Only the trainers' default group gets a ring, and only for float32 CPU buckets without a
``comm_hook``; others (GPUs with NCCL, 16-bit hooks, other dtypes, FSDP) go through the process
group as before.
"""

from __future__ import annotations

import os
import socket
import struct
import time

import torch
import torch.distributed as dist

from hybrid.log import logger
from hybrid.ps.transport.tcp import accept_proven, address_family

TOKEN_BYTES = 32
_INFO_BYTES = 320  # a trainer's "address|port|token" in the all-gather, zero-padded
_HELLO = struct.Struct("<q")  # the connecting trainer's rank, after the token


class TrainerRing:
    """The native ring among the trainers of ``group``, connected."""

    def __init__(self, group: dist.ProcessGroup, address: str, timeout_s: float) -> None:
        self.group, self.rank, self.size = group, group.rank(), group.size()
        left, right, names = _connect(group, address, timeout_s)
        self.native = torch.classes.hybrid.Ring(self.rank, self.size, left.detach(), right.detach(), timeout_s,
                                                names[0], names[1])
        self.closed = False
        self.calls = 0
        """All-reduces started."""
        logger.info("ddp all-reduce: ring of %d trainers connected (%s -> trainer%d -> %s)", self.size, names[0],
                    self.rank, names[1])

    def allreduce_(self, buffer: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
        """The sum of ``buffer`` over the trainers, in place: the future's value is ``buffer`` once
        it holds it (the ring's thread completes it, without the GIL), or its error names the
        trainer that failed."""
        done = torch.futures.Future()
        torch.ops.hybrid.ring_allreduce_(self.native, buffer, done)
        self.calls += 1
        return done

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.native.close()


_SETTINGS: dict = {}
_RINGS: dict[int, TrainerRing] = {}


def configure(group: dist.ProcessGroup | None, *, address: str, timeout_s: float) -> None:
    """Let :func:`ring_of` make a ring for ``group`` (the trainers' group that ``init_hybrid``
    started; ``None``: none), listening on ``address``."""
    close_all()
    _SETTINGS.clear()
    if group is not None:
        _SETTINGS.update(group=group, address=address, timeout_s=timeout_s)


def ring_of(group: dist.ProcessGroup) -> TrainerRing | None:
    """The ring of ``group`` (connected on first use, a collective over the group), or None where
    ``group`` has none: not the configured group, fewer than two trainers, or no native code."""
    if _SETTINGS.get("group") is not group or group.size() < 2:
        return None
    from hybrid import ops

    if not ops.AVAILABLE:
        return None
    key = id(group)
    if key not in _RINGS:
        _RINGS[key] = TrainerRing(group, _SETTINGS["address"], _SETTINGS["timeout_s"])
    return _RINGS[key]


def close_all() -> None:
    """Close every ring (its thread ends; an all-reduce still queued fails)."""
    while _RINGS:
        _RINGS.popitem()[1].close()


def _connect(group: dist.ProcessGroup, address: str, timeout_s: float) -> tuple[socket.socket, socket.socket, tuple[str, str]]:
    rank, size = group.rank(), group.size()
    listener = socket.socket(address_family(address), socket.SOCK_STREAM)
    try:
        listener.bind((address, 0))
        listener.listen(1)
        token = os.urandom(TOKEN_BYTES)
        info = f"{address}|{listener.getsockname()[1]}|{token.hex()}".encode()
        mine = torch.zeros(_INFO_BYTES, dtype=torch.uint8)
        mine[: len(info)] = torch.frombuffer(bytearray(info), dtype=torch.uint8)
        everyone = [torch.empty_like(mine) for _ in range(size)]
        dist.all_gather(everyone, mine, group=group)
        peers = []
        for t in everyone:
            host, port, tok = bytes(t.numpy()).rstrip(b"\0").decode().split("|")
            peers.append((host, int(port), bytes.fromhex(tok)))
        left, right = (rank - 1) % size, (rank + 1) % size
        names = (f"trainer{left} ({peers[left][0]}:{peers[left][1]})",
                 f"trainer{right} ({peers[right][0]}:{peers[right][1]})")
        deadline = time.monotonic() + timeout_s
        host, port, tok = peers[right]
        try:
            out = socket.create_connection((host, port), timeout=timeout_s)
            out.sendall(tok + _HELLO.pack(rank))
        except OSError as e:
            raise RuntimeError(f"ddp all-reduce: could not connect to {names[1]}: {e}") from None
        try:
            inc = _accept(listener, token, left, deadline, names[0], timeout_s)
        except BaseException:
            out.close()
            raise
    finally:
        listener.close()
    for s in (out, inc):
        s.settimeout(None)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return inc, out, names


def _accept(listener: socket.socket, token: bytes, left: int, deadline: float, name: str,
            timeout_s: float) -> socket.socket:
    """The connection from trainer ``left`` (it sent ``token`` and its rank); others are dropped."""
    conn = accept_proven(listener, token + _HELLO.pack(left), deadline)
    if conn is None:
        raise RuntimeError(f"ddp all-reduce: {name} did not connect within runtime.pg_timeout_s ({timeout_s:g} s)")
    return conn
