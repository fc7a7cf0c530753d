"""The census example end to end: a CSV as it comes (string categoricals, raw 64-bit ids, a text
label, raw numbers) trains with ``data.categorical: hash`` into ``ids: dynamic`` tables, with no
preprocessing, in one process and as 2 trainers + 1 server, to the same held-out AUC."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.support.census import write
from tests.support.cli import run_hybrid

STEPS = 60
CONF = ["--plan", "conf/plans/census.yaml", "--config", "conf/train/census.yaml"]


def _evals(out: Path) -> list[dict]:
    rows = map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
    return [r for r in rows if r["kind"] == "eval"]


def _losses(out: Path) -> list[float]:
    rows = map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
    return [r["loss"] for r in rows if r["kind"] == "train"]


def test_census_csv_trains_hashed_into_dynamic_tables_one_process_equals_hybrid(tmp_path):
    # 1537 held-out rows: the last global batch of 2 x 64 has 1 row, so trainer0's last eval
    # batch is empty -- every held-out row is still read. 3971 training rows: the last global batch of each epoch has 3, which ``drop_last: false``
    # splits 1 and 2 between the trainers (step 32 trains on it, and the steps after on the next
    # epoch): each trainer's loss weighs by its share, so that step equals one process's mean.
    train, held_out = write(tmp_path / "data", train_rows=3971, eval_rows=1537)
    common = [f"data.train_paths=[{train}]", f"data.eval_paths=[{held_out}]", f"train.steps={STEPS}",
              "data.drop_last=false", "train.eval_every=30", "train.log_every=1", "train.plot=false", "train.progress=false"]
    one, two = tmp_path / "one", tmp_path / "two"
    res = run_hybrid(["launch", "-n", "1", "train", *CONF, *common, "data.batch_size=128", f"train.out_dir={one}"],
                     timeout=240)
    assert res.returncode == 0, res.output
    res = run_hybrid(["launch", "-n", "3", "train", *CONF, *common, "data.batch_size=64", f"train.out_dir={two}"],
                     timeout=240)
    assert res.returncode == 0, res.output
    a, b = _evals(one), _evals(two)
    assert [r["step"] for r in a] == [r["step"] for r in b] == [0, 30, STEPS]
    assert a[-1]["auc"] > 0.85 and a[-1]["auc"] > a[0]["auc"] + 0.2, a  # it learned from raw text
    assert abs(a[-1]["auc"] - b[-1]["auc"]) < 0.002, (a, b)
    torch.testing.assert_close(torch.tensor(_losses(one)), torch.tensor(_losses(two)), rtol=1e-4, atol=1e-4)
    # The standardize statistics were computed once over the training file and saved with the run.
    stats = json.loads((one / "data_stats.json").read_text())
    assert stats["rows"] == 3971 and stats["dense_columns"] == ["age", "hours_per_week", "capital_gain"]
