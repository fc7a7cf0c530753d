"""``--network emulated[:rate=10gbit,delay=50us]``: every process of a system on a host of its own.

On one machine every system's processes talk over loopback, where a byte costs next to nothing
and same-host shortcuts (TensorPipe's shared-memory transport and cross-memory-attach channel,
hybrid's shared-memory channel) carry what crosses a network between real hosts. Under
:class:`EmulatedNetwork` each process runs as a host of its own:

- its own network namespace, with one interface ``eth0`` at ``192.0.2.<host + 1>/24`` (TEST-NET-1,
  a documentation range), MAC address :func:`host_mac`, every other host's address resolved
  statically (no ARP, no IPv6) and no route anywhere else;
- its own hostname (UTS namespace), System V IPC (IPC namespace), an empty private ``/dev/shm``
  and its own ``/proc/sys/kernel/random/boot_id`` (mount namespace): hybrid's same-host test
  (hostname and boot id) and TensorPipe's (boot id) see different hosts, as between machines;
- ``eth0`` is one end of a veth pair whose other end is port ``h<host>`` of the switch, in a
  namespace of its own; every link is shaped by ``tc`` in both directions to ``rate`` (``tbf``).
  Without a delay the switch is the kernel's bridge. With one it is a delay line
  (:mod:`benchmarks.delayline`): a process that sends each frame on to its host ``delay`` after
  it arrived, so one way between two hosts takes ``delay`` plus the bytes at ``rate``.

A process learns its address from ``BENCH_HOST_ADDRESS``; ``GLOO_SOCKET_IFNAME`` and
``TP_SOCKET_IFNAME`` name ``eth0`` for gloo and TensorPipe. The job's rendezvous (file stores)
and the benchmark's result files still go through the shared file system; every byte of a
training step crosses the emulated links.

Everything is created inside namespaces named ``hbnet<pid>-*`` (the benchmark's process id) and
removed by :meth:`EmulatedNetwork.close` (the namespaces take their links with them); a later
run removes what a killed one (its process gone) left behind, processes included. Needs root,
``ip``, ``tc``, ``unshare``, ``mount`` and ``hostname``.
"""

from __future__ import annotations

import json
import os
import re
import select
import shlex
import shutil
import subprocess
import sys
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from benchmarks.launch import HostServer

PREFIX = "hbnet"
"""Every namespace this module creates is named ``hbnet<pid>-...``."""
SUBNET = "192.0.2"
"""TEST-NET-1 (RFC 5737): addresses that belong to no real network."""
IFNAME = "eth0"
"""Every host's one interface."""
ADDRESS_ENV = "BENCH_HOST_ADDRESS"
"""Set in every process of an emulated host: its address (``runtime.address`` for hybrid)."""
TOOLS = ("ip", "tc", "unshare", "mount", "hostname")

START_TIMEOUT_S = 30.0
"""How long the delay line may take to open its ports."""

_RATE_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}
_DELAY_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0}


def host_mac(i: int, *, raw: bool = False) -> str | bytes:
    """Host ``i``'s MAC address (locally administered ``02:00:00:00:HH:LL``), as text or 6 bytes."""
    b = bytes([2, 0, 0, 0, (i + 1) >> 8, (i + 1) & 0xFF])
    return b if raw else ":".join(f"{x:02x}" for x in b)


class NetworkError(RuntimeError):
    """The emulated network cannot be set up here (one line: what is missing and what to do)."""


@dataclass(kw_only=True, frozen=True)
class NetworkSpec:
    """Every link of the emulated network."""

    rate_bit_s: int = 10 * 10**9
    """Bits per second each way on every host's link (``rate=10gbit``)."""
    delay_s: float = 50e-6
    """One-way delay added to every frame between two hosts (``delay=50us``; 0: none)."""

    def describe(self) -> dict:
        return {"kind": "emulated", "rate_bit_s": self.rate_bit_s, "delay_us": round(self.delay_s * 1e6, 3)}


