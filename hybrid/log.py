"""One logger for the whole package: ``hybrid`` prefix, rank and role in every line."""

from __future__ import annotations

import logging
import os
import sys

logger = logging.getLogger("hybrid")
_warned: set[str] = set()


class _RankFilter(logging.Filter):
    def __init__(self, tag: str) -> None:
        super().__init__()
        self.tag = tag

    def filter(self, record: logging.LogRecord) -> bool:
        record.tag = self.tag
        return True


def init_logging(tag: str | None = None, level: str | int | None = None) -> None:
    """Configure the ``hybrid`` logger once per process; ``tag`` is e.g. ``"trainer0"``."""
    tag = tag or f"rank{os.environ.get('RANK', '0')}"
    level = level or os.environ.get("HYBRID_LOG_LEVEL", "INFO")
    for h in list(logger.handlers):
        logger.removeHandler(h)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("[hybrid %(tag)s %(asctime)s] %(message)s", "%H:%M:%S"))
    handler.addFilter(_RankFilter(tag))
    logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False


def warn_once(msg: str) -> None:
    """Log a warning the first time ``msg`` is seen in this process."""
    if msg not in _warned:
        _warned.add(msg)
        logger.warning(msg)
