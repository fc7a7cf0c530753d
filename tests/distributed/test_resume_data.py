"""A run resumed with other trainers and another batch size continues at the record the saving
run stopped at, not at the same batch number.

The learning rates are 1e-30: no parameter moves in float32, so a step's logged loss (the mean
over its global batch) depends only on which records it trained on. A run of 2 trainers x 4
records saves after step 2 (16 good records read, a malformed line among them); resumed on 1
trainer x 16 records, its step 3 must train on the straight run's steps 3 and 4 (records 16-31)
and its step 4 on their steps 5 and 6. Counted in batches, it would have started at record 32.
"""

from __future__ import annotations

import json

import pytest

from tests.support.cli import run_hybrid
from tests.support.criteo_data import write_criteo

CONFIG = ["--plan", "conf/plans/dlrm.yaml", "--config", "conf/train/dlrm.yaml"]
STILL = ["model.num_embeddings=60", "model.embedding_dim=8", "model.bottom_mlp=[8,8]", "model.top_mlp=[8,1]",
         "data.source=criteo", "data.malformed=skip", "data.eval_batches=1", "train.eval_every=0", "train.log_every=1",
         "train.plot=false", "train.progress=false", "train.tensorboard=false", "train.lr=1e-30",
         "plan.modules.sparse_arch.embedding_bag_collection.optimizer.lr=1e-30", "runtime.rpc_timeout_s=30"]


def _losses(out) -> dict[int, float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if r["kind"] == "train"}


def test_a_run_resumed_on_other_trainers_continues_at_the_saved_record(tmp_path):
    data = write_criteo(tmp_path / "day.tsv", 80, bad_at=6, dense_max=50, id_bits=12)
    files = [f"data.train_paths=[{data}]", f"data.eval_paths=[{data}]"]
    ckpt = tmp_path / "ckpt"
    straight = run_hybrid(["launch", "-n", "3", "train", *CONFIG, *STILL, *files, "data.batch_size=4",
                           "train.steps=6", f"checkpoint.dir={ckpt}", "checkpoint.every=2",
                           f"train.out_dir={tmp_path / 'straight'}"], timeout=240)
    assert straight.returncode == 0, straight.output
    resumed = run_hybrid(["launch", "-n", "2", "train", *CONFIG, *STILL, *files, "data.batch_size=16",
                          "train.steps=4", f"checkpoint.resume={ckpt / 'step_00000002'}",
                          f"train.out_dir={tmp_path / 'resumed'}"], timeout=240)
    assert resumed.returncode == 0, resumed.output
    manifest = json.loads((ckpt / "step_00000002" / "manifest.json").read_text())
    assert manifest["train"]["data_at"] == {"file": 0, "path": str(data), "size": data.stat().st_size, "offset": 0,
                                            "line": 0, "records": 0}, manifest["train"]
    assert f"(data at epoch 0, record 16, read from {data} byte 0)" in resumed.output, resumed.output
    a, b = _losses(tmp_path / "straight"), _losses(tmp_path / "resumed")
    assert sorted(a) == [1, 2, 3, 4, 5, 6] and sorted(b) == [3, 4], (a, b)
    assert a[1] != pytest.approx(a[3], rel=1e-3)  # the records' losses tell them apart
    assert b[3] == pytest.approx((a[3] + a[4]) / 2, rel=1e-5), (a, b)
    assert b[4] == pytest.approx((a[5] + a[6]) / 2, rel=1e-5), (a, b)
