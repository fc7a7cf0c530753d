import os

import pytest

from tests.support.sockets import cmdline_of, descendants, state_of

# Spawned test processes each get one intra-op thread: 2 cores, several processes.
os.environ.setdefault("OMP_NUM_THREADS", "1")


def _children(pid: int) -> list[int]:
    """Live (non-zombie) descendants of ``pid``."""
    return [p for p in descendants(pid)[1:] if state_of(p) != "Z"]


def _is_mp_helper(pid: int) -> bool:
    """multiprocessing's resource tracker and the test ranks' fork server (tests/harness.py) live
    for the whole session by design."""
    cmd = cmdline_of(pid)
    return cmd is None or "resource_tracker" in cmd or "forkserver" in cmd


@pytest.fixture(autouse=True)
def _no_stray_processes():
    """Every test must leave no process of its own behind (the harness kills its children)."""
    yield
    left = [p for p in _children(os.getpid()) if not _is_mp_helper(p)]
    if left:
        import signal

        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        pytest.fail(f"the test left {len(left)} process(es) running: {left} (killed now)")
