"""A real ``hybrid`` command running in the background, its output lines timestamped as they come,
so that a test can act on it mid-run (signal it, kill one of its processes) and time the end."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from tests.support.cli import REPO, die_with_test_ignoring, kill_tree
from tests.support.sockets import descendants


class Job:
    """``python -m hybrid.cli ARGS`` in a session of its own (as a terminal's foreground job is in
    a process group of its own); stdout and stderr together, each line with its ``time.monotonic()``.
    Use it as a context manager: whatever is left of it is SIGKILLed on the way out."""

    def __init__(self, args: list[str], *, env: dict[str, str] | None = None, ignoring: tuple[int, ...] = ()) -> None:
        """``ignoring``: signals the command starts with ignored (SIGHUP: as under ``nohup``)."""
        full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
        self.proc = subprocess.Popen([sys.executable, "-m", "hybrid.cli", *args], cwd=REPO, env=full_env,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True, preexec_fn=die_with_test_ignoring(*ignoring))
        self.lines: list[tuple[float, str]] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line.rstrip("\n")))

    def __enter__(self) -> Job:
        return self

    def __exit__(self, *exc) -> None:
        kill_tree(self.proc.pid)
        self.proc.wait()
        self._reader.join(timeout=10)

    @property
    def output(self) -> str:
        return "\n".join(line for _, line in self.lines)

    def wait_training(self, out_dir: Path, rows: int = 3, timeout: float = 180) -> None:
        """Until ``out_dir/metrics.jsonl`` has ``rows`` rows: every process is up and connected."""
        metrics = out_dir / "metrics.jsonl"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            if metrics.exists() and len(metrics.read_text().splitlines()) >= rows:
                return
            time.sleep(0.2)
        raise AssertionError(f"the job did not train {rows} steps in {timeout}s (exit {self.proc.poll()}):\n"
                             f"{self.output[-8000:]}")

    def pids(self) -> list[int]:
        """The command's process and every live process below it."""
        return descendants(self.proc.pid)

    def pid_of_role(self, role: str) -> int:
        """The worker named ``role`` (e.g. ``trainer1``: hybrid names each process after its role)."""
        for pid in self.pids():
            try:
                name = Path(f"/proc/{pid}/comm").read_text().strip()
            except OSError:
                continue
            if name == role:
                return pid
        raise AssertionError(f"no worker named {role} among {self.pids()}")

    def wait(self, timeout: float) -> int:
        """The exit status (raises, after killing everything, if it takes longer than ``timeout``)."""
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_tree(self.proc.pid)
            raise AssertionError(f"the job did not end within {timeout}s:\n{self.output[-8000:]}") from None
        self._reader.join(timeout=10)
        return code

    def lines_after(self, t: float) -> list[tuple[float, str]]:
        return [(when, line) for when, line in self.lines if when >= t]
