"""Step messages over ``torch.distributed.rpc`` (TensorPipe): works across hosts, and is the
only transport that can carry distributed-autograd lookups."""

from __future__ import annotations

import torch
import torch.distributed.rpc as rpc

from hybrid.ps import protocol
from hybrid.ps.protocol import StepMessage
from hybrid.ps.server import service
from hybrid.ps.transport import Transport, raise_error_answer


class RpcTransport(Transport):
    what = "RPC (TensorPipe)"

    def __init__(self, server: str, *, timeout_s: float) -> None:
        super().__init__()
        self.server = server
        self.timeout_s = timeout_s

    def deliver(self, msg: StepMessage) -> torch.futures.Future:
        frame = protocol.encode(msg)
        return rpc.rpc_async(self.server, service.rpc_step, args=(frame.ints, frame.tensors),
                             timeout=self.timeout_s).then(raise_error_answer)
