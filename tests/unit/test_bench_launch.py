"""benchmarks.launch.spawn when a rank's process cannot be started: the run fails with that
error (not with one from reaping a process that never started)."""

import multiprocessing.context

import pytest

from benchmarks.launch import spawn


def _rank(rank, world_size, store):
    return rank


def test_a_rank_that_cannot_start_fails_the_run_with_its_own_error(monkeypatch):
    def start(self):
        raise OSError("no process for this rank")

    monkeypatch.setattr(multiprocessing.context.ForkServerProcess, "start", start)
    with pytest.raises(OSError, match="no process for this rank"):
        spawn(_rank, 2, timeout_s=60)