def parse_network(text: str) -> NetworkSpec | None:
    """``loopback`` -> None; ``emulated[:rate=R,delay=D]`` -> its spec. Raises ValueError naming
    the bad part and what is allowed."""
    kind, _, opts = text.partition(":")
    if kind == "loopback" and not opts:
        return None
    if kind != "emulated":
        raise ValueError(f"--network: got {text!r}; expected loopback or emulated[:rate=10gbit,delay=50us]")
    values = {}
    for item in filter(None, opts.split(",")):
        key, eq, value = item.partition("=")
        if key == "rate" and eq:
            values["rate_bit_s"] = _parse_rate(value)
        elif key == "delay" and eq:
            values["delay_s"] = _parse_delay(value)
        else:
            raise ValueError(f"--network: unknown option {item!r} in {text!r}; expected rate=<n>{{bit,kbit,mbit,gbit}} "
                             f"and delay=<n>{{us,ms,s}}")
    return NetworkSpec(**values)


def _parse_rate(value: str) -> int:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgt]?bit)", value.lower())
    rate = int(float(m.group(1)) * _RATE_UNITS[m.group(2)]) if m else 0
    if not 10**5 <= rate <= 10**12:
        raise ValueError(f"--network: rate={value!r}; expected a rate from 100kbit to 1tbit such as 10gbit or 100mbit")
    return rate


def _parse_delay(value: str) -> float:
    if value == "0":
        return 0.0
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(us|ms|s)", value.lower())
    delay = float(m.group(1)) * _DELAY_UNITS[m.group(2)] if m else -1.0
    if not 0 <= delay <= 1.0:
        raise ValueError(f"--network: delay={value!r}; expected 0 or a delay up to 1s such as 50us or 1ms")
    return delay


