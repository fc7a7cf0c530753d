"""The emulated network of ``benchmarks.run --network emulated`` (benchmarks/network.py): hosts that
are apart in every way a same-host shortcut checks, links shaped to the rate, and nothing left
behind, with and without a delay line. Needs root and iproute2 (skipped otherwise)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import benchmarks.network as network
from benchmarks.network import EmulatedNetwork, NetworkSpec, namespaces, of_process, remove_stale, stale
from tests.support.network import needs_root, root_links

pytestmark = needs_root
REPO = Path(__file__).resolve().parents[2]

# Host 0 receives N bytes from host 1 over TCP and reports how long they took; each host also
# reports what it sees of itself.
_SELF = """
import json, os, socket, subprocess
print(json.dumps({"hostname": socket.gethostname(), "boot_id": open("/proc/sys/kernel/random/boot_id").read().strip(),
                  "shm": os.listdir("/dev/shm"), "address": os.environ["BENCH_HOST_ADDRESS"],
                  "links": sorted(l.split(":")[1].strip().split("@")[0] for l in subprocess.run(
                      ["ip", "-o", "link"], capture_output=True, text=True).stdout.splitlines()),
                  "routes": subprocess.run(["ip", "route"], capture_output=True, text=True).stdout.strip()}))
"""
_RECEIVE = """
import socket, sys, time
s = socket.create_server(("192.0.2.1", 5001)); print("ready", flush=True)
c, _ = s.accept(); n, t0 = 0, None
while chunk := c.recv(1 << 20):
    t0 = t0 or time.perf_counter(); n += len(chunk)
print(n, time.perf_counter() - t0, flush=True)
"""
_SEND = """
import socket
with socket.create_connection(("192.0.2.1", 5001)) as s:
    s.sendall(bytes(%d))
"""


def _on(net: EmulatedNetwork, host: int, code: str, **kw) -> subprocess.Popen:
    return subprocess.Popen([net.executable(host), "-c", code], stdout=subprocess.PIPE, text=True, **kw)


def test_every_host_is_apart_and_its_link_is_shaped_to_the_rate():
    before_links = root_links()
    spec = NetworkSpec(rate_bit_s=100 * 10**6, delay_s=0.0)
    with EmulatedNetwork(spec, hosts=2) as net:
        seen = []
        for h in range(2):
            out, _ = _on(net, h, _SELF).communicate(timeout=30)
            seen.append(json.loads(out))
        receiver = _on(net, 0, _RECEIVE)
        try:
            assert receiver.stdout.readline().strip() == "ready"
            nbytes = 3_000_000
            sender = _on(net, 1, _SEND % nbytes)
            assert sender.wait(timeout=60) == 0
            got, seconds = receiver.communicate(timeout=60)[0].split()
        finally:
            receiver.kill()
        tc = subprocess.run(["tc", "-n", net.host_namespace(1), "qdisc", "show", "dev", "eth0"],
                            capture_output=True, text=True).stdout
    machine_boot = open("/proc/sys/kernel/random/boot_id").read().strip()
    assert [s["address"] for s in seen] == ["192.0.2.1", "192.0.2.2"]
    assert len({s["hostname"] for s in seen} | {os.uname().nodename}) == 3, seen
    assert len({s["boot_id"] for s in seen} | {machine_boot}) == 3, seen  # TensorPipe's and hybrid's host test
    assert all(s["shm"] == [] for s in seen), seen
    assert all(s["links"] == ["eth0", "lo"] for s in seen), seen
    assert all(s["routes"] == f"192.0.2.0/24 dev eth0 proto kernel scope link src {s['address']}" for s in seen), seen
    assert "tbf" in tc and "rate 100Mbit" in tc, tc
    # 3 MB at 100 Mbit/s take at least 0.24 s (the bucket's 16 KiB pass at once); a loaded
    # machine only makes it slower.
    assert int(got) == nbytes
    assert float(seconds) >= 0.9 * nbytes * 8 / spec.rate_bit_s, seconds
    assert of_process(os.getpid()) == []  # other tests' networks may be up meanwhile
    assert root_links() == before_links


# Host 0 answers every byte host 1 sends with one byte; host 1 times 20 such round trips, then
# sends 1 MB of random bytes that host 0 hashes.
_ECHO = """
import hashlib, socket
s = socket.create_server(("192.0.2.1", 5002)); print("ready", flush=True)
c, _ = s.accept(); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
for _ in range(20):
    c.sendall(c.recv(1))
h, n = hashlib.sha256(), 0
while chunk := c.recv(1 << 20):
    h.update(chunk); n += len(chunk)
print(n, h.hexdigest(), flush=True)
"""
_PING = """
import hashlib, json, os, socket, time
c = socket.create_connection(("192.0.2.1", 5002)); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
rtts = []
for _ in range(20):
    t = time.perf_counter(); c.sendall(b"x"); c.recv(1); rtts.append(time.perf_counter() - t)
