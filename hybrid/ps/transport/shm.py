"""Step messages to a parameter server on the trainer's own host, through shared memory.

Over RPC a message costs, besides its payload, TensorPipe's event-loop and cross-memory-attach
threads on both sides, pickling, and a hop to an RPC worker thread (a third of a server's CPU
per step in the benchmark's profile). Between two processes of one host the same frame
(:mod:`hybrid.ps.protocol`) can instead be written into a file in ``/dev/shm`` that both map,
with a one-byte write to a FIFO as its doorbell: the server's thread for this trainer sleeps in
``read`` on its FIFO, wakes, handles the message in place (ids and gradients are read straight
from the shared pages, rows gathered straight into the reply's) and rings back. Nothing spins.

A :class:`ShmTransport` carries one message at a time; a message sent while the previous one is
unanswered, or too big for the mapping, goes over its RPC fallback (the server applies what
arrives by either way the same: pushes are counted per trainer and step, lookups wait for their
step). Set-up is one RPC: the trainer makes a fresh ``0700`` directory in ``/dev/shm`` with the
two files and two FIFOs, the server opens them (refusing a directory it does not own or that
others may enter) if it is on the same host, and the trainer removes the directory once both
ends are open.

Failures: a server that dies closes its FIFO, and the trainer's wait ends at once with the
server's name; one that does not answer within ``runtime.rpc_timeout_s`` is named after it; an
exception while the server handles a message comes back as the message's error, as over RPC. A
trainer that dies closes its end; the server's thread for it ends (the server's heartbeat names
the trainer).
"""

from __future__ import annotations

import os
import select
import shutil
import socket
import stat
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed.rpc as rpc

from hybrid.ps.transport import Transport
from hybrid.ps.transport.channel import ChannelError, ServerEnd, TrainerEnd

__all__ = ["ChannelError", "DEFAULT_CAPACITY", "ShmTransport", "host_id", "rpc_open_channel"]

DEFAULT_CAPACITY = 16 << 20
"""Bytes of each direction's mapping, reserved up front (``posix_fallocate``): a tmpfs file
written past the space ``/dev/shm`` has left would kill the process with SIGBUS, a failed
reservation only sends the messages over RPC. The benchmark's step message is about 1.1 MB
(8,000 rows of 32 floats, their ids and gradients); a bigger one goes over RPC."""


def host_id() -> str:
    """Processes with equal host ids share ``/dev/shm``."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


class ShmTransport(TrainerEnd):
    """One trainer's shared-memory channel to one server on its host: one message at a time."""

    what = "shared-memory channel"
    shares_memory = True

    def __init__(self, server: str, directory: Path, capacity: int, *, fallback: Transport, timeout_s: float) -> None:
        super().__init__(server, torch.from_file(str(directory / "req"), shared=True, size=capacity, dtype=torch.uint8),
                         torch.from_file(str(directory / "rep"), shared=True, size=2 * capacity, dtype=torch.uint8),
                         fallback=fallback, timeout_s=timeout_s)
        self.bell_in: int | None = os.open(directory / "to_trainer", os.O_RDONLY | os.O_NONBLOCK)
        self.bell_out: int | None = None

    @classmethod
    def open(cls, server: str, trainer: int, *, fallback: Transport, timeout_s: float,
             capacity: int = DEFAULT_CAPACITY) -> ShmTransport | None:
        """A channel to ``server``, or ``None`` where the server is on another host (or shared
        memory is unusable here)."""
        if not os.path.isdir("/dev/shm"):
            return None
        directory = Path(tempfile.mkdtemp(prefix="hybrid-ps-", dir="/dev/shm"))
        try:
            for name, size in (("req", capacity), ("rep", 2 * capacity)):  # replies alternate halves
                with open(directory / name, "wb") as f:
                    os.posix_fallocate(f.fileno(), 0, size)  # ENOSPC now, not SIGBUS later
            for name in ("to_server", "to_trainer"):
                os.mkfifo(directory / name, 0o600)
            end = cls(server, directory, capacity, fallback=fallback, timeout_s=timeout_s)
            try:
                ok = rpc.rpc_sync(server, rpc_open_channel, args=(trainer, host_id(), str(directory), capacity),
                                  timeout=timeout_s)
                if not ok:
                    end.close()
                    return None
                end.bell_out = os.open(directory / "to_server", os.O_WRONLY | os.O_NONBLOCK)
            except BaseException:
                end.close()
                raise
            return end
        except OSError:
            return None  # no room in /dev/shm, no FIFOs: RPC serves
        finally:
            shutil.rmtree(directory, ignore_errors=True)

    def _post(self, end: int) -> bool:
        try:
            os.write(self.bell_out, b"\1")
        except OSError:
            return False
        return True

    def _receive(self, left_s: float, block: bool) -> bool | None:
        deadline = time.monotonic() + left_s
        while True:
            try:
                got = os.read(self.bell_in, 1)
            except BlockingIOError:
                left = deadline - time.monotonic()
                if not block or left <= 0:
                    return False
                select.select([self.bell_in], [], [], left)
                continue
            return True if got else None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - at interpreter exit os may be gone; the kernel closes them
            pass

    def close(self) -> None:
        """Close this end; the server's thread for it sees end-of-file and stops."""
        self.closed = True
        fds, self.bell_in, self.bell_out = (self.bell_in, self.bell_out), None, None
        _close_fds(fds)


