"""Step messages to a parameter server on the trainer's own host, through shared memory.

Over RPC a message costs, besides its payload, TensorPipe's event-loop and cross-memory-attach
threads on both sides, pickling, and a hop to an RPC worker thread (a third of a server's CPU
per step in the benchmark's profile). Between two processes of one host the same frame
(:mod:`hybrid.ps.protocol`) can instead be written into a file in ``/dev/shm`` that both map,
with a one-byte write to a FIFO as its doorbell: the server's thread for this trainer sleeps in
``read`` on its FIFO, wakes, handles the message in place (ids and gradients are read straight
from the shared pages, rows gathered straight into the reply's) and rings back. Nothing spins.

A :class:`ShmTransport` carries up to two unanswered messages (:data:`channel.WINDOW`), each in
its own slot; a message sent while the window is taken, or too big for a slot, goes over its RPC
fallback (the server applies what arrives by either way the same: pushes are counted per trainer
and step, lookups wait for their step). Each doorbell byte is the low byte of the number of the
message it rings for: requests are handled in order, replies come back as they are completed.

Set-up is one RPC: the trainer makes two anonymous shared-memory files (``memfd_create``) and two
pipes, and the server, if it is on the same host, opens them through
``/proc/<trainer pid>/fd/`` (which the kernel allows to a process of the same user only), checks
that each is the file the trainer made (device and inode), and keeps its ends; the trainer then
closes the server's ends. Nothing has a name in any file system, so whatever way the processes
end -- SIGKILL included, at any point of the set-up -- the kernel frees the memory with the last
descriptor and mapping: nothing is left in ``/dev/shm``.

Failures: a server that dies closes its FIFO, and the trainer's wait ends at once with the
server's name; one that does not answer within ``runtime.rpc_timeout_s`` is named after it; an
exception while the server handles a message comes back as the message's error, as over RPC. A
trainer that dies closes its end; the server's thread for it ends (the server's heartbeat names
the trainer).
"""

from __future__ import annotations

import os
import select
import socket
import time
from dataclasses import dataclass

import torch
import torch.distributed.rpc as rpc

from hybrid.ps.transport import Transport
from hybrid.ps.transport.channel import REPLY_SLOTS, WINDOW, ChannelError, ServerEnd, TrainerEnd

__all__ = ["ChannelError", "DEFAULT_CAPACITY", "ShmTransport", "host_id", "rpc_open_channel"]

DEFAULT_CAPACITY = 16 << 20
"""Bytes of each slot of the mappings (two request slots, three reply slots): a bigger message
goes over RPC. The benchmark's step message is about 1.1 MB (8,000 rows of 32 floats, their ids
and gradients)."""
RESERVED_FIRST = 256 << 10
"""Bytes of each slot reserved when the channel is made (error replies always fit); a slot's
reservation then grows as its messages need (:class:`_Reserved`)."""


class _Reserved:
    """How much of each slot of a shared-memory file is reserved (``posix_fallocate``): a write
    into a slot first reserves what it needs, at least doubling the slot's reservation up to the
    slot, so the pages it touches exist -- a page first touched when memory has run out would
    kill the process with SIGBUS, where a failed reservation only sends the message over RPC (or
    fails the reply, naming why) -- and a channel holds the memory its largest messages needed,
    not every slot's whole size (80 MiB a trainer and server)."""

    def __init__(self, fd: int, slot_bytes: int, n: int) -> None:
        self.fd, self.slot_bytes = fd, slot_bytes
        self.reserved = [min(RESERVED_FIRST, slot_bytes)] * n  # the trainer reserved these (_Made)

    def room(self, k: int, nbytes: int) -> bool:
        """Whether the first ``nbytes`` of slot ``k`` are reserved, reserving more if needed."""
        have = self.reserved[k]
        if nbytes <= have:
            return True
        if nbytes > self.slot_bytes:
            return False
        want = min(self.slot_bytes, max(nbytes, 2 * have))
        try:
            os.posix_fallocate(self.fd, k * self.slot_bytes + have, want - have)
        except OSError:
            return False
        self.reserved[k] = want
        return True


