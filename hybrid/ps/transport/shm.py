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
import struct
import tempfile
import threading
import time
from pathlib import Path

import torch
import torch.distributed.rpc as rpc

from hybrid.ps import protocol
from hybrid.ps.protocol import Frame, StepMessage
from hybrid.ps.transport import Transport

MAGIC = 0x48594252  # "HYBR"
STEP, ROWS, ERROR = 1, 2, 3
_HEADER = struct.Struct("<qqqqq")  # magic, seq, kind, number of ints, number of tensors
_ENTRY = struct.Struct("<qqq")  # dtype code, elements, offset
_ALIGN = 64
_DTYPES = {0: torch.int64, 1: torch.float32, 2: torch.uint8, 3: torch.bfloat16, 4: torch.float16}
_CODES = {v: k for k, v in _DTYPES.items()}

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


class ChannelError(RuntimeError):
    """The server at the other end died, closed the channel, or did not answer in time."""


def _layout(n_ints: int, nbytes: list[int]) -> tuple[list[int], int]:
    """Offsets of a frame's tensors (``nbytes`` each) after its header, and the frame's end."""
    offset = _HEADER.size + 8 * n_ints + _ENTRY.size * len(nbytes)
    offsets = []
    for n in nbytes:
        offset = (offset + _ALIGN - 1) // _ALIGN * _ALIGN
        offsets.append(offset)
        offset += n
    return offsets, offset


def _write_frame(region: torch.Tensor, seq: int, kind: int, frame: Frame) -> bool:
    """Lay out ``frame`` in ``region`` (uint8); ``False`` if it does not fit."""
    tensors = frame.tensors
    offsets, end = _layout(len(frame.ints), [t.numel() * t.element_size() for t in tensors])
    if end > region.numel():
        return False
    meta = struct.pack(f"<{len(frame.ints)}q", *frame.ints) + b"".join(
        _ENTRY.pack(_CODES[t.dtype], t.numel(), off) for t, off in zip(tensors, offsets))
    head = _HEADER.pack(MAGIC, seq, kind, len(frame.ints), len(tensors)) + meta
    region[: len(head)].copy_(torch.frombuffer(bytearray(head), dtype=torch.uint8))
    for t, off in zip(tensors, offsets):
        dst = region[off : off + t.numel() * t.element_size()].view(t.dtype)
        if dst.data_ptr() != t.data_ptr():  # rows gathered in place need no copy
            dst.copy_(t.reshape(-1))
    return True


def _read_frame(region: torch.Tensor, seq: int) -> tuple[int, Frame]:
    """The message in ``region``: its kind and frame (tensors are views into ``region``)."""
    magic, got_seq, kind, n_ints, n_tensors = _HEADER.unpack(bytes(region[: _HEADER.size].numpy()))
    if magic != MAGIC or got_seq != seq or not 0 <= n_ints < region.numel() or not 0 <= n_tensors < region.numel():
        raise ChannelError(f"corrupt message in the shared-memory channel (magic {magic:#x}, sequence {got_seq} "
                           f"where {seq} was due)")
    end = _HEADER.size + 8 * n_ints + _ENTRY.size * n_tensors
    if end > region.numel():
        raise ChannelError("corrupt message in the shared-memory channel (header larger than the mapping)")
    meta = bytes(region[_HEADER.size : end].numpy())
    ints = list(struct.unpack_from(f"<{n_ints}q", meta))
    tensors = []
    for k in range(n_tensors):
        code, n, off = _ENTRY.unpack_from(meta, 8 * n_ints + _ENTRY.size * k)
        dtype = _DTYPES.get(code)
        if dtype is None or n < 0 or off < end or off + n * dtype.itemsize > region.numel():
            raise ChannelError("corrupt message in the shared-memory channel (a tensor outside the mapping)")
        tensors.append(region[off : off + n * dtype.itemsize].view(dtype))
    return kind, Frame(ints, tensors)


def _error_frame(err: BaseException | str) -> Frame:
    text = str(err).encode("utf-8") or b"error"
    return Frame([], [torch.frombuffer(bytearray(text), dtype=torch.uint8)])


class ShmTransport(Transport):
    """One trainer's shared-memory channel to one server on its host: one message at a time."""

    def __init__(self, server: str, directory: Path, capacity: int, *, fallback: Transport, timeout_s: float) -> None:
        self.server = server
        self.fallback = fallback
        self.timeout_s = timeout_s
        self.seq = 0
        self.outstanding: _ChannelFuture | None = None
        self.closed = False
        self.req = torch.from_file(str(directory / "req"), shared=True, size=capacity, dtype=torch.uint8)
        self.rep = torch.from_file(str(directory / "rep"), shared=True, size=capacity, dtype=torch.uint8)
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
            for name in ("req", "rep"):
                with open(directory / name, "wb") as f:
                    os.posix_fallocate(f.fileno(), 0, capacity)  # ENOSPC now, not SIGBUS later
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

    def send(self, msg: StepMessage):
        # One message at a time. An outstanding reply that carries rows may wait for a step this
        # message completes (a prefetch), so this one goes over RPC instead; a push-only message's
        # reply waits for nothing, so it is collected first.
        if self.closed or msg.autograd or (
                self.outstanding is not None and not self._collect(block=not self.outstanding.answers_rows)):
            return self.fallback.send(msg)
        seq = self.seq + 1
        if not _write_frame(self.req, seq, STEP, protocol.encode(msg)):
            return self.fallback.send(msg)
        try:
            os.write(self.bell_out, b"\1")
        except OSError:
            self.closed = True  # the server is gone: RPC says so, naming it
            return self.fallback.send(msg)
        self.seq = seq
        self.outstanding = _ChannelFuture(self, answers_rows=any(p.lookup is not None for p in msg.parts))
        return self.outstanding

    def _collect(self, block: bool) -> bool:
        """Complete the outstanding message's future from its reply (rows or error); without
        ``block``, ``False`` if the reply is not there yet. A message whose future nobody waits
        for (a prefetch discarded for another batch) is collected by the next :meth:`send`."""
        fut, deadline = self.outstanding, time.monotonic() + self.timeout_s
        while True:
            try:
                got = os.read(self.bell_in, 1)
            except BlockingIOError:
                left = deadline - time.monotonic()
                if not block:
                    return False
                if left <= 0:
                    fut.error = ChannelError(f"parameter server {self.server} did not answer within "
                                             f"runtime.rpc_timeout_s: timeout ({self.timeout_s * 1000:.0f} ms)")
                    self.closed = True
                    break
                select.select([self.bell_in], [], [], left)
                continue
            if not got:
                fut.error = ChannelError(f"parameter server {self.server} closed the shared-memory channel: EOF")
                self.closed = True
                break
            try:
                kind, frame = _read_frame(self.rep, self.seq)
            except ChannelError as e:
                fut.error, self.closed = e, True
                break
            if kind == ERROR:
                fut.error = RuntimeError(bytes(frame.tensors[0].numpy()).decode("utf-8", "replace"))
            else:
                fut.result = [t.clone() for t in frame.tensors]
            break
        fut.done = True
        self.outstanding = None
        return True

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


class _ChannelFuture:
    def __init__(self, end: ShmTransport, *, answers_rows: bool) -> None:
        self.end = end
        self.answers_rows = answers_rows
        self.done = False
        self.result: list[torch.Tensor] | None = None
        self.error: BaseException | None = None

    def wait(self) -> list[torch.Tensor]:
        if not self.done:
            self.end._collect(block=True)
        if self.error is not None:
            raise self.error
        return self.result


class _ServerEnd:
    """The server's end for one trainer: a daemon thread that handles its messages."""

    def __init__(self, directory: Path, capacity: int, name: str) -> None:
        self.req = torch.from_file(str(directory / "req"), shared=True, size=capacity, dtype=torch.uint8)
        self.rep = torch.from_file(str(directory / "rep"), shared=True, size=capacity, dtype=torch.uint8)
        self.bell_in: int | None = os.open(directory / "to_server", os.O_RDONLY | os.O_NONBLOCK)
        self.bell_out: int | None = os.open(directory / "to_trainer", os.O_WRONLY | os.O_NONBLOCK)
        self.lock = threading.Lock()
        self.seq = 0
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
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

    def _run(self) -> None:
        from hybrid.ps.server.service import server

        while True:
            fd = self.bell_in
            if fd is None:
                return
            try:
                select.select([fd], [], [])
                got = os.read(fd, 1)
            except BlockingIOError:
                continue
            except (OSError, ValueError):
                return
            if not got:  # the trainer closed its end: it left or died
                self.close()
                return
            self.seq += 1
            seq = self.seq
            try:
                _, frame = _read_frame(self.req, seq)
                msg = protocol.decode(frame)
                server().handle_step(msg, lambda rows, err, seq=seq: self.reply(seq, rows, err), self.buffers,
                                     via_channel=True)
            except BaseException as e:  # noqa: BLE001 - the trainer gets it as the message's error
                try:
                    self.reply(seq, None, e)
                except BaseException:  # noqa: BLE001 - keep serving; the trainer's wait times out
                    pass

    def buffers(self, sizes: list[int], dtypes: list[torch.dtype]) -> list[torch.Tensor]:
        """Where each part's rows (``sizes`` elements of ``dtypes``) go: in place in the reply's
        frame, so that they are gathered straight into it (fresh tensors when they would not fit)."""
        nbytes = [n * d.itemsize for n, d in zip(sizes, dtypes)]
        offsets, end = _layout(0, nbytes)
        if end > self.rep.numel():
            return [torch.empty(n, dtype=d) for n, d in zip(sizes, dtypes)]
        return [self.rep[off : off + b].view(d) for off, b, d in zip(offsets, nbytes, dtypes)]

    def reply(self, seq: int, rows: list[torch.Tensor] | None, err: BaseException | None = None) -> None:
        """Answer message ``seq`` (from whichever thread completes it)."""
        if err is not None:
            _write_frame(self.rep, seq, ERROR, _error_frame(err))
        elif not _write_frame(self.rep, seq, ROWS, Frame([], rows)):
            _write_frame(self.rep, seq, ERROR, _error_frame("reply larger than the shared-memory channel"))
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
