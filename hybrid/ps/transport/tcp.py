"""Step messages to a parameter server on another host, over a TCP connection of their own.

Over RPC a step message costs, besides its bytes, TensorPipe's pickling, its event-loop threads
on both ends and a hop to an RPC worker thread; across hosts that made the server's CPU per step
2.4x what the same messages cost through shared memory on one host (docs/performance.md). A
:class:`SocketTransport` sends the same frame (:mod:`hybrid.ps.transport.channel`) as its length
and message number, then the frame's bytes, on a connection that carries nothing else; the
server's thread for this trainer reads it into a slot of its own, handles it in place and
answers the same way (rows gathered straight into the reply's slot), replies in the order they
are completed. Up to two messages are unanswered at a time, as on the shared-memory channel; the
rest goes over RPC.

Set-up is one RPC: the server opens a listener on its ``runtime.address`` (an ephemeral port)
for this one connection, the trainer connects and first sends a 32-byte token it passed in that
RPC; a connection without it is dropped. The listener closes once the trainer is in, or after
``runtime.rpc_timeout_s``.

Failures: a server that dies closes the connection, and the trainer's wait ends at once with the
server's name; one that does not answer within ``runtime.rpc_timeout_s`` is named after it. A
trainer that dies closes its end; the server's thread for it ends.
"""

from __future__ import annotations

import hmac
import os
import select
import socket
import struct
import threading
import time
from collections.abc import Callable

import torch
import torch.distributed.rpc as rpc

from hybrid.ps.transport import Transport
from hybrid.ps.protocol import Frame
from hybrid.ps.transport.channel import (REPLY_SLOTS, STEP, WINDOW, ChannelError, ServerEnd, TrainerEnd,
                                         frame_pieces)

DEFAULT_CAPACITY = 16 << 20
"""Bytes of each slot (a frame's room at either end): a bigger message goes over RPC."""
TOKEN_BYTES = 32
_PREFIX = struct.Struct("<qq")  # the frame's length, its message's number


def address_family(address: str) -> int:
    return socket.AF_INET6 if ":" in address else socket.AF_INET


def recv_exact(sock: socket.socket, view: memoryview, deadline: float | None) -> bool:
    """Fill ``view`` from ``sock``; ``False`` at end-of-file. Raises ``TimeoutError`` past
    ``deadline`` (None: wait for ever)."""
    got = 0
    while got < len(view):
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([sock], [], [], left)[0]:
                raise TimeoutError
        n = sock.recv_into(view[got:])
        if n == 0:
            return False
        got += n
    return True


def _recv_frame(sock: socket.socket, region_of, deadline: float | None) -> int | None:  # noqa: ANN001
    """Read one frame (its length and message number, then its bytes) into ``region_of(number)``;
    its number, or ``None`` at end-of-file. Raises ``ValueError`` for a number ``region_of``
    refuses or a length the region cannot hold, ``TimeoutError`` past ``deadline``."""
    head = bytearray(_PREFIX.size)
    if not recv_exact(sock, memoryview(head), deadline):
        return None
    n, seq = _PREFIX.unpack(head)
    region = region_of(seq)
    if not 0 < n <= region.numel():
        raise ValueError(f"a frame of {n} bytes")
    return seq if recv_exact(sock, memoryview(region[:n].numpy()), deadline) else None


def _send_frame(sock: socket.socket, region: torch.Tensor, seq: int, end: int) -> None:
    _send_pieces(sock, [_PREFIX.pack(end, seq), memoryview(region[:end].numpy())])


def _send_pieces(sock: socket.socket, pieces: list, wait: Callable[[], bool] | None = None) -> bool:
    """Send ``pieces`` one after the other, gathered by the kernel (``sendmsg``), however many
    calls that takes. With ``wait``, without blocking: whenever the socket takes nothing,
    ``wait()`` waits for it and says whether to go on; ``False`` if it gave up."""
    views = [memoryview(p).cast("B") for p in pieces if len(p)]
    while views:
        if wait is None:
            sent = sock.sendmsg(views)
        else:
            try:
                sent = sock.sendmsg(views, [], socket.MSG_DONTWAIT)
            except BlockingIOError:
                sent = 0
            if not sent and not wait():
                return False
        while views and sent >= len(views[0]):
            sent -= len(views[0])
            views.pop(0)
        if sent:
            views[0] = views[0][sent:]
    return True


class SocketTransport(TrainerEnd):
    """One trainer's step connection to one server."""

    what = "TCP step connection"

    def __init__(self, server: str, sock: socket.socket, capacity: int, *, fallback: Transport,
                 timeout_s: float) -> None:
        # No request region: a frame is sent from its tensors (:meth:`_write`).
        super().__init__(server, torch.empty(0, dtype=torch.uint8),
                         torch.empty(REPLY_SLOTS * capacity, dtype=torch.uint8), fallback=fallback, timeout_s=timeout_s)
        self.capacity = capacity
        self.sock: socket.socket | None = sock
        self.pieces: list = []

    @classmethod
    def open(cls, server: str, trainer: int, *, fallback: Transport, timeout_s: float,
             capacity: int = DEFAULT_CAPACITY) -> SocketTransport | None:
        """A connection to ``server``, or ``None`` where it could not be made (RPC serves)."""
        token = os.urandom(TOKEN_BYTES)
        host, port = rpc.rpc_sync(server, rpc_open_socket, args=(trainer, token, capacity, timeout_s),
                                  timeout=timeout_s)
        if port is None:
            return None
        try:
            sock = socket.create_connection((host, port), timeout=timeout_s)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.sendall(token)
            sock.settimeout(None)
        except OSError:
            return None
        return cls(server, sock, capacity, fallback=fallback, timeout_s=timeout_s)

    def _write(self, seq: int, frame: Frame) -> int:
        # Sent from where its tensors are (a gradient, the ids): no copy into a region first. The
        # server's region holds ``capacity`` bytes, so what would not fit there goes over RPC.
        pieces, end = frame_pieces(seq, STEP, frame)
        if end > self.capacity:
            return 0
        self.pieces = pieces
        return end

    def _post(self, seq: int, end: int) -> bool:
        """Send the frame, taking in the replies that arrive meanwhile: the server's thread for
        this trainer answers a message before it reads the next one, so a reply larger than the
        sockets' buffers that nobody read would stop the server's thread, and with it the read
        of this frame, for good. ``False`` if the server is gone or takes nothing for
        ``runtime.rpc_timeout_s``."""
        pieces, self.pieces = self.pieces, []
        sock = self.sock
        if sock is None:
            return False

        def wait() -> bool:  # until the socket takes more, taking in any reply that comes first
            readable, writable, _ = select.select([sock] if self.pending else [], [sock], [], self.timeout_s)
            if readable:
                self._take(block=False)
            return bool(readable or writable) and not self.closed

        try:
            return _send_pieces(sock, [_PREFIX.pack(end, seq), *pieces], wait)
        except OSError:
            return False

    def _receive(self, left_s: float, block: bool) -> int | bool | None:
        sock = self.sock
        if sock is None:
            return None
        if not select.select([sock], [], [], left_s if block else 0.0)[0]:
            return False
        try:
            return _recv_frame(sock, self._reply_slot, time.monotonic() + self.timeout_s)
        except ValueError as e:
            raise ChannelError(f"parameter server {self.server} sent {e} over the {self.what}") from None
        except TimeoutError:
            return False
        except OSError:
            return None

    def _reply_slot(self, seq: int) -> torch.Tensor:
        if seq not in self.pending:
            raise ValueError(f"a reply to message {seq}, which is not unanswered,")
        return self.rep_slots[seq % REPLY_SLOTS]

    def close(self) -> None:
        """Close the connection; the server's thread for it sees end-of-file and stops."""
        self.closed = True
        sock, self.sock = self.sock, None
        _shut(sock)


class _SocketServerEnd(ServerEnd):
    """The server's end of one trainer's step connection."""

    what = "TCP step connection"

    def __init__(self, sock: socket.socket, capacity: int, name: str) -> None:
        super().__init__(torch.empty(WINDOW * capacity, dtype=torch.uint8),
                         torch.empty(WINDOW * capacity, dtype=torch.uint8), name, reply_slots=WINDOW)
        self.sock: socket.socket | None = sock
        self.thread.start()

    def _next(self, seq: int) -> bool:
        sock = self.sock
        if sock is None:
            return False
        try:
            return _recv_frame(sock, lambda _: self.req_slots[seq % WINDOW], None) == seq
        except (OSError, ValueError):  # not a frame this end can hold: the trainer's wait names the server
            return False

    def _post_reply(self, seq: int, end: int) -> None:
        with self.lock:  # replies completed on two threads go one after the other
            sock = self.sock
            if sock is None:
                return
            try:
                _send_frame(sock, self._region(seq), seq, end)
            except OSError:
                pass  # the trainer is gone; the heartbeat names it

    def close(self) -> None:
        with self.lock:
            sock, self.sock = self.sock, None
        _shut(sock)


def _shut(sock: socket.socket | None) -> None:
    """End the connection both ways (waking a thread blocked reading it), then close it."""
    if sock is None:
        return
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()


def rpc_open_socket(trainer: int, token: bytes, capacity: int, timeout_s: float) -> tuple[str, int | None]:
    """On a server: listen on its address for ``trainer``'s step connection (which must send
    ``token`` first) and serve it; the (address, port) to connect to."""
    from hybrid.ps.server.service import server

    address = server().options.address
    listener = socket.socket(address_family(address), socket.SOCK_STREAM)
    try:
        listener.bind((address, 0))
        listener.listen(1)
    except OSError:
        listener.close()
        return address, None
    threading.Thread(target=_accept, args=(listener, trainer, token, capacity, timeout_s),
                     name=f"hybrid-ps-accept-t{trainer}", daemon=True).start()
    return address, listener.getsockname()[1]


def _accept(listener: socket.socket, trainer: int, token: bytes, capacity: int, timeout_s: float) -> None:
    try:
        conn = accept_proven(listener, token, time.monotonic() + timeout_s)
        if conn is None:
            return
        conn.settimeout(None)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        _SocketServerEnd(conn, capacity, f"hybrid-ps-socket-t{trainer}")
    finally:
        listener.close()


def accept_proven(listener: socket.socket, proof: bytes, deadline: float) -> socket.socket | None:
    """The first connection to ``listener`` whose first bytes are ``proof``, before ``deadline``
    (every other is closed); None past the deadline or once the listener is closed."""
    while (left := deadline - time.monotonic()) > 0:
        listener.settimeout(left)
        try:
            conn, _ = listener.accept()
        except OSError:
            return None
        got = bytearray(len(proof))
        try:
            ok = recv_exact(conn, memoryview(got), deadline) and hmac.compare_digest(bytes(got), proof)
        except (OSError, TimeoutError):
            ok = False
        if ok:
            return conn
        conn.close()
    return None
