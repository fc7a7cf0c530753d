"""Where a job listens: every socket on ``runtime.address`` (127.0.0.1 by default; ::1, 127.0.0.2
or any address of this machine work too).

- torchrun's stores (rendezvous, and the one it shares with the workers): :mod:`hybrid.launch.torchrun`
  builds them on sockets bound to the address, and ``--local-addr`` makes it the workers'
  ``MASTER_ADDR``, so they dial it too;
- RPC: TensorPipe's ``uv`` (TCP) transport picks its address from an interface name or the
  hostname only; :func:`rpc_transports` names ``hybrid_uv`` instead, the same transport listening
  on ``$HYBRID_RPC_ADDRESS`` (``hybrid/launch/csrc/rpc_transport.cpp``, part of ``hybrid._C``);
- the trainers' gloo group: :func:`gloo_on` gives it a device made for the address.

An address that cannot be used is a :class:`~hybrid.plan.PlanError` naming ``runtime.address``,
raised by :func:`check_address` before any process starts.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator, Sequence

from hybrid.errors import PlanError

KEY = "runtime.address"
RPC_ADDRESS_ENV = "HYBRID_RPC_ADDRESS"
"""Read by the ``hybrid_uv`` transport when the RPC agent starts."""
BOUND_TRANSPORT = "hybrid_uv"


def numeric_address(address: str) -> str:
    """``address`` as a numeric IP (a hostname such as ``localhost`` resolved); raises PlanError."""
    try:
        infos = socket.getaddrinfo(address, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as e:
        raise PlanError(f"{address!r} is not an IP address or a hostname this machine resolves ({e}); use "
                        f"127.0.0.1 (this machine only), ::1, or an address of this machine", category="bad_value",
                        key=KEY) from None
    return str(infos[0][4][0])


def check_address(address: str) -> None:
    """Raise PlanError (naming ``runtime.address``) unless a TCP socket can listen on ``address``."""
    ip = numeric_address(address)
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind((ip, 0))
    except OSError as e:
        raise PlanError(f"cannot listen on {address} ({e.strerror}): it is not an address of this machine; use "
                        f"127.0.0.1 (this machine only), ::1, or the address of one of its network interfaces "
                        f"(`ip addr`)", category="bad_value", key=KEY) from None


def rpc_transports(address: str, transports: Sequence[str]) -> list[str]:
    """The TensorPipe transports to name in the RPC options so that RPC listens on ``address``.

    ``uv`` becomes ``hybrid_uv`` (bound to the address). Without ``hybrid._C``, ``uv`` stays and
    listens on the first address of the interface that holds ``address`` (``TP_SOCKET_IFNAME``);
    an address that is not such a first address is then refused.
    """
    ip = numeric_address(address)
    os.environ[RPC_ADDRESS_ENV] = ip
    ifname = _interface_of(ip)
    if ifname:  # groups torch creates on its own (not the trainers' one) listen there too
        os.environ.setdefault("GLOO_SOCKET_IFNAME", ifname)
    if "uv" not in transports:
        return list(transports)
    if _bound_transport_registered():
        return [BOUND_TRANSPORT if t == "uv" else t for t in transports]
    if ifname is None:
        raise PlanError(f"RPC can listen on {address} only through hybrid._C's transport, which is not built; "
                        f"build it with `make env` (pip install --no-build-isolation -e .) or use 127.0.0.1",
                        category="bad_value", key=KEY)
    os.environ["TP_SOCKET_IFNAME"] = ifname
    return list(transports)


@contextlib.contextmanager
def gloo_on(address: str) -> Iterator[None]:
    """Within the block, the gloo groups ``torch.distributed`` creates listen on ``address``.

    ``init_process_group`` takes no gloo options (torch 2.13 ignores ``pg_options`` for gloo), and
    gloo's default device binds the hostname's address or an interface's first one; the group is
    therefore built with a device made for ``address`` (``ProcessGroupGloo.create_device``).
    """
    from torch.distributed import distributed_c10d as c10d

    real = c10d.ProcessGroupGloo
    ip = numeric_address(address)

    class ProcessGroupGloo(real):  # a subclass: torch checks isinstance(..., ProcessGroupGloo) in there
        def __init__(self, store, rank, size, timeout):  # noqa: ANN001 - the arguments torch passes
            options = real._Options()
            options._devices = [real.create_device(hostname=ip)]
            options._timeout = timeout
            super().__init__(store, rank, size, options)

    c10d.ProcessGroupGloo = ProcessGroupGloo
    try:
        yield
    finally:
        c10d.ProcessGroupGloo = real


def _bound_transport_registered() -> bool:
    import torch.distributed.rpc as rpc

    try:
        import hybrid._C  # noqa: F401 - loading it registers the transport
        rpc.TensorPipeRpcBackendOptions(_transports=[BOUND_TRANSPORT])  # checks the transport registry
    except (ImportError, RuntimeError):
        return False
    return True


def _interface_of(ip: str) -> str | None:
    """The interface whose (first) IPv4 address is ``ip``; None for IPv6 or another address."""
    if ":" in ip:
        return None
    try:
        import fcntl
        import struct

        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            for _, name in socket.if_nameindex():
                try:
                    packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))  # SIOCGIFADDR
                except OSError:
                    continue
                if socket.inet_ntoa(packed[20:24]) == ip:
                    return name
    except OSError:
        return None
    return None


def link_down(address: str | None = None) -> str | None:
    """A line saying that the network interface holding ``address`` (default: this process's RPC
    address, ``runtime.address``) is down or has lost its carrier; None while it is up (or the
    address is not on an interface: IPv6, or RPC not started).

    Without its interface the host has no route to its peers, and a new RPC connection then ends
    the process: TensorPipe's TCP transport throws from its event loop when ``connect`` fails at
    once ("network is unreachable"), which aborts (SIGABRT, "terminate called ..."). The pings of
    a waiting or failing process open such connections, so they ask this first."""
    try:
        ip = numeric_address(address) if address else os.environ.get(RPC_ADDRESS_ENV)
    except PlanError:
        return None
    name = _interface_of(ip) if ip else None
    if name is None:
        return None
    try:
        import fcntl
        import struct

        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            packed = fcntl.ioctl(s.fileno(), 0x8913, struct.pack("256s", name[:15].encode()))  # SIOCGIFFLAGS
    except OSError:
        return None
    flags = struct.unpack("H", packed[16:18])[0]
    if not flags & 0x1:  # IFF_UP
        return f"this host's network interface {name} (runtime.address {ip}) is down"
    if not flags & 0x40:  # IFF_RUNNING
        return f"this host's network interface {name} (runtime.address {ip}) has lost its link (no carrier)"
    return None
