"""How a trainer's step messages reach a parameter server: one interface, two implementations.

A :class:`Transport` sends one :class:`hybrid.ps.protocol.StepMessage` to one server and returns
a future of the reply (one tensor of rows per part). RPC (TensorPipe) is the transport that
works everywhere and the control plane for everything else (creating tables, checkpoints,
evaluation reads, counters). Between processes of one host, :class:`~hybrid.ps.transport.shm.ShmTransport`
carries the same frames through shared memory and falls back to RPC for what it cannot carry.
:func:`connect` picks one per server (``runtime.ps_transport``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Literal, Protocol

import torch

from hybrid.ps.protocol import StepMessage

TransportName = Literal["auto", "rpc"]
TRANSPORTS: tuple[str, ...] = ("auto", "rpc")


class ReplyFuture(Protocol):
    """What :meth:`Transport.send` returns."""

    def wait(self) -> list[torch.Tensor]: ...


class Transport(ABC):
    """One trainer's connection to one parameter server for step messages."""

    server: str
    """The server's RPC worker name (``ps0``), for messages."""

    @abstractmethod
    def send(self, msg: StepMessage) -> ReplyFuture:
        """Send ``msg``; the future yields one tensor per part (empty for a push-only part)."""

    def close(self) -> None:
        """Release what the transport holds (nothing for RPC)."""


def connect(server: str, trainer: int, *, mode: str, timeout_s: float) -> Transport:
    """The transport to ``server``: shared memory where ``mode`` is ``auto`` and the server
    shares this host (and the channel could be set up), else RPC."""
    from hybrid.ps.transport.rpc import RpcTransport

    rpc_transport = RpcTransport(server, timeout_s=timeout_s)
    if mode != "auto":
        return rpc_transport
    from hybrid.ps.transport.shm import ShmTransport

    return ShmTransport.open(server, trainer, fallback=rpc_transport, timeout_s=timeout_s) or rpc_transport