class EmulatedNetwork:
    """``hosts`` emulated hosts on one switch (see the module's docstring); a context manager.

    :meth:`executable` is what starts a process on host ``i`` (``multiprocessing``'s executable);
    :meth:`server` is the process that forks every process run there
    (:func:`benchmarks.launch.spawn`).
    """

    def __init__(self, spec: NetworkSpec, hosts: int) -> None:
        self.spec = spec
        self.hosts = hosts
        self.name = f"{PREFIX}{os.getpid()}"
        self.switch = f"{self.name}-sw"
        self.namespaces: list[str] = []
        self.workdir: Path | None = None
        self.servers: dict[int, HostServer] = {}
        self.delay_line: subprocess.Popen | None = None
        self._delay_line_control: int | None = None

    def host_namespace(self, i: int) -> str:
        return f"{self.name}-h{i}"

    def address(self, i: int) -> str:
        return f"{SUBNET}.{i + 1}"

    def describe(self) -> dict:
        return {**self.spec.describe(), "hosts": self.hosts}

    def __enter__(self) -> EmulatedNetwork:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> None:
        """Create the switch, the hosts, their links and the shaping; everything made so far is
        removed again if a step fails (:class:`NetworkError`)."""
        check_requirements()
        remove_stale()
        try:
            self.workdir = Path(tempfile.mkdtemp(prefix=f"{self.name}-"))
            self._add_namespace(self.switch)
            if self.spec.delay_s == 0:
                _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
                _ip("-n", self.switch, "link", "set", "br0", "up")
            for i in range(self.hosts):
                self._add_host(i)
            for i in range(self.hosts):
                for j in range(self.hosts):
                    if i != j:
                        _ip("-n", self.host_namespace(i), "neigh", "add", self.address(j), "lladdr", host_mac(j),
                            "dev", IFNAME, "nud", "permanent")
            if self.spec.delay_s > 0:
                self._start_delay_line()
        except BaseException:
            self.close()
            raise

    def _add_namespace(self, name: str) -> None:
        _ip("netns", "add", name)
        self.namespaces.append(name)
        _ip("-n", name, "link", "set", "lo", "up")

    def _add_host(self, i: int) -> None:
        ns, port = self.host_namespace(i), f"h{i}"
        self._add_namespace(ns)
        _ip("-n", self.switch, "link", "add", port, "type", "veth", "peer", "name", IFNAME, "netns", ns)
        if self.spec.delay_s == 0:
            _ip("-n", self.switch, "link", "set", port, "master", "br0")
        _ip("-n", self.switch, "link", "set", port, "up")
        # Only IPv4 crosses the links: no IPv6 neighbour discovery or multicast to flood (a
        # kernel without IPv6 has none to turn off).
        for dev_ns, dev in ((ns, IFNAME), (self.switch, port)):
            subprocess.run(["ip", "netns", "exec", dev_ns, "sh", "-c",
                            f"echo 1 > /proc/sys/net/ipv6/conf/{dev}/disable_ipv6"], capture_output=True)
        _ip("-n", ns, "link", "set", IFNAME, "address", host_mac(i))
        _ip("-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", IFNAME)
        _ip("-n", ns, "link", "set", IFNAME, "up")
        self._shape(ns, IFNAME)  # what the host sends
        self._shape(self.switch, port)  # what the host receives
        (self.workdir / f"h{i}.boot_id").write_text(f"{uuid.uuid4()}\n")

    def _shape(self, ns: str, dev: str) -> None:
        # tbf: a bucket of 100 us at the rate (at least 16 KiB), a queue of 10 ms.
        rate = self.spec.rate_bit_s
        burst = max(16384, int(rate / 8 * 1e-4))
        _tc(ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{rate}bit", "burst", str(burst),
            "latency", "10ms")

    def _start_delay_line(self) -> None:
        """Start :mod:`benchmarks.delayline` in the switch's namespace on every port and wait until
        it has opened them. Its control pipe's write end is this process's alone, so the delay
        line ends with this process, however that ends."""
        try:
            import torch  # noqa: F401  (first: it loads the libraries the extension links to)

            import benchmarks._C  # noqa: F401  (the delay line's native loop)
        except ImportError as e:
            raise NetworkError(f"a delay needs benchmarks._C, which does not load ({e}): build it with `make env` "
                               f"(or `python setup.py build_ext --inplace`), or run with delay=0") from e
        read_end, self._delay_line_control = os.pipe()
        repo = str(Path(__file__).resolve().parent.parent)
        cmd = ["ip", "netns", "exec", self.switch, sys.executable, "-m", "benchmarks.delayline",
               "--ports", ",".join(f"h{i}" for i in range(self.hosts)), "--delay-us", f"{self.spec.delay_s * 1e6:g}",
               "--control-fd", str(read_end)]
        try:
            self.delay_line = subprocess.Popen(cmd, cwd=repo, pass_fds=(read_end,), stdout=subprocess.PIPE,
                                               stderr=subprocess.PIPE, text=True,
                                               env={**os.environ, "PYTHONPATH": repo})
        finally:
            os.close(read_end)
        if self._delay_line_says() != "ready":
            self.delay_line.kill()
            err = self.delay_line.communicate()[1].strip().splitlines()
            raise NetworkError(f"the delay line did not start within {START_TIMEOUT_S:.0f}s"
                               + (f": {err[-1]}" if err else ""))

    def _delay_line_says(self) -> str:
        """The delay line's next line on stdout ("" if none within START_TIMEOUT_S)."""
        ready, _, _ = select.select([self.delay_line.stdout], [], [], START_TIMEOUT_S)
        return self.delay_line.stdout.readline().strip() if ready else ""

    def delay_line_snapshot(self) -> dict | None:
        """What the delay line did since the last snapshot (or its start): ``frames`` and ``bytes``
        forwarded, ``dropped``, its ``cpu_s``, and ``held_us`` percentiles (p10, p50, p90, p99) of
        how long frames stayed in it; None without a delay line."""
        if self.delay_line is None or self.delay_line.poll() is not None:
            return None
        os.write(self._delay_line_control, b"s")
        line = self._delay_line_says()
        return json.loads(line) if line else None

    def _stop_delay_line(self) -> None:
        """End the delay line (closing its control pipe)."""
        if self._delay_line_control is not None:
            os.close(self._delay_line_control)
            self._delay_line_control = None
        if self.delay_line is None:
            return
        try:
            self.delay_line.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            self.delay_line.kill()
            self.delay_line.communicate()
        self.delay_line = None

    def executable(self, i: int) -> str:
        """A script that runs its arguments with this Python on host ``i`` (a fresh UTS, IPC and
        mount namespace inside the host's network namespace, with the host's name, boot id and
        an empty ``/dev/shm``)."""
        assert self.workdir is not None, "start() the network first"
        path = self.workdir / f"h{i}.sh"
        if not path.exists():
            inner = (f"hostname {self.host_namespace(i)} && mount -t tmpfs -o mode=1777 tmpfs /dev/shm && "
                     f"mount --bind {shlex.quote(str(self.workdir / f'h{i}.boot_id'))} /proc/sys/kernel/random/boot_id "
                     f'&& exec "$@"')
            env = [f"{ADDRESS_ENV}={self.address(i)}", f"GLOO_SOCKET_IFNAME={IFNAME}", f"TP_SOCKET_IFNAME={IFNAME}"]
            cmd = ["ip", "netns", "exec", self.host_namespace(i), "unshare", "--uts", "--ipc", "--mount",
                   "--propagation", "private", "--", "sh", "-c", inner, "host", "env", *env, sys.executable]
            path.write_text("#!/bin/sh\nexec " + " ".join(shlex.quote(c) for c in cmd) + ' "$@"\n')
            path.chmod(0o700)
        return str(path)

    def server(self, i: int) -> HostServer:
        """The process on host ``i`` that forks the processes run there, started on first use."""
        from benchmarks.launch import HostServer

        if i not in self.servers:
            self.servers[i] = HostServer(self.executable(i))
        return self.servers[i]

    def close(self) -> None:
        """Stop the hosts' servers (and what they forked), remove every namespace (and with them
        every link) and the scripts; idempotent."""
        for server in self.servers.values():
            server.stop()
        self.servers = {}
        self._stop_delay_line()
        for ns in reversed(self.namespaces):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self.namespaces = []
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.workdir = None


