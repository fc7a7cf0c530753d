"""A small CSV dataset for the demo DLRM (label, dense d1 d2, sparse a b) and its config
overrides: the data the launch tests break one line of."""

from __future__ import annotations

from pathlib import Path

GOOD = [(i % 2, 0.5 * i, 1.0, i % 7, f"{i % 5}|{(i + 1) % 5}") for i in range(64)]
"""64 good rows; ids below 7 (feature a) and 5 (feature b)."""

COLUMNS = ["model.features=[a,b]", "model.num_dense=2", "data.dense_columns=[d1,d2]", "data.sparse_columns=[a,b]"]
"""The overrides that have the demo DLRM read these columns."""


def write_csv(path: Path, rows: list[tuple], header: str = "label,d1,d2,a,b") -> Path:
    path.write_text(header + "\n" + "".join(",".join(map(str, r)) + "\n" for r in rows))
    return path


def good_with(row: int, value: tuple) -> list[tuple]:
    """:data:`GOOD` with row ``row`` (0-based, the file's line ``row + 2``) replaced by ``value``."""
    rows = list(GOOD)
    rows[row] = value
    return rows
