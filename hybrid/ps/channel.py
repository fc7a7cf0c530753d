"""A trainer's lookups and gradient pushes to a parameter server on its own host, through shared
memory instead of TensorPipe (``runtime.ps_channel``).

A lookup is one request and one reply per server and step; over RPC each costs, besides the
payload, TensorPipe's event-loop and cross-memory-attach threads on both sides (a third of a
server's CPU per step in the benchmark's profile), pickling, and a hop to an RPC worker thread.
Between two processes of one host the same request can be written into a file in ``/dev/shm``
that both map, with a one-byte write to a FIFO as its doorbell: the server's thread for this
trainer sleeps in ``read`` on its FIFO, wakes, handles the request in place (the ids and the
gradients are read straight from the shared pages, the rows gathered straight into the reply's)
and rings back. Nothing spins.

The channel carries only the hot path -- lookups and the gradient pushes riding on them -- of
one collection between one trainer and one server; everything else (creating tables,
checkpoints, evaluation reads, pushes sent on their own) stays on RPC, and so does a request
while the previous one on the channel is unanswered, or one too big for the mapping. The server
applies what arrives by either way exactly as it does now (pushes are counted per trainer and
step, so their order of arrival does not matter). Set-up is an RPC: the trainer makes a fresh
``0700`` directory in ``/dev/shm`` with the two files and two FIFOs, the server opens them
(refusing a directory it does not own or that others may enter), and the trainer removes the
directory once both ends are open.

Failures: a server that dies closes its FIFO, and the trainer's wait ends at once with the
server's name; one that does not answer within ``runtime.rpc_timeout_s`` is named after it; an
exception while the server handles a request comes back as the lookup's error, as over RPC. A
trainer that dies closes its end; the server's thread for it ends (the server's heartbeat names
the trainer, as before).
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

MODES = ("auto", "rpc")
_mode = "auto"

MAGIC = 0x48594252  # "HYBR"
LOOKUP, ROWS, ERROR = 1, 2, 3
_HEADER = struct.Struct("<qqqqq")  # magic, seq, kind, number of ints, number of tensors
_ALIGN = 64
_DTYPES = {0: torch.int64, 1: torch.float32, 2: torch.uint8}
_CODES = {v: k for k, v in _DTYPES.items()}

DEFAULT_CAPACITY = 16 << 20
"""Bytes of each direction's mapping, reserved up front (``posix_fallocate``): a tmpfs file
written past the space ``/dev/shm`` has left would kill the process with SIGBUS, a failed
reservation only sends the lookups over RPC. The largest message that fits: the benchmark's is
about 1.1 MB (8,000 rows of 32 floats, their ids and gradients); a bigger one goes over RPC."""


def configure(*, mode: str) -> None:
    """Process-wide: ``rpc`` (every lookup over RPC) or ``auto`` (shared memory to servers on
    this host, RPC to the others)."""
    global _mode
    if mode not in MODES:
        raise ValueError(f"ps_channel must be one of {', '.join(MODES)}, got {mode!r}")
    _mode = mode


def mode() -> str:
    return _mode


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


def _write_frame(region: torch.Tensor, seq: int, kind: int, ints: list[int], tensors: list[torch.Tensor]) -> bool:
    """Lay out one message in ``region`` (uint8); ``False`` if it does not fit."""
    table = []
    offset = _HEADER.size + 8 * len(ints) + 24 * len(tensors)
    for t in tensors:
        offset = (offset + _ALIGN - 1) // _ALIGN * _ALIGN
        table.append((_CODES[t.dtype], t.numel(), offset))
        offset += t.numel() * t.element_size()
    if offset > region.numel():
        return False
    meta = struct.pack(f"<{len(ints)}q", *ints) + b"".join(struct.pack("<qqq", *e) for e in table)
    head = _HEADER.pack(MAGIC, seq, kind, len(ints), len(tensors)) + meta
    region[: len(head)].copy_(torch.frombuffer(bytearray(head), dtype=torch.uint8))
    for t, (_, n, off) in zip(tensors, table):
        dst = region[off : off + n * t.element_size()].view(t.dtype)
        if dst.data_ptr() != t.data_ptr():  # rows gathered in place need no copy
            dst.copy_(t.reshape(-1))
    return True


_ROWS_OFFSET = (_HEADER.size + 24 + _ALIGN - 1) // _ALIGN * _ALIGN
"""Where a reply's rows start (no ints, one tensor): :meth:`ServerEnd.rows_buffer`."""


def _read_frame(region: torch.Tensor, seq: int) -> tuple[int, list[int], list[torch.Tensor]]:
    """The message in ``region``: its kind, ints and tensors (views into ``region``)."""
    head = bytes(region[: _HEADER.size].numpy())
    magic, got_seq, kind, n_ints, n_tensors = _HEADER.unpack(head)
    if magic != MAGIC or got_seq != seq:
        raise ChannelError(f"corrupt message in the shared-memory channel (magic {magic:#x}, sequence {got_seq} "
                           f"where {seq} was due)")
    end = _HEADER.size + 8 * n_ints + 24 * n_tensors
    meta = bytes(region[_HEADER.size : end].numpy())
    ints = list(struct.unpack_from(f"<{n_ints}q", meta))
    tensors = []
    for k in range(n_tensors):
        code, n, off = struct.unpack_from("<qqq", meta, 8 * n_ints + 24 * k)
        dtype = _DTYPES[code]
        if off < end or off + n * dtype.itemsize > region.numel():
            raise ChannelError("corrupt message in the shared-memory channel (a tensor outside the mapping)")
        tensors.append(region[off : off + n * dtype.itemsize].view(dtype))
    return kind, ints, tensors


def encode_lookup(step: int, n_raw: int, ids: torch.Tensor, counts: list[int],
                  pushes: list[tuple[int, list]]) -> tuple[list[int], list[torch.Tensor]]:
    ints = [step, n_raw, len(counts), *counts, len(pushes)]
    tensors = [ids]
    for pstep, parts in pushes:
        ints += [pstep, len(parts)]
        for pids, pcounts, grad in parts:
            ints += [len(pcounts), *pcounts]
            tensors += [pids, grad]
    return ints, tensors


def decode_lookup(ints: list[int], tensors: list[torch.Tensor]):
    """``(step, n_raw, ids, counts, pushes)`` of a request (``pushes`` as ``rpc_lookup`` takes)."""
    step, n_raw, nc = ints[0], ints[1], ints[2]
    counts = ints[3 : 3 + nc]
    k = 3 + nc
    n_steps = ints[k]
    k += 1
    t = 1
    pushes = []
    for _ in range(n_steps):
        pstep, n_parts = ints[k], ints[k + 1]
        k += 2
        parts = []
        for _ in range(n_parts):
            npc = ints[k]
            pcounts = ints[k + 1 : k + 1 + npc]
            k += 1 + npc
            parts.append((tensors[t], pcounts, tensors[t + 1]))
            t += 2
        pushes.append((pstep, parts))
    return step, n_raw, tensors[0], counts, pushes


