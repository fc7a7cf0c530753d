"""A call that may hang where nothing times it out (a store read while the store's host is gone),
run on a thread of its own and given up on after a while: a process on its way out must not wait
minutes for a peer that will never answer."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class Bounded:
    """How a call run by :func:`run_bounded` went."""

    finished: bool
    """Whether it returned or raised within the time given."""
    value: Any = None
    """What it returned."""
    error: BaseException | None = None
    """What it raised."""


def run_bounded(fn: Callable[[], Any], timeout_s: float, *, name: str) -> Bounded:
    """``fn()`` on a daemon thread named ``name``, waited for ``timeout_s`` at most. A call still
    running then is left behind: a daemon thread does not hold the process's exit."""
    done: list[Bounded] = []

    def run() -> None:
        try:
            done.append(Bounded(True, value=fn()))
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            done.append(Bounded(True, error=e))

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    thread.join(timeout_s)
    return done[0] if done else Bounded(False)
