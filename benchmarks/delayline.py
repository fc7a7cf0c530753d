"""The emulated network's switch when its links have a delay: one process that holds every frame.

``python -m benchmarks.delayline --ports h0,h1,... --delay-us 50 --control-fd N`` runs inside the
switch's network namespace (:class:`benchmarks.network.EmulatedNetwork` starts it). Port ``hI`` is
the switch's end of host ``I``'s link; a frame for the MAC address
:func:`benchmarks.network.host_mac` ``(I)`` leaves through it. Every frame leaves ``delay`` after
the kernel received it on its way in (the receive timestamp, ``SO_TIMESTAMPNS``), so the switch's
own time to wake up and read a frame is part of the delay rather than added to it.

The kernel's ``netem`` qdisc is what usually delays packets; a kernel built without it (this
project's machines) has no qdisc that can hold a packet for a time, so the frames pass through
this process instead. It reads and writes whole segmentation-offload frames (``PACKET_VNET_HDR``:
up to 64 KiB of TCP payload a frame), so its cost grows with the messages, not with the bytes'
1,500-byte packets. Rate shaping stays in the kernel (``tbf`` on both ends of every link).

Its CPU comes out of the cores the emulated hosts share, which a real switch's does not, so the
frames pass through native code (``torch.classes.hybrid_bench.DelayLine``,
``benchmarks/csrc/delayline.cpp``, built at install as ``benchmarks._C``): one ``recvmsg`` and one
``send`` a frame, waits in ``ppoll``. This module opens the ports, takes the signals and writes the
snapshots.

The process runs at real-time priority where it may (``SCHED_FIFO``), as a switch's hardware runs
beside the hosts' CPUs rather than after them; it asks to wake ahead of the next frame's time by
its measured lateness at waking. ``--control-fd`` is the read end of a pipe whose write end only
the benchmark holds: each byte written asks for a snapshot, one JSON line on stdout of what
happened since the last (frames and bytes forwarded, frames lost -- no port for them, or a port
down --, CPU seconds, and
``held_us``: percentiles of how long frames stayed between their arrival and their send, the
delay the links really had); end of file (the benchmark gone, however it ended), SIGTERM or
SIGINT end the process.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
import time

from benchmarks.network import host_mac

SOL_PACKET = 263
PACKET_VNET_HDR = 15  # frames carry a virtio_net_hdr: whole offload segments, checksums left to do
PACKET_IGNORE_OUTGOING = 23  # a port's socket does not see the frames this process sends through it
SO_RCVBUFFORCE, SO_SNDBUFFORCE, SO_TIMESTAMPNS = 33, 32, 35
ETH_P_ALL = 0x0003
BUFFER = 64 << 20  # each port's socket buffers: 50 ms at 10 Gbit/s, so a frame is never dropped for room


class _Stopped(Exception):
    """SIGTERM or SIGINT: the delay line ends."""


def summary(counters, cpu_s: float) -> dict:
    """A snapshot's JSON: ``counters`` from ``DelayLine.take()`` (frames, bytes, dropped, lead in
    ns, then how many frames stayed each whole microsecond, up to 100 ms) and this process's CPU
    seconds since the last snapshot."""
    c = counters.tolist()
    frames, held = c[0], c[4:]
    return {"frames": frames, "bytes": c[1], "dropped": c[2], "cpu_s": round(cpu_s, 3),
            "held_us": percentiles(held, frames, {"p10": 0.1, "p50": 0.5, "p90": 0.9, "p99": 0.99}),
            "lead_us": round(c[3] / 1e3, 1)}


def percentiles(held: list[int], frames: int, qs: dict[str, float]) -> dict[str, int | None]:
    """Each named quantile of how long frames stayed (``held[us]``: frames that stayed ``us``
    microseconds), in one walk over the counts; None without frames."""
    out: dict[str, int | None] = {name: None for name in qs}
    todo = sorted(qs.items(), key=lambda item: item[1])
    seen = 0
    for us, c in enumerate(held):
        seen += c
        while todo and seen and seen >= todo[0][1] * frames:
            out[todo.pop(0)[0]] = us
        if not todo:
            break
    return out


def open_port(name: str) -> socket.socket:
    """A raw socket on interface ``name`` that reads and writes whole offload frames with their
    receive time."""
    s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
    s.setsockopt(SOL_PACKET, PACKET_VNET_HDR, 1)
    s.setsockopt(SOL_PACKET, PACKET_IGNORE_OUTGOING, 1)
    s.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, BUFFER)
    s.setsockopt(socket.SOL_SOCKET, SO_SNDBUFFORCE, BUFFER)
    s.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
    s.bind((name, 0))
    return s


def run(ports: list[str], delay_s: float, control_fd: int, report) -> None:
    """Forward frames between ``ports`` (port ``i`` for :func:`host_mac` ``(i)``), each ``delay_s``
    after it arrived, until ``control_fd`` reaches end of file or SIGTERM/SIGINT. Every byte read
    from ``control_fd`` asks for a snapshot: ``report(dict)`` gets what happened since the last
    one (:func:`summary`). ``report("ready")`` comes once every port is open. The frames pass
    through ``torch.classes.hybrid_bench.DelayLine`` (``benchmarks/csrc/delayline.cpp``)."""
    socks = [open_port(p) for p in ports]
    macs = [int.from_bytes(host_mac(i, raw=True), "big") for i in range(len(socks))]
    line = _native().DelayLine([s.fileno() for s in socks], macs, delay_s)
    cpu0 = time.process_time()

    def _stop(*_):
        raise _Stopped

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    report("ready")
    try:
        while True:
            if line.run(control_fd) != 1:
                continue  # a signal: its handler has run (and raised, for SIGTERM and SIGINT)
            asks = os.read(control_fd, 4096)
            if not asks:
                return
            for _ in asks:
                cpu = time.process_time()
                report(summary(line.take(), cpu - cpu0))
                cpu0 = cpu
    except _Stopped:
        return


def _native():
    """``torch.classes.hybrid_bench``, which ``benchmarks._C`` registers (built at install, as
    ``hybrid._C``; :class:`benchmarks.network.EmulatedNetwork` checks it loads before it starts
    this process)."""
    import torch

    import benchmarks._C  # noqa: F401
    return torch.classes.hybrid_bench


def _realtime() -> None:
    """Run at the lowest real-time priority where allowed (root), else as is."""
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
    except (OSError, AttributeError):
        pass
    try:
        with open("/proc/self/timerslack_ns", "w") as f:  # wake within a microsecond of the time asked
            f.write("1000")
    except OSError:
        pass


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.delayline", description=__doc__.split("\n")[0])
    p.add_argument("--ports", required=True, help="the switch's ports, host 0's first: h0,h1,...")
    p.add_argument("--delay-us", type=float, required=True)
    p.add_argument("--control-fd", type=int, required=True,
                   help="a pipe's read end: each byte asks for a snapshot, end of file ends the delay line")
    args = p.parse_args(argv)
    _realtime()

    def report(what) -> None:
        print(what if isinstance(what, str) else json.dumps(what), flush=True)

    run(args.ports.split(","), args.delay_us * 1e-6, args.control_fd, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
