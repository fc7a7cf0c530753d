"""The run's metric files: ``metrics.jsonl`` row by row, ``metrics.csv`` from it at the end, and a
resumed run continuing the file of the run it resumes."""

import csv
import json
import math
import tracemalloc

import pytest

from hybrid.train.report import MetricsWriter


def _train_row(step: int) -> dict:
    return {"kind": "train", "step": step, "loss": 1.0 / (step + 1), "step_ms": float(step), "data_ms": 0.5,
            "skipped_batches": 0}


def _eval_row(step: int) -> dict:
    return {"kind": "eval", "step": step, "loss": 0.25, "auc": 0.5 + step / 1000, "candidates": 7}


def _rows(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def _run(out, steps, *, resume_step=None, eval_every=10):
    w = MetricsWriter(out, tensorboard=False, resume_step=resume_step)
    for s in steps:
        w.write(_train_row(s))
        if s % eval_every == 0:
            w.write(_eval_row(s))
    return w


def test_the_csv_holds_every_row_of_the_jsonl_with_every_column(tmp_path):
    w = _run(tmp_path, range(1, 31))
    w.close()
    rows = _rows(tmp_path / "metrics.jsonl")
    assert len(rows) == 33 and rows[0] == _train_row(1) and rows[-1] == _eval_row(30)
    with open(tmp_path / "metrics.csv", newline="") as f:
        table = list(csv.DictReader(f))
    assert list(table[0]) == ["kind", "step", "loss", "step_ms", "data_ms", "skipped_batches", "auc", "candidates"]
    assert len(table) == len(rows)
    for got, want in zip(table, rows):
        assert {k: v for k, v in got.items() if v != ""} == {k: str(v) for k, v in want.items()}
    assert w.own_rows == 30 and w.mean("step_ms") == pytest.approx(15.5) and w.first_loss == 0.5
    assert list(w.train_steps) == list(range(1, 31)) and [r["step"] for r in w.evals] == [10, 20, 30]


def test_a_resumed_run_keeps_the_earlier_rows_in_place_and_drops_what_it_trains_again(tmp_path):
    _run(tmp_path, range(1, 41)).close()
    path = tmp_path / "metrics.jsonl"
    before = path.read_bytes()
    kept = b"".join(line for line in before.splitlines(keepends=True) if json.loads(line)["step"] <= 20)
    with path.open("ab") as f:
        f.write(b'{"kind": "train", "step": 41, "lo')  # a line torn by a crash
    w = _run(tmp_path, range(21, 26), resume_step=20)
    w.close()
    after = path.read_bytes()
    assert after.startswith(kept)  # byte for byte
    assert [(r["kind"], r["step"]) for r in _rows(path)] == (
        [("train", s) for s in range(1, 11)] + [("eval", 10)] + [("train", s) for s in range(11, 21)]
        + [("eval", 20)] + [("train", s) for s in range(21, 26)])
    # The summary's means count this run's rows; the curve and the first loss span the whole job.
    assert w.own_rows == 5 and w.mean("step_ms") == pytest.approx(23.0) and w.first_loss == 0.5
    assert list(w.train_steps) == list(range(1, 26)) and [r["step"] for r in w.evals] == [10, 20]
    with open(tmp_path / "metrics.csv", newline="") as f:
        assert len(list(csv.DictReader(f))) == 27


def test_a_resumed_run_with_no_earlier_file_or_a_fresh_run_starts_an_empty_one(tmp_path):
    w = _run(tmp_path / "a", range(6, 9), resume_step=5)
    w.close()
    assert [r["step"] for r in _rows(tmp_path / "a" / "metrics.jsonl")] == [6, 7, 8]
    _run(tmp_path / "b", range(1, 20)).close()
    _run(tmp_path / "b", range(1, 3)).close()  # not a resume: the folder's old rows go
    assert [r["step"] for r in _rows(tmp_path / "b" / "metrics.jsonl")] == [1, 2]
    assert math.isnan(MetricsWriter(tmp_path / "c", tensorboard=False).mean("step_ms"))
    # A line that is not a row of a step (edited by hand, say) ends what is kept.
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "metrics.jsonl").write_text('{"kind": "train", "step": 1, "loss": 1.0}\n'
                                                  '{"kind": "train", "step": "two", "loss": 1.0}\n'
                                                  '{"kind": "train", "step": 3, "loss": 1.0}\n')
    _run(tmp_path / "d", range(4, 5), resume_step=3).close()
    assert [r["step"] for r in _rows(tmp_path / "d" / "metrics.jsonl")] == [1, 4]


def test_the_writer_keeps_a_few_floats_a_row_not_the_rows(tmp_path):
    """Memory over a long run: the rows live in the file. 20,000 rows of 14 numbers cost a dict
    each (about 1.5 KB) if kept; the writer keeps two floats of each train row."""
    w = MetricsWriter(tmp_path, tensorboard=False)
    wide = {f"metric_{i}": float(i) for i in range(8)}
    w.write({**_train_row(0), **wide})
    tracemalloc.start()
    before, _ = tracemalloc.get_traced_memory()
    for s in range(1, 20_001):
        w.write({**_train_row(s), **wide})
    grown = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    w.close()
    assert grown < 40 * 20_000, f"{grown} bytes for 20,000 rows"
    assert sum(1 for _ in (tmp_path / "metrics.jsonl").open()) == 20_001
