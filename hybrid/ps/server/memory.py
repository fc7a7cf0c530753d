"""Where a parameter server keeps its tables: memory backed by transparent huge pages.

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


def table_tensor(*shape: int, dtype: torch.dtype = torch.float32, huge_pages: bool = True) -> torch.Tensor:
    """An uninitialized CPU tensor of ``shape`` for table rows or per-row optimizer state: in
    huge pages when ``huge_pages`` asks, it spans at least one and they are available, else
    ``torch.empty``."""
    numel = math.prod(shape)
    nbytes = numel * dtype.itemsize
    if not huge_pages or nbytes < HUGE_PAGE or not huge_pages_available():
        return torch.empty(shape, dtype=dtype)
    # One extra huge page of slack so the tensor can start on a 2 MiB boundary. The mapping is
    # private and anonymous (zero pages until written); the tensor holds the only reference.
    m = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
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
