"""What the tests of the emulated network (benchmarks/network.py) share: the skip marker and a
look at the machine's own links."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or not all(shutil.which(t) for t in ("ip", "tc", "unshare")),
    reason="the emulated network needs root, ip, tc and unshare",
)


def root_links() -> list[str]:
    """The links of this process's network namespace, one line each (``ip -o link``)."""
    return sorted(subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout.split("\n"))