data = os.urandom(1 << 20)
c.sendall(data); c.close()
print(json.dumps({"rtts": rtts, "sha": hashlib.sha256(data).hexdigest()}), flush=True)
"""


def test_a_delay_holds_every_frame_in_the_delay_line_which_ends_with_the_network():
    before_links = root_links()
    net = EmulatedNetwork(NetworkSpec(rate_bit_s=10**9, delay_s=2e-3), hosts=2)
    with net:
        line = net.delay_line
        switch_links = subprocess.run(["ip", "-n", net.switch, "-o", "link"], capture_output=True, text=True).stdout
        echo = _on(net, 0, _ECHO)
        try:
            assert echo.stdout.readline().strip() == "ready"
            ping = json.loads(_on(net, 1, _PING).communicate(timeout=60)[0])
            got, digest = echo.communicate(timeout=60)[0].split()
        finally:
            echo.kill()
        stats = net.delay_line_snapshot()
        assert net.delay_line_snapshot()["frames"] == 0  # a snapshot covers what came since the last
        line.send_signal(signal.SIGTERM)  # idle, waiting for frames: it ends at once all the same
        assert line.wait(timeout=5) == 0
    assert line.poll() is not None  # the delay line ended with the network
    # Two ports and no bridge: every frame goes through the delay line.
    assert "br0" not in switch_links and "h0@" in switch_links and "h1@" in switch_links, switch_links
    # A round trip crosses the switch twice; a lost frame would cost TCP's 200 ms retransmission.
    # (A frame may leave up to half the delay line's lateness at waking early, tens of us.)
    assert 3.9e-3 <= min(ping["rtts"]) <= 0.1, ping["rtts"]
    assert (int(got), digest) == (1 << 20, ping["sha"])  # offload frames arrive whole
    assert stats["dropped"] == 0 and stats["frames"] > 40 and stats["bytes"] > 1 << 20, stats
    assert 1900 <= stats["held_us"]["p10"] <= stats["held_us"]["p50"] <= stats["held_us"]["p90"], stats
    assert of_process(os.getpid()) == []
    assert root_links() == before_links


# Networks these tests leave behind on purpose are named apart (TEST_PREFIX), so that a test
# running meanwhile in another worker, which checks that its benchmark left no stale network,
# neither sees nor removes them.
TEST_PREFIX = "hbtest"

_FRAMES = """
import socket, sys
from benchmarks.network import host_mac
s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW)
s.bind(("eth0", 0))
src = host_mac(0, raw=True)
for dst in (host_mac(1, raw=True), bytes.fromhex("02000000ffff"), host_mac(1, raw=True)):
    s.send(dst + src + bytes.fromhex("88b5") + b"hybrid" * 20)  # the local experimental EtherType
"""


def test_the_delay_line_forwards_frames_by_their_mac_and_counts_one_for_no_port_as_dropped():
    """Raw frames from host 0: two for host 1's MAC address arrive there, whole and held for the
    delay; one for a MAC no port has is dropped and counted."""
    with EmulatedNetwork(NetworkSpec(delay_s=1e-3), hosts=2) as net:
        net.delay_line_snapshot()
        sniff = _on(net, 1, """
import socket, sys
s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x88b5))
s.bind(("eth0", 0)); s.settimeout(20)
print("ready", flush=True)
print(" ".join(str(len(s.recv(4096))) for _ in range(2)), flush=True)
""")
        try:
            assert sniff.stdout.readline().strip() == "ready"
            _on(net, 0, _FRAMES).communicate(timeout=30)
            got = sniff.communicate(timeout=30)[0].split()
        finally:
            sniff.kill()
        stats = net.delay_line_snapshot()
    assert got == ["134", "134"]  # 14 bytes of header and 120 of payload, each
    assert (stats["frames"], stats["dropped"], stats["bytes"]) == (2, 1, 2 * 134), stats
    assert 900 <= stats["held_us"]["p10"] <= stats["held_us"]["p99"] < 100_000, stats


_HOLD_A_NETWORK = f"""
import sys, time
import benchmarks.network as network
from benchmarks.network import EmulatedNetwork, NetworkSpec
network.PREFIX = {TEST_PREFIX!r}
net = EmulatedNetwork(NetworkSpec(delay_s=50e-6), hosts=2); net.start()
print(net.delay_line.pid, flush=True); time.sleep(600)
"""


def test_the_delay_line_ends_when_its_benchmark_is_killed_and_the_next_run_removes_the_rest(monkeypatch):
    monkeypatch.setattr(network, "PREFIX", TEST_PREFIX)
    holder = subprocess.Popen([sys.executable, "-c", _HOLD_A_NETWORK], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        line_pid = int(holder.stdout.readline())
        assert len(of_process(holder.pid)) == 3  # the switch and two hosts
        holder.kill()
        holder.wait(timeout=10)
        deadline = time.monotonic() + 10
        while os.path.exists(f"/proc/{line_pid}") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not os.path.exists(f"/proc/{line_pid}")
        assert sorted(of_process(holder.pid)) == sorted(n for n in stale() if n.startswith(f"{TEST_PREFIX}{holder.pid}-"))
        remove_stale()
        assert of_process(holder.pid) == []
    finally:
        holder.kill()
        for ns in of_process(holder.pid):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def test_a_killed_runs_namespaces_and_folder_are_removed_by_the_next_run(tmp_path, monkeypatch):
    """What a run killed outright left (its namespaces, its hosts' script folder in the temp
    folder) goes when the next network starts; another live run's folder stays."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(network, "PREFIX", TEST_PREFIX)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    stale = f"{TEST_PREFIX}{dead}-sw"
    folder, live = tmp_path / f"{TEST_PREFIX}{dead}-x1y2", tmp_path / f"{TEST_PREFIX}{os.getppid()}-a3b4"
    for f in (folder, live):
        f.mkdir()
        (f / "h0.sh").write_text("")
    subprocess.run(["ip", "netns", "add", stale], check=True)
    try:
        with EmulatedNetwork(NetworkSpec(delay_s=0.0), hosts=1) as net:
            assert stale not in namespaces()
            assert not folder.exists() and live.exists() and net.workdir.parent == tmp_path
    finally:
        subprocess.run(["ip", "netns", "del", stale], capture_output=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == [live.name]