def host_id() -> str:
    """Processes with equal host ids share a kernel (and so can open each other's files)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


@dataclass(frozen=True)
class ChannelFiles:
    """What the trainer made for one channel, as the server finds it: the trainer's pid, then
    for each of ``req``, ``rep`` (the two mappings), ``to_server`` (the read end of the
    server's doorbell) and ``to_trainer`` (the write end of the trainer's) the descriptor number
    in the trainer and the file's ``(st_dev, st_ino)``."""

    pid: int
    fds: dict[str, int]
    ids: dict[str, tuple[int, int]]


class _Made:
    """The trainer's descriptors of a channel being set up (every one close-on-exec)."""

    def __init__(self, capacity: int) -> None:
        self.fds: dict[str, int] = {}
        try:
            for name, n in (("req", WINDOW), ("rep", REPLY_SLOTS)):
                self.fds[name] = fd = os.memfd_create(f"hybrid-ps-{name}", os.MFD_CLOEXEC)
                os.ftruncate(fd, n * capacity)  # the slots' size; memory only as reserved
                for k in range(n):  # ENOSPC/ENOMEM now, not SIGBUS later
                    os.posix_fallocate(fd, k * capacity, min(RESERVED_FIRST, capacity))
            self.fds["to_server"], self.fds["bell_out"] = os.pipe()
            self.fds["bell_in"], self.fds["to_trainer"] = os.pipe()
            for name in ("bell_out", "bell_in"):
                os.set_blocking(self.fds[name], False)
        except BaseException:
            self.close()
            raise

    def path(self, name: str) -> str:
        return f"/proc/self/fd/{self.fds[name]}"

    def files(self) -> ChannelFiles:
        names = ("req", "rep", "to_server", "to_trainer")
        ids = {n: (st.st_dev, st.st_ino) for n in names for st in (os.fstat(self.fds[n]),)}
        return ChannelFiles(os.getpid(), {n: self.fds[n] for n in names}, ids)

    def take(self, name: str) -> int:
        return self.fds.pop(name)

    def close(self) -> None:
        _close_fds(self.fds.values())
        self.fds.clear()


class ShmTransport(TrainerEnd):
    """One trainer's shared-memory channel to one server on its host."""

    what = "shared-memory channel"
    shares_memory = True

    def __init__(self, server: str, made: _Made, capacity: int, *, fallback: Transport, timeout_s: float) -> None:
        super().__init__(server,
                         torch.from_file(made.path("req"), shared=True, size=WINDOW * capacity, dtype=torch.uint8),
                         torch.from_file(made.path("rep"), shared=True, size=REPLY_SLOTS * capacity, dtype=torch.uint8),
                         fallback=fallback, timeout_s=timeout_s)
        self.bell_in: int | None = made.take("bell_in")
        self.bell_out: int | None = made.take("bell_out")
        self.req_fd: int | None = os.dup(made.fds["req"])  # reserves the requests' memory
        self.req_room = _Reserved(self.req_fd, capacity, WINDOW)

    def _room(self, seq: int, nbytes: int) -> bool:
        return self.req_room.room(seq % WINDOW, nbytes)

    @classmethod
    def open(cls, server: str, trainer: int, *, fallback: Transport, timeout_s: float,
             capacity: int = DEFAULT_CAPACITY) -> ShmTransport | None:
        """A channel to ``server``, or ``None`` where the server is on another host (or cannot
        open this process's files, or shared memory is unusable here)."""
        try:
            made = _Made(capacity)
        except OSError:
            return None  # no memory to reserve: RPC serves
        try:
            end = cls(server, made, capacity, fallback=fallback, timeout_s=timeout_s)
            try:
                ok = rpc.rpc_sync(server, rpc_open_channel, args=(trainer, host_id(), made.files(), capacity),
                                  timeout=timeout_s)
            except BaseException:
                end.close()
                raise
            if not ok:
                end.close()
                return None
            return end
        finally:
            made.close()  # the server's ends: it holds its own now (or none)

    def _post(self, seq: int, end: int) -> bool:
        try:
            os.write(self.bell_out, bytes([seq & 0xFF]))
        except OSError:
            return False
        return True

    def _receive(self, left_s: float, block: bool) -> int | bool | None:
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
            if not got:
                return None
            for seq in self.pending:  # fewer than 256 unanswered: the low byte names one
                if seq & 0xFF == got[0]:
                    return seq
            raise ChannelError(f"parameter server {self.server} rang for message byte {got[0]}, which is not "
                               f"unanswered on the {self.what}")

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - at interpreter exit os may be gone; the kernel closes them
            pass

    def close(self) -> None:
        """Close this end; the server's thread for it sees end-of-file and stops."""
        self.closed = True
        fds = (self.bell_in, self.bell_out, self.req_fd)
        self.bell_in = self.bell_out = self.req_fd = None
        _close_fds(fds)


