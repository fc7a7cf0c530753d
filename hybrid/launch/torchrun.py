"""torchrun, with every store it starts listening on one address only (loopback by default).

torch's ``TCPStore`` server has no bind-address option: the rendezvous store of torchrun's agent
(and the store it shares with the workers) listen on all interfaces. But ``TCPStore`` accepts an
already-listening socket (``master_listen_fd``). ``python -m hybrid.launch.torchrun --address A
TORCHRUN_ARGS...`` runs torchrun in this process with the stores it hosts built on sockets bound
to ``A``. Workers connect as clients and listen only on their own RPC and gloo sockets (bound
to the same address by :func:`hybrid.launch.init.init_hybrid`).
"""

from __future__ import annotations

import socket
import sys

import torch.distributed as dist

_Real = dist.TCPStore
_SOCKETS: list[socket.socket] = []  # kept open for the life of the stores


def bound_socket(address: str, port: int) -> socket.socket:
    """A listening TCP socket on ``address:port`` (``port`` 0: one the OS picks)."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    s = socket.socket(family, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((address, port))
    s.listen(2048)
    _SOCKETS.append(s)
    return s


def bound_store_class(address: str) -> type:
    """A ``TCPStore`` whose server side listens on ``address`` only."""

    class BoundTCPStore(_Real):  # type: ignore[misc, valid-type]
        def __init__(self, host_name: str, port: int, world_size: int | None = None, is_master: bool = False,
                     *args, **kwargs) -> None:
            if is_master and kwargs.get("master_listen_fd") is None and not args:
                kwargs["master_listen_fd"] = bound_socket(address, int(port)).fileno()
            super().__init__(host_name, port, world_size, is_master, *args, **kwargs)

    BoundTCPStore.__name__ = BoundTCPStore.__qualname__ = "TCPStore"
    return BoundTCPStore


def install(address: str) -> None:
    """Make every ``TCPStore`` torchrun creates in this process listen on ``address``."""
    from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend, static_tcp_rendezvous

    cls = bound_store_class(address)
    dist.TCPStore = cls
    c10d_rendezvous_backend.TCPStore = cls
    static_tcp_rendezvous.TCPStore = cls


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    address = "127.0.0.1"
    if argv[:1] == ["--address"]:
        address, argv = argv[1], argv[2:]
    install(address)
    from torch.distributed.run import main as torchrun_main

    torchrun_main(argv)


if __name__ == "__main__":
    main()
