"""What a run writes (on trainer 0): metrics.jsonl, metrics.csv, TensorBoard events, curves.png, summary.txt.

Every row of ``metrics.jsonl`` is one JSON object with ``kind`` (``train`` or ``eval``), ``step``
and the numbers of that row; ``metrics.csv`` holds the same rows with one column per key seen
(written at the end, so columns can differ between train and eval rows).
"""

from __future__ import annotations

import csv
import json
import math
from array import array
from pathlib import Path
from typing import Any

from hybrid.log import logger, warn_once


class MetricsWriter:
    """Appends metric rows to ``out_dir/metrics.jsonl`` (flushed per row) and TensorBoard.

    Memory stays flat however long the run: the rows live in the file, and the writer keeps only
    what the end of the run needs -- the CSV's columns, the train loss curve (two floats a row),
    the eval rows (one per evaluation), and sums of this run's train rows for the summary.

    ``resume_step``: the run continues one that wrote to the same folder, from that step. Its
    rows through that step stay where they are, byte for byte; the file is cut after the last of
    them (the rows of steps the new run trains again go, as does a last line torn by a crash),
    and TensorBoard drops its events after that step.
    """

    def __init__(self, out_dir: Path, *, tensorboard: bool, resume_step: int | None = None) -> None:
        self.out_dir = out_dir
        out_dir.mkdir(parents=True, exist_ok=True)
        self.keys: list[str] = []
        self.train_steps: array = array("d")
        self.train_losses: array = array("d")
        self.evals: list[dict[str, Any]] = []
        self.first_loss: float | None = None
        self._sums: dict[str, float] = {}
        self.own_rows = 0
        """Train rows this run wrote (a resumed run's rows of the run it continues not counted)."""
        path = out_dir / "metrics.jsonl"
        kept = self._keep(path, resume_step) if resume_step is not None and path.is_file() else 0
        self._jsonl = path.open("r+b" if kept else "wb")
        self._jsonl.truncate(kept)
        self._jsonl.seek(kept)
        self._tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                # purge_step: a resumed run's steps replace the events an earlier run wrote for them
                purge = None if resume_step is None else resume_step + 1
                self._tb = SummaryWriter(log_dir=str(out_dir / "tensorboard"), purge_step=purge)
            except ImportError:
                logger.debug("tensorboard is not installed; no events written")

    def _keep(self, path: Path, resume_step: int) -> int:
        """Read the earlier run's rows through ``resume_step`` into the writer's summaries; the
        byte offset just after the last of them."""
        kept = 0
        with path.open("rb") as f:
            for line in f:
                if not line.endswith(b"\n"):
                    break  # torn by a crash while it was written
                try:
                    row = json.loads(line)
                except ValueError:
                    break
                step = row.get("step", 0) if isinstance(row, dict) else None
                if not isinstance(step, int) or step > resume_step:
                    break
                self._note(row)
                kept += len(line)
        return kept

    def _note(self, row: dict[str, Any]) -> None:
        self.keys += [k for k in row if k not in self.keys]
        if row.get("kind") == "eval":
            self.evals.append(row)
        elif row.get("kind") == "train" and isinstance(row.get("loss"), (int, float)):
            if self.first_loss is None:
                self.first_loss = row["loss"]
            self.train_steps.append(row["step"])
            self.train_losses.append(row["loss"])

    def write(self, row: dict[str, Any]) -> None:
        self._note(row)
        if row.get("kind") == "train":
            self.own_rows += 1
            for k, v in row.items():
                if k not in ("kind", "step") and isinstance(v, (int, float)):
                    self._sums[k] = self._sums.get(k, 0.0) + v
        self._jsonl.write((json.dumps(row, allow_nan=True) + "\n").encode("utf-8"))
        self._jsonl.flush()
        if self._tb is not None:
            for k, v in row.items():
                if k not in ("kind", "step") and isinstance(v, (int, float)) and math.isfinite(v):
                    self._tb.add_scalar(f"{row['kind']}/{k}", v, row["step"])

    def mean(self, key: str) -> float:
        """Mean of ``key`` over the train rows this run wrote (NaN without any)."""
        return self._sums.get(key, float("nan")) / self.own_rows if self.own_rows else float("nan")

    def close(self) -> None:
        """Close the files, then write ``metrics.csv`` from ``metrics.jsonl``, a row at a time."""
        self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
        with (self.out_dir / "metrics.jsonl").open("rb") as src, \
                (self.out_dir / "metrics.csv").open("w", newline="", encoding="utf-8") as f:
            w = csv.DictWriter(f, fieldnames=self.keys)
            w.writeheader()
            for line in src:
                w.writerow(json.loads(line))

    def plot(self, path: Path, *, quality: str) -> Path | None:
        """Training loss and evaluation ``quality`` (e.g. ``auc``) over steps, as a PNG."""
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            warn_once("matplotlib is not installed; no curves.png (pip install matplotlib)")
            return None
        evals = self.evals
        fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
        a.plot(self.train_steps, self.train_losses, label="train loss")
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
