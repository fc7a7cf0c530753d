"""What a run writes (on trainer 0): metrics.jsonl, metrics.csv, TensorBoard events, curves.png, summary.txt.

Every row of ``metrics.jsonl`` is one JSON object with ``kind`` (``train`` or ``eval``), ``step``
and the numbers of that row; ``metrics.csv`` holds the same rows with one column per key seen
(written at the end, so columns can differ between train and eval rows).
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Any

from hybrid.log import logger, warn_once


class MetricsWriter:
    """Appends metric rows to ``out_dir/metrics.jsonl`` (flushed per row) and TensorBoard."""

    def __init__(self, out_dir: Path, *, tensorboard: bool) -> None:
        self.out_dir = out_dir
        out_dir.mkdir(parents=True, exist_ok=True)
        self.rows: list[dict[str, Any]] = []
        self._jsonl = (out_dir / "metrics.jsonl").open("w", encoding="utf-8")
        self._tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(log_dir=str(out_dir / "tensorboard"))
            except ImportError:
                logger.debug("tensorboard is not installed; no events written")

    def write(self, row: dict[str, Any]) -> None:
        self.rows.append(row)
        self._jsonl.write(json.dumps(row, allow_nan=True) + "\n")
        self._jsonl.flush()
        if self._tb is not None:
            for k, v in row.items():
                if k not in ("kind", "step") and isinstance(v, (int, float)) and math.isfinite(v):
                    self._tb.add_scalar(f"{row['kind']}/{k}", v, row["step"])

    def close(self) -> None:
        self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
        keys: list[str] = []
        for r in self.rows:
            keys += [k for k in r if k not in keys]
        with (self.out_dir / "metrics.csv").open("w", newline="", encoding="utf-8") as f:
            w = csv.DictWriter(f, fieldnames=keys)
            w.writeheader()
            w.writerows(self.rows)


def plot_curves(rows: list[dict[str, Any]], path: Path, *, quality: str) -> Path | None:
    """Training loss and evaluation ``quality`` (e.g. ``auc``) over steps, as a PNG."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        warn_once("matplotlib is not installed; no curves.png (pip install matplotlib)")
        return None
    train = [r for r in rows if r["kind"] == "train"]
    evals = [r for r in rows if r["kind"] == "eval"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.plot([r["step"] for r in train], [r["loss"] for r in train], label="train loss")
    if evals:
        a.plot([r["step"] for r in evals], [r["loss"] for r in evals], "o-", label="eval loss")
        b.plot([r["step"] for r in evals], [r.get(quality, float("nan")) for r in evals], "o-", color="C2")
    a.set_xlabel("step")
    a.set_ylabel("loss")
    a.legend()
    b.set_xlabel("step")
    b.set_ylabel(f"eval {quality}")
    b.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def table(rows: list[tuple[str, str]]) -> str:
    """Two aligned columns."""
    width = max((len(k) for k, _ in rows), default=0)
    return "\n".join(f"  {k.ljust(width)}  {v}" for k, v in rows)


def fmt(v: Any) -> str:
    if isinstance(v, float):
        if math.isnan(v):
            return "n/a"
        return f"{v:.4f}" if abs(v) < 1000 else f"{v:,.0f}"
    return str(v)