class _ServerEnd(ServerEnd):
    """The server's end for one trainer: a daemon thread that handles its messages."""

    what = "shared-memory channel"

    def __init__(self, directory: Path, capacity: int, name: str) -> None:
        super().__init__(torch.from_file(str(directory / "req"), shared=True, size=capacity, dtype=torch.uint8),
                         torch.from_file(str(directory / "rep"), shared=True, size=2 * capacity, dtype=torch.uint8),
                         name, halves=True)
        self.bell_in: int | None = os.open(directory / "to_server", os.O_RDONLY | os.O_NONBLOCK)
        self.bell_out: int | None = os.open(directory / "to_trainer", os.O_WRONLY | os.O_NONBLOCK)
        self.thread.start()

    @staticmethod
    def check_directory(path: str) -> Path:
        """The set-up directory, if it is a private one of this user's under /dev/shm."""
        directory = Path(path)
        st = os.lstat(directory)
        if (directory.parent != Path("/dev/shm") or not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid()
                or st.st_mode & 0o077):
            raise PermissionError(f"refusing channel directory {path}: not a private directory of this user "
                                  f"under /dev/shm")
        return directory

    def _next(self) -> bool:
        while True:
            fd = self.bell_in
            if fd is None:
                return False
            try:
                select.select([fd], [], [])
                got = os.read(fd, 1)
            except BlockingIOError:
                continue
            except (OSError, ValueError):
                return False
            return bool(got)  # empty: the trainer closed its end (it left or died)

    def _post_reply(self, end: int) -> None:
        fd = self.bell_out
        if fd is None:
            return
        try:
            os.write(fd, b"\1")
        except OSError:
            pass  # the trainer is gone; the heartbeat names it

    def close(self) -> None:
        with self.lock:
            fds, self.bell_in, self.bell_out = (self.bell_in, self.bell_out), None, None
        _close_fds(fds)


def rpc_open_channel(trainer: int, host: str, path: str, capacity: int) -> bool:
    """On a server: serve ``trainer``'s step messages through the channel it set up in ``path``
    (its thread ends when the trainer closes its end); ``False`` when the trainer is on another
    host."""
    if host != host_id():
        return False
    _ServerEnd(_ServerEnd.check_directory(path), capacity, f"hybrid-ps-channel-t{trainer}")
    return True


def _close_fds(fds) -> None:
    for fd in fds:
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass
