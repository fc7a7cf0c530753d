"""Criteo TSV files for tests: seeded lines, one malformed line where asked."""

from __future__ import annotations

import random
from pathlib import Path


def write_criteo(path: Path, records: int, *, seed: int = 0, bad_at: int | None = None, dense_max: int = 9,
                 id_bits: int = 16) -> Path:
    """``records`` good lines (label, 13 integers in ``[0, dense_max]``, 26 hex ids of ``id_bits``
    bits), and a malformed line inserted before good line ``bad_at`` when given."""
    rng = random.Random(seed)
    lines = ["\t".join([str(rng.randint(0, 1)), *(str(rng.randint(0, dense_max)) for _ in range(13)),
                        *(f"{rng.getrandbits(id_bits):x}" for _ in range(26))]) for _ in range(records)]
    if bad_at is not None:
        lines.insert(bad_at, "not\ta\tcriteo\tline")
    path.write_text("\n".join(lines) + "\n")
    return path
