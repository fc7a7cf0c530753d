import os

import pytest

# Spawned test processes each get one intra-op thread: 2 cores, several processes.
os.environ.setdefault("OMP_NUM_THREADS", "1")


def _children(pid: int) -> list[int]:
    """Live (non-zombie) descendants of ``pid``, from /proc."""
    kids: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z":
            kids.setdefault(int(fields[1]), []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for c in kids.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def _is_mp_helper(pid: int) -> bool:
    """multiprocessing's resource tracker and the test ranks' fork server (tests/harness.py) live
    for the whole session by design."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read()
        return b"resource_tracker" in cmd or b"forkserver" in cmd
    except OSError:
        return True


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
