"""The timed training loop every system runs on each trainer, and what a trainer reports."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from benchmarks.launch import METER
from benchmarks.workload import Batch, Workload


def train(
    w: Workload,
    batches: list[Batch],
    step: Callable[[int, Batch], torch.Tensor],
    *,
    name: str,
    sync: Callable[[], None] | None = None,
    on_start: Callable[[], None] | None = None,
    on_stop: Callable[[], None] | None = None,
    after: Callable[[], None] | None = None,
) -> dict:
    """Run ``step(t, batch)`` (one training step, returns the loss) over every batch.

    The first ``w.warmup`` steps are not timed. ``sync`` (a barrier of the trainers) lines the
    trainers up before the timed window, so every trainer's window covers the same steps;
    ``on_start`` runs before the window opens (snapshot server counters), ``on_stop`` inside it,
    at its end (drain the training's pending work: it is part of the steps), ``after`` once it
    closed (read the counters: the harness's work, not the training's).
    Returns this process's meter report plus ``losses`` (every step) and ``step_s`` (timed steps).
    """
    losses, step_s = [], []
    for t, batch in enumerate(batches):
        if t == w.warmup:
            if sync is not None:
                sync()
            if on_start is not None:
                on_start()
            METER.start()
        t0 = time.perf_counter()
        loss = step(t, batch)
        if t >= w.warmup:
            step_s.append(time.perf_counter() - t0)
        losses.append(float(loss.detach()))
    if on_stop is not None:
        on_stop()
    METER.stop()
    if after is not None:
        after()
    return {**METER.report(name), "losses": losses, "step_s": step_s}
