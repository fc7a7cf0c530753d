"""The emulated network's switch when its links have a delay: one process that holds every frame.

``python -m benchmarks.delayline --ports h0,h1,... --delay-us 50 --parent-fd N --stats PATH`` runs
inside the switch's network namespace (:class:`benchmarks.network.EmulatedNetwork` starts it). Port
``hI`` is the switch's end of host ``I``'s link; a frame for the MAC address
:func:`benchmarks.network.host_mac` ``(I)`` leaves through it. Every frame leaves ``delay`` after
the kernel received it on its way in (the receive timestamp, ``SO_TIMESTAMPNS``), so the switch's
own time to wake up and read a frame is part of the delay rather than added to it.

The kernel's ``netem`` qdisc is what usually delays packets; a kernel built without it (this
project's machines) has no qdisc that can hold a packet for a time, so the frames pass through
this process instead. It reads and writes whole segmentation-offload frames (``PACKET_VNET_HDR``:
up to 64 KiB of TCP payload a frame), so its cost grows with the messages, not with the bytes'
1,500-byte packets. Rate shaping stays in the kernel (``tbf`` on both ends of every link).

The process runs at real-time priority where it may (``SCHED_FIFO``), as a switch's hardware runs
beside the hosts' CPUs rather than after them; it wakes up ahead of the next frame's time by its
measured lateness at waking and polls the rest of the way. It ends when ``--parent-fd`` (the read end of a pipe whose write end
only the benchmark holds) reaches end of file, on SIGTERM or SIGINT; it then writes ``--stats``:
frames and bytes forwarded, frames with no port (dropped), how long frames stayed from their
arrival until their send returned (``held_us`` percentiles: the delay the links really had) and
its CPU seconds.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import select
import signal
import socket
import struct
import sys
import time

from benchmarks.network import host_mac

SOL_PACKET = 263
PACKET_VNET_HDR = 15  # frames carry a virtio_net_hdr: whole offload segments, checksums left to do
PACKET_IGNORE_OUTGOING = 23  # a port's socket does not see the frames this process sends through it
SO_RCVBUFFORCE, SO_SNDBUFFORCE, SO_TIMESTAMPNS = 33, 32, 35
ETH_P_ALL = 0x0003
VNET_HDR = 10
FRAME_MAX = VNET_HDR + 14 + 65535 + 64  # the largest offload frame (an IP datagram of 64 KiB)
BUFFER = 64 << 20  # each port's socket buffers: 50 ms at 10 Gbit/s, so a frame is never dropped for room
_HELD_MAX_US = 1_000_000


class _Held:
    """How long frames stayed in the switch: counts by microsecond up to a second."""

    def __init__(self) -> None:
        self.counts = [0] * (_HELD_MAX_US + 1)
        self.n = 0

    def add(self, seconds: float) -> None:
        self.counts[min(_HELD_MAX_US, max(0, round(seconds * 1e6)))] += 1
        self.n += 1

    def percentile(self, q: float) -> int | None:
        if not self.n:
            return None
        want, seen = q * self.n, 0
        for us, c in enumerate(self.counts):
            seen += c
            if seen >= want:
                return us
        return _HELD_MAX_US


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


def _received_at(ancillary: list, default: float) -> float:
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS:
            sec, nsec = struct.unpack("qq", data[:16])
            return sec + nsec * 1e-9
    return default


def run(ports: list[str], delay_s: float, parent_fd: int, ready=None) -> dict:
    """Forward frames between ``ports`` (port ``i`` for :func:`host_mac` ``(i)``), each ``delay_s``
    after it arrived, until ``parent_fd`` reaches end of file or SIGTERM/SIGINT; returns the
    statistics. ``ready()`` is called once every port is open."""
    socks = [open_port(p) for p in ports]
    by_mac = {host_mac(i, raw=True): s for i, s in enumerate(socks)}
    by_fd = {s.fileno(): s for s in socks}
    watch = [parent_fd, *by_fd]
    queue: collections.deque = collections.deque()  # (time to leave, received, socket, frame), in order
    held = _Held()
    frames = nbytes = dropped = 0
    # Waking up takes time (tens of microseconds in a virtual machine): the loop asks to wake
    # `lead` (the measured lateness of waking, a moving average) before the next frame's time;
    # woken before it, it polls (at most about `lead`) until the frame is due.
    lead = 0.0
    stop = False

    def _stop(*_):
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    cpu0 = time.process_time()
    if ready is not None:
        ready()
    while not stop:
        timeout = None
        if queue:
            timeout = max(0.0, queue[0][0] - time.time() - lead)
        asked = time.time() + (timeout or 0.0)
        try:
            readable, _, _ = select.select(watch, [], [], timeout)
        except InterruptedError:
            continue
        now = time.time()
        if not readable and timeout:
            lead += (min(now - asked, 1e-3) - lead) * 0.05
        for fd in readable:
            if fd == parent_fd:
                if not os.read(parent_fd, 4096):
                    stop = True
                continue
            s = by_fd[fd]
            for _ in range(64):
                try:
                    frame, ancillary, flags, _ = s.recvmsg(FRAME_MAX, 64, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    break
                out = by_mac.get(frame[VNET_HDR:VNET_HDR + 6])
                if out is None or flags & socket.MSG_TRUNC:
                    dropped += 1
                    continue
                received = _received_at(ancillary, now)
                queue.append((received + delay_s, received, out, frame))
        now = time.time() + 1e-6
        while queue and queue[0][0] <= now:
            _, received, out, frame = queue.popleft()
            out.send(frame)
            held.add(time.time() - received)
            frames += 1
            nbytes += len(frame) - VNET_HDR
    return {"frames": frames, "bytes": nbytes, "dropped": dropped, "cpu_s": round(time.process_time() - cpu0, 3),
            "held_us": {q: held.percentile(v) for q, v in (("p10", 0.1), ("p50", 0.5), ("p90", 0.9), ("p99", 0.99))},
            "lead_us": round(lead * 1e6, 1)}


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
    p.add_argument("--parent-fd", type=int, required=True)
    p.add_argument("--stats", required=True, help="where to write the statistics (JSON) at the end")
    args = p.parse_args(argv)
    _realtime()
    stats = run(args.ports.split(","), args.delay_us * 1e-6, args.parent_fd,
                ready=lambda: print("ready", flush=True))
    with open(args.stats, "w") as f:
        json.dump(stats, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