class _ServerEnd(ServerEnd):
    """The server's end for one trainer: a daemon thread that handles its messages."""

    what = "shared-memory channel"

    def __init__(self, fds: dict[str, int], capacity: int, name: str) -> None:
        """``fds``: this process's own descriptors of the channel's files (:func:`open_files`),
        which it takes over."""
        try:
            req, rep = (torch.from_file(f"/proc/self/fd/{fds[n]}", shared=True, size=size, dtype=torch.uint8)
                        for n, size in (("req", WINDOW * capacity), ("rep", REPLY_SLOTS * capacity)))
        except BaseException:
            _close_fds((fds.pop("rep"),))
            raise
        finally:
            _close_fds((fds.pop("req"),))  # the mapping holds the memory
        super().__init__(req, rep, name, reply_slots=REPLY_SLOTS)
        self.rep_fd: int | None = fds.pop("rep")  # to reserve the replies' memory
        self.rep_room = _Reserved(self.rep_fd, capacity, REPLY_SLOTS)
        self.bell_in: int | None = fds["to_server"]
        self.bell_out: int | None = fds["to_trainer"]
        self.thread.start()

    def _room(self, seq: int, nbytes: int) -> bool:
        return self.rep_room.room(seq % REPLY_SLOTS, nbytes)

    def _next(self, seq: int) -> bool:
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
            if got and got[0] != seq & 0xFF:
                return False  # not the trainer's doorbell: stop; its wait names the server
            return bool(got)  # empty: the trainer closed its end (it left or died)

    def _post_reply(self, seq: int, end: int) -> None:
        fd = self.bell_out
        if fd is None:
            return
        try:
            os.write(fd, bytes([seq & 0xFF]))
        except OSError:
            pass  # the trainer is gone; the heartbeat names it

    def close(self) -> None:
        with self.lock:
            fds = (self.bell_in, self.bell_out, self.rep_fd)
            self.bell_in = self.bell_out = self.rep_fd = None
        _close_fds(fds)


_MODES = {"req": os.O_RDWR, "rep": os.O_RDWR, "to_server": os.O_RDONLY, "to_trainer": os.O_WRONLY}


def open_files(files: ChannelFiles) -> dict[str, int] | None:
    """This process's descriptors of the files a trainer made (through ``/proc/<pid>/fd/``,
    close-on-exec, doorbells non-blocking), or ``None`` where one cannot be opened or is not the
    file the trainer named (another pid namespace, another user, a trainer gone)."""
    fds: dict[str, int] = {}
    try:
        for name, mode in _MODES.items():
            fds[name] = fd = os.open(f"/proc/{files.pid}/fd/{files.fds[name]}", mode | os.O_CLOEXEC | os.O_NONBLOCK)
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) != tuple(files.ids[name]):
                raise PermissionError(f"/proc/{files.pid}/fd/{files.fds[name]} is not the trainer's {name}")
    except OSError:
        _close_fds(fds.values())
        return None
    for name in ("req", "rep"):
        os.set_blocking(fds[name], True)
    return fds


def rpc_open_channel(trainer: int, host: str, files: ChannelFiles, capacity: int) -> bool:
    """On a server: serve ``trainer``'s step messages through the channel it set up (its thread
    ends when the trainer closes its end); ``False`` when the trainer is on another host or its
    files cannot be opened from here."""
    if host != host_id():
        return False
    fds = open_files(files)
    if fds is None:
        return False
    try:
        _ServerEnd(fds, capacity, f"hybrid-ps-channel-t{trainer}")
    except BaseException:
        _close_fds(fds.values())
        raise
    return True


def _close_fds(fds) -> None:
    for fd in list(fds):
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass
