"""How a trainer's step messages reach a parameter server: one interface, three implementations.

A :class:`Transport` sends one :class:`hybrid.ps.protocol.StepMessage` to one server and returns
a future of the reply (one tensor of rows per part). RPC (TensorPipe) is the transport that
works everywhere and the control plane for everything else (creating tables, checkpoints,
evaluation reads, counters). The frame channels (:mod:`hybrid.ps.transport.channel`) carry step
messages without TensorPipe's threads and pickling, two unanswered at a time, and fall back to
RPC for what they cannot carry: :class:`~hybrid.ps.transport.shm.ShmTransport` through shared
memory between processes of one host, :class:`~hybrid.ps.transport.tcp.SocketTransport` over a
TCP connection of their own across hosts.
:func:`connect` picks one per server (``runtime.ps_transport``).

One-process mode (no parameter-server process: ``hybrid train`` without torchrun, ``hybrid
launch -n 1``, or a plan with ``parameter_servers: 0``): the trainer process is itself server
``ps0`` (:func:`serve_here`). Its step messages go through :class:`LocalTransport` and its control
calls through :func:`call` straight into the same :class:`hybrid.ps.server.service.ParameterServer`
-- the same shards, optimizers and step bookkeeping the servers run, without RPC.
"""

from __future__ import annotations

import secrets
import threading
from abc import ABC, abstractmethod
from typing import Protocol

import torch

from hybrid.log import logger
from hybrid.ps.protocol import StepMessage


class ReplyFuture(Protocol):
    """What :meth:`Transport.send` returns."""

    def wait(self) -> list[torch.Tensor]: ...


class Transport(ABC):
    """One trainer's connection to one parameter server for step messages: one numbered stream
    (:mod:`hybrid.ps.protocol`), so that the server handles them in the order they were sent,
    whichever way each went (a frame channel hands some to its RPC fallback)."""

    server: str
    """The server's RPC worker name (``ps0``), for messages."""
    what: str = "transport"
    """How the messages travel, in words (logged once per server, named in errors)."""
    shares_memory: bool = False
    """Whether the messages stay in this host's memory (the server in this process, or a
    shared-memory channel) rather than crossing a network connection (TCP, RPC): what
    ``pool_on: auto`` goes by."""

    def __init__(self) -> None:
        self.stream = secrets.randbits(62)  # unique among the streams one server sees
        self._next = 1
        self._numbering = threading.Lock()

    def send(self, msg: StepMessage) -> ReplyFuture:
        """Number ``msg`` in this transport's stream and send it; the future yields one tensor per
        part (empty for a push-only part). Distributed-autograd lookups go unnumbered: RPC
        records each in the sender's autograd context on the thread that runs it, so it cannot
        wait for another thread, and they carry no pushes to order."""
        if msg.autograd:
            return self.deliver(msg)
        with self._numbering:  # numbered and handed over together: the server waits for any gap
            msg.stream, msg.seq = self.stream, self._next
            fut = self.deliver(msg)
            # A message whose handing over raised was not sent: its number goes to the next one,
            # or the server would hold every later message for the gap.
            self._next += 1
            return fut

    @abstractmethod
    def deliver(self, msg: StepMessage) -> ReplyFuture:
        """Send ``msg`` as numbered (a channel hands what it cannot carry to its fallback's)."""

    def close(self) -> None:
        """Release what the transport holds (nothing for RPC)."""


_HERE: set[str] = set()
"""Servers held by this process (one-process mode)."""


def serve_here(server: str, options=None) -> None:  # noqa: ANN001 - a service.ServerOptions
    """Make this (trainer) process hold server ``server`` itself: :func:`connect` and :func:`call`
    then reach it without RPC. ``options``: its :class:`~hybrid.ps.server.service.ServerOptions`."""
    from hybrid.ps.server import service

    if server not in _HERE:
        service.start(int(server.removeprefix("ps")), options or service.ServerOptions())
        _HERE.add(server)


def raise_error_answer(fut: torch.futures.Future):
    """The value of an RPC future, raising an error the server gave: ``torch.distributed.rpc``
    hands the error of an ``async_execution`` entry point's future to the caller as the answer's
    value rather than raising it."""
    value = fut.wait()
    if isinstance(value, BaseException):
        raise value
    return value


def call(server: str, fn, args: tuple = (), *, timeout_s: float) -> torch.futures.Future:  # noqa: ANN001
    """Run the server entry point ``fn(*args)`` on ``server`` and return a future of its answer:
    over RPC, or in this process when the server is held here (an ``async_execution`` entry
    point's own future is returned as it is; an error comes back through the future either way)."""
    if server not in _HERE:
        import torch.distributed.rpc as rpc

        return rpc.rpc_async(server, fn, args=args, timeout=timeout_s).then(raise_error_answer)
    try:
        out = fn(*args)
    except Exception as e:  # noqa: BLE001 - delivered through the future, as RPC does
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_exception(e)
        return fut
    if isinstance(out, torch._C.Future):  # Future.then() gives the C++ class
        return out
    fut = torch.futures.Future()
    fut.set_result(out)
    return fut


class LocalTransport(Transport):
    """Step messages to the server held by this process: encoded and decoded as over RPC (the
    same checks; the server owns what it keeps), handled by the same ``handle_step``."""

    what = "this process"
    shares_memory = True

    def __init__(self, server: str) -> None:
        super().__init__()
        self.server = server

    def deliver(self, msg: StepMessage) -> ReplyFuture:
        from hybrid.ps import protocol
        from hybrid.ps.server import service

        frame = protocol.encode(msg)
        return service.rpc_step(frame.ints, [t.clone() for t in frame.tensors])


def connect(server: str, trainer: int, *, mode: str, timeout_s: float) -> Transport:
    """The transport to ``server``: in this process when it is held here (:func:`serve_here`);
    with ``mode`` ``auto``, shared memory where the server shares this host and the channel could
    be set up, else a TCP step connection (:mod:`hybrid.ps.transport.tcp`); with ``socket``,
    that connection whatever the host; RPC where neither could be made, and with ``rpc``. Logs
    which, once."""
    transport = _open(server, trainer, mode=mode, timeout_s=timeout_s)
    logger.info("trainer %d: step messages to %s go through %s", trainer, server, transport.what)
    return transport


def _open(server: str, trainer: int, *, mode: str, timeout_s: float) -> Transport:
    from hybrid.ps.transport.rpc import RpcTransport

    if server in _HERE:
        return LocalTransport(server)
    rpc_transport = RpcTransport(server, timeout_s=timeout_s)
    if mode == "rpc":
        return rpc_transport
    from hybrid.ps.transport.shm import ShmTransport
    from hybrid.ps.transport.tcp import SocketTransport

    here = ShmTransport.open(server, trainer, fallback=rpc_transport, timeout_s=timeout_s) if mode == "auto" else None
    return (here or SocketTransport.open(server, trainer, fallback=rpc_transport, timeout_s=timeout_s)
            or rpc_transport)