def check_requirements() -> None:
    """Raise NetworkError unless this process may create namespaces and has the tools."""
    if os.geteuid() != 0:
        raise NetworkError("--network emulated needs root (it creates network namespaces, veth links and tc "
                           "qdiscs); run it as root or use --network loopback")
    missing = [t for t in TOOLS if shutil.which(t) is None]
    if missing:
        raise NetworkError(f"--network emulated needs {', '.join(missing)} (iproute2, util-linux) on PATH; "
                           f"install them or use --network loopback")


def namespaces() -> list[str]:
    """The network namespaces ``ip netns`` lists."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def of_process(pid: int) -> list[str]:
    """The namespaces of the emulated network made by process ``pid``."""
    return [ns for ns in namespaces() if ns.startswith(f"{PREFIX}{pid}-")]


def stale() -> list[str]:
    """The namespaces of emulated networks whose benchmark process is gone (what a killed run
    left; another run's live network is not among them)."""
    return [ns for ns in namespaces() if _left_behind(ns)]


def _left_behind(name: str) -> bool:
    """Whether ``name`` (a namespace, a script folder) is an emulated network's whose benchmark
    process is gone."""
    m = re.fullmatch(rf"{PREFIX}(\d+)-\w+", name)
    return m is not None and not _alive(int(m.group(1)))


def remove_stale() -> None:
    """Remove the namespaces of emulated networks whose benchmark process is gone (killing what
    still runs in them), and their hosts' script folders in the temp folder."""
    for ns in stale():
        pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
        for pid in pids:
            try:
                os.kill(int(pid), 9)
            except (ProcessLookupError, ValueError):
                pass
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    for folder in Path(tempfile.gettempdir()).glob(f"{PREFIX}*-*"):
        if folder.is_dir() and _left_behind(folder.name):
            shutil.rmtree(folder, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _ip(*args: str) -> None:
    res = subprocess.run(["ip", *args], capture_output=True, text=True)
    if res.returncode != 0:
        raise NetworkError(f"`ip {' '.join(args)}` failed: {res.stderr.strip()}")


def _tc(ns: str, *args: str) -> None:
    res = subprocess.run(["tc", "-n", ns, *args], capture_output=True, text=True)
    if res.returncode == 0:
        return
    if "unknown" in res.stderr.lower() and "qdisc" in res.stderr.lower():
        raise NetworkError(f"this kernel has no tbf qdisc, so the emulated links cannot be shaped to the rate; "
                           f"use a kernel with CONFIG_NET_SCH_TBF or --network loopback")
    raise NetworkError(f"`tc -n {ns} {' '.join(args)}` failed: {res.stderr.strip()}")
