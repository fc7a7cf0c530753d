"""Where a parameter server keeps its tables: memory backed by transparent huge pages; and
whether they fit (:func:`memory_shortfall`, checked before anything is allocated).

A server's step reads and writes a few thousand rows scattered over tables of hundreds of
megabytes. With 4 KiB pages nearly every row is a TLB miss (a page-table walk before the
load); with 2 MiB pages the same tables need 512 times fewer translations. Linux hands out huge
pages to a mapping that asks for them (``madvise(MADV_HUGEPAGE)``, honoured when
``/sys/kernel/mm/transparent_hugepage/enabled`` is ``always`` or ``madvise``, the usual
default), so tables and their optimizer state live in anonymous mappings of their own, aligned to
2 MiB, that ask. Elsewhere (no ``madvise``, small tensors, huge pages switched off in the
server options) they are plain ``torch.empty`` tensors: the numbers are the same either way.
"""

from __future__ import annotations

import functools
import math
import mmap
import os
from pathlib import Path

import torch

HUGE_PAGE = 2 << 20


@functools.cache
def thp_mode() -> str | None:
    """The kernel's transparent-huge-page mode (``always``, ``madvise`` or ``never``), or None
    where it does not say. Read once per process."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            text = f.read()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else None


def huge_pages_available() -> bool:
    """Whether this process can ask for transparent huge pages at all."""
    return hasattr(mmap, "MADV_HUGEPAGE") and thp_mode() in ("always", "madvise")


def table_tensor(*shape: int, dtype: torch.dtype = torch.float32, huge_pages: bool = True,
                 defer_huge_pages: bool = False) -> torch.Tensor:
    """An uninitialized CPU tensor of ``shape`` for table rows or per-row optimizer state: in
    huge pages when ``huge_pages`` asks, it spans at least one and they are available, else
    ``torch.empty``. ``defer_huge_pages``: the mapping is made and aligned for huge pages but not
    yet advised, so scattered first writes take small pages; whoever fills it advises each range
    as it goes (``hybrid.ops.populate_(..., huge_pages=True)``, :mod:`hybrid.ps.server.lazy`)."""
    numel = math.prod(shape)
    nbytes = numel * dtype.itemsize
    if not huge_pages or nbytes < HUGE_PAGE or not huge_pages_available():
        return torch.empty(shape, dtype=dtype)
    # One extra huge page of slack so the tensor can start on a 2 MiB boundary. The mapping is
    # private and anonymous (zero pages until written); the tensor holds the only reference.
    m = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        if not defer_huge_pages:
            m.madvise(mmap.MADV_HUGEPAGE)
    except OSError:
        return torch.empty(shape, dtype=dtype)  # the mapping goes with ``m``
    start = torch.frombuffer(m, dtype=torch.uint8, count=1).data_ptr()
    offset = -start % HUGE_PAGE
    return torch.frombuffer(m, dtype=dtype, count=numel, offset=offset).view(shape)


def huge_page_bytes() -> int | None:
    """Bytes of this process's memory in transparent huge pages (``AnonHugePages``), or None
    where the kernel does not say."""
    try:
        with open(f"/proc/{os.getpid()}/smaps_rollup") as f:
            for line in f:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def available_memory() -> tuple[int, str]:
    """Bytes this process can still fill, and what says so: the kernel's ``MemAvailable``, or
    the room left under this process's cgroup memory limit where that is less."""
    best = (_meminfo_available(), "MemAvailable")
    for limit_file, usage_file in _cgroup_files():
        try:
            limit_text = Path(limit_file).read_text().strip()
            usage = int(Path(usage_file).read_text().strip())
        except (OSError, ValueError):
            continue
        if limit_text.isdigit() and int(limit_text) < 1 << 60:  # "max" / a huge number: no limit
            left = max(0, int(limit_text) - usage)
            if left < best[0]:
                best = (left, f"the cgroup's limit {int(limit_text) / 2**30:.1f} GiB less {usage / 2**30:.1f} GiB used")
        break
    return best


def _meminfo_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _cgroup_files() -> list[tuple[str, str]]:
    """(limit, usage) files of this process's memory cgroup: v2 first, then v1."""
    out = []
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            if controllers == "":
                out.append((f"/sys/fs/cgroup{path}/memory.max", f"/sys/fs/cgroup{path}/memory.current"))
    except (OSError, ValueError):
        pass
    out.append(("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"))
    out.append(("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"))
    return out


def memory_shortfall(need: dict[str, int], *, fraction: float, who: str, fix: str) -> str | None:
    """The one-line message refusing the tables of ``need`` (table -> bytes) when together they
    exceed ``fraction`` of :func:`available_memory`, naming ``who`` holds them, the largest table,
    the bytes, the memory available and ``fix``; ``None`` when they fit."""
    total = sum(need.values())
    room, source = available_memory()
    if total <= fraction * room:
        return None
    largest = max(need, key=need.get)
    return (f"{who}: tables need {human_bytes(total)} (rows + optimizer state; the largest, {largest}: "
            f"{human_bytes(need[largest])}), more than runtime.server_memory_fraction={fraction:g} of the "
            f"{human_bytes(room)} available ({source}); {fix}")


def human_bytes(n: float) -> str:
    """``512 B``, ``16.9 MiB``, ``3.30 GiB``: bytes for a person."""
    for unit in ("B", "KiB", "MiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.2f} GiB"
