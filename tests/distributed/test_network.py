"""The emulated network of ``benchmarks.run --network emulated`` (benchmarks/network.py): hosts that
are apart in every way a same-host shortcut checks, links shaped to the rate, and nothing left
behind. Needs root and iproute2 (skipped otherwise)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

from benchmarks.network import EmulatedNetwork, NetworkError, NetworkSpec, namespaces, of_process
from tests.support.network import needs_root, root_links

pytestmark = needs_root

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


def test_a_delay_is_netem_and_a_kernel_without_it_is_refused_leaving_nothing():
    net = EmulatedNetwork(NetworkSpec(rate_bit_s=10**9, delay_s=50e-6), hosts=2)
    try:
        net.start()
    except NetworkError as e:  # this kernel has no sch_netem
        assert "no netem qdisc" in str(e) and "emulated:delay=0" in str(e), e
    else:
        tc = subprocess.run(["tc", "-n", net.host_namespace(0), "qdisc", "show", "dev", "eth0"],
                            capture_output=True, text=True).stdout
        assert "netem" in tc and "delay 50us" in tc and "rate 1Gbit" in tc, tc
    finally:
        net.close()
    assert of_process(os.getpid()) == []


def test_a_killed_runs_namespaces_and_folder_are_removed_by_the_next_run(tmp_path, monkeypatch):
    """What a run killed outright left (its namespaces, its hosts' script folder in the temp
    folder) goes when the next network starts; another live run's folder stays."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    stale = f"hbnet{dead}-sw"
    folder, live = tmp_path / f"hbnet{dead}-x1y2", tmp_path / f"hbnet{os.getppid()}-a3b4"
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
