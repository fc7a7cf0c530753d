"""Processes from /proc (no tools needed): their state, parent, command line and descendants,
and the TCP sockets they listen on."""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path


def _stat(pid: int) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name (state, parent, ...); None where
    the process is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2:].split()


def parent_of(pid: int) -> int:
    """The parent of process ``pid``; -1 where it is gone."""
    fields = _stat(pid)
    return -1 if fields is None else int(fields[1])


def state_of(pid: int) -> str:
    """Process ``pid``'s state letter (``R``, ``S``, ``T`` stopped, ``Z`` a zombie, ...); ``Z``
    where it is gone too: either way it runs no more."""
    fields = _stat(pid)
    return "Z" if fields is None else fields[0]


def cmdline_of(pid: int) -> str | None:
    """Process ``pid``'s command line, its arguments joined by spaces; None where it is gone."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return None


def descendants(root: int) -> list[int]:
    """``root`` and every live process below it (torchrun starts its workers in new sessions)."""
    parent = {int(d.name): parent_of(int(d.name)) for d in Path("/proc").iterdir() if d.name.isdigit()}
    found, frontier = [root], [root]
    while frontier:
        frontier = [p for p, pp in parent.items() if pp in frontier]
        found += frontier
    return found


def _socket_inodes(pid: int) -> set[str]:
    out = set()
    try:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                link = os.readlink(fd)
            except OSError:
                continue
            if link.startswith("socket:["):
                out.add(link[8:-1])
    except OSError:
        pass
    return out


def _addr(hex_addr: str, v6: bool) -> str:
    ip_hex, port_hex = hex_addr.split(":")
    raw = bytes.fromhex(ip_hex)
    if v6:  # four little-endian 32-bit words
        raw = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))
        ip = ipaddress.IPv6Address(raw)
    else:
        ip = ipaddress.IPv4Address(raw[::-1])
    return f"{ip}:{int(port_hex, 16)}"


def listening(pids: list[int]) -> list[tuple[int, str]]:
    """``(pid, "address:port")`` of every listening TCP socket held by ``pids``."""
    owner = {inode: pid for pid in pids for inode in _socket_inodes(pid)}
    found = []
    for table, v6 in (("/proc/net/tcp", False), ("/proc/net/tcp6", True)):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            parts = line.split()
            if parts[3] == "0A" and parts[9] in owner:  # 0A = LISTEN
                found.append((owner[parts[9]], _addr(parts[1], v6)))
    return found


def unix_socket_paths(pids: list[int]) -> set[str]:
    """The file paths of the Unix sockets held by ``pids`` (abstract ones have none)."""
    inodes = {inode for pid in pids for inode in _socket_inodes(pid)}
    found = set()
    for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
        parts = line.split()
        if len(parts) >= 8 and parts[6] in inodes and parts[7].startswith("/"):
            found.add(parts[7])
    return found