class TrainerEnd:
    """One trainer's end of a channel to one server: one request at a time."""

    def __init__(self, server_name: str, directory: Path, capacity: int, timeout_s: float) -> None:
        self.server_name = server_name
        self.timeout_s = timeout_s
        self.seq = 0
        self.outstanding: ChannelFuture | None = None
        self.closed = False
        self.req = torch.from_file(str(directory / "req"), shared=True, size=capacity, dtype=torch.uint8)
        self.rep = torch.from_file(str(directory / "rep"), shared=True, size=capacity, dtype=torch.uint8)
        self.bell_in = os.open(directory / "to_trainer", os.O_RDONLY | os.O_NONBLOCK)
        self.bell_out: int | None = None

    @classmethod
    def open(cls, server_name: str, cid: str, trainer: int, timeout_s: float,
             capacity: int = DEFAULT_CAPACITY) -> TrainerEnd | None:
        """Open a channel to ``server_name`` for collection ``cid``, or ``None`` where the server
        is on another host (or shared memory is unusable here)."""
        import torch.distributed.rpc as rpc

        from hybrid.ps import server as srv

        if not os.path.isdir("/dev/shm"):
            return None
        directory = Path(tempfile.mkdtemp(prefix="hybrid-ps-", dir="/dev/shm"))
        try:
            for name in ("req", "rep"):
                with open(directory / name, "wb") as f:
                    os.posix_fallocate(f.fileno(), 0, capacity)  # ENOSPC now, not SIGBUS later
            for name in ("to_server", "to_trainer"):
                os.mkfifo(directory / name, 0o600)
            end = cls(server_name, directory, capacity, timeout_s)
            try:
                ok = rpc.rpc_sync(server_name, srv.rpc_open_channel,
                                  args=(cid, trainer, host_id(), str(directory), capacity), timeout=timeout_s)
                if not ok:
                    end.close()
                    return None
                end.bell_out = os.open(directory / "to_server", os.O_WRONLY | os.O_NONBLOCK)
            except BaseException:
                end.close()
                raise
            return end
        finally:
            shutil.rmtree(directory, ignore_errors=True)

    def send(self, ints: list[int], tensors: list[torch.Tensor]) -> ChannelFuture | None:
        """Send a lookup; ``None`` (nothing sent) while the previous one is unanswered, when it
        does not fit, or once the channel is broken: the caller sends it over RPC."""
        if self.closed or (self.outstanding is not None and not self._collect(block=False)):
            return None
        seq = self.seq + 1
        if not _write_frame(self.req, seq, LOOKUP, ints, tensors):
            return None
        try:
            os.write(self.bell_out, b"\1")
        except OSError:
            self.closed = True  # the server is gone: RPC says so, naming it
            return None
        self.seq = seq
        self.outstanding = ChannelFuture(self)
        return self.outstanding

    def _collect(self, block: bool) -> bool:
        """Complete the outstanding request's future from its reply (rows or error); without
        ``block``, ``False`` if the reply is not there yet. A request whose future nobody waits
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
                    fut.error = ChannelError(f"parameter server {self.server_name} did not answer within "
                                             f"runtime.rpc_timeout_s: timeout ({self.timeout_s * 1000:.0f} ms)")
                    self.closed = True
                    break
                select.select([self.bell_in], [], [], left)
                continue
            if not got:
                fut.error = ChannelError(f"parameter server {self.server_name} closed the shared-memory channel: EOF")
                self.closed = True
                break
            try:
                kind, _, tensors = _read_frame(self.rep, self.seq)
            except ChannelError as e:
                fut.error, self.closed = e, True
                break
            if kind == ERROR:
                fut.error = RuntimeError(bytes(tensors[0].numpy()).decode("utf-8", "replace"))
            else:
                fut.result = tensors[0].clone()
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


class ChannelFuture:
    """The reply to one request, as ``wait()`` (what ``_Pending`` asks of an RPC future)."""

    def __init__(self, end: TrainerEnd) -> None:
        self.end = end
        self.done = False
        self.result: torch.Tensor | None = None
        self.error: BaseException | None = None

    def wait(self) -> torch.Tensor:
        if not self.done:
            self.end._collect(block=True)
        if self.error is not None:
            raise self.error
        return self.result


class ServerEnd:
    """The server's end for one trainer and collection: a daemon thread that handles requests."""

    def __init__(self, directory: Path, capacity: int, name: str, handler) -> None:
        self.req = torch.from_file(str(directory / "req"), shared=True, size=capacity, dtype=torch.uint8)
        self.rep = torch.from_file(str(directory / "rep"), shared=True, size=capacity, dtype=torch.uint8)
        self.bell_in = os.open(directory / "to_server", os.O_RDONLY | os.O_NONBLOCK)
        self.bell_out = os.open(directory / "to_trainer", os.O_WRONLY | os.O_NONBLOCK)
        self.handler = handler
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
                kind, ints, tensors = _read_frame(self.req, seq)
                self.handler(ints, tensors, lambda rows, err=None, seq=seq: self.reply(seq, rows, err))
            except BaseException as e:  # noqa: BLE001 - the trainer gets it as the lookup's error
                try:
                    self.reply(seq, None, e)
                except BaseException:  # noqa: BLE001 - keep serving; the trainer's wait times out
                    pass

    def rows_buffer(self, numel: int) -> torch.Tensor:
        """Where the reply's ``numel`` floats of rows go, so that they are gathered in place (a
        fresh tensor when they would not fit: the reply then reports it)."""
        end = _ROWS_OFFSET + 4 * numel
        if end > self.rep.numel():
            return torch.empty(numel)
        return self.rep[_ROWS_OFFSET:end].view(torch.float32)

    def reply(self, seq: int, rows: torch.Tensor | None, err: BaseException | None = None) -> None:
        """Answer request ``seq`` with ``rows`` (or the error), from whichever thread completes it."""
        if err is not None:
            msg = torch.frombuffer(bytearray(str(err).encode("utf-8") or b"error"), dtype=torch.uint8)
            _write_frame(self.rep, seq, ERROR, [], [msg])
        elif not _write_frame(self.rep, seq, ROWS, [], [rows]):
            msg = torch.frombuffer(bytearray(b"reply larger than the shared-memory channel"), dtype=torch.uint8)
            _write_frame(self.rep, seq, ERROR, [], [msg])
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


def _close_fds(fds) -> None:
    for fd in fds:
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass
