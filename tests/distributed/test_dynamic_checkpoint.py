"""Checkpoints of dynamic tables (``ids: dynamic``) end to end, through ``hybrid launch train``.

- **straight**: 2 trainers + 2 servers, 10 steps, a checkpoint every 5, tables of 40 rows with
  ``evict: lru`` over 60 distinct ids (so the map churns);
- **resumed**: new processes resume from the step-5 checkpoint with **one** server (the parts
  move whole: a reshard) and train steps 6..10: the same losses, and at step 10 the same ids,
  rows, optimizer state, map and counters as straight's;
- the export writes ``(ids, rows)`` per table.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from hybrid.checkpoint import export_state_dict, read_manifest
from hybrid.checkpoint.files import FileEntry, load_tensors
from tests.support.cli import run_hybrid

STEPS = 10
EBC = "sparse_arch.embedding_bag_collection"
TINY = ["model.num_embeddings=60", "model.features=[C1,C2,C3,C4]", "model.embedding_dim=8", "model.bottom_mlp=[8,8]",
        "model.top_mlp=[8,1]", "data.batch_size=8", "data.eval_batches=1", "train.log_every=1", "train.eval_every=0",
        "train.plot=false", "train.progress=false", "train.tensorboard=false", "runtime.rpc_timeout_s=30",
        "runtime.heartbeat_s=1", "runtime.shutdown_timeout_s=20", f"train.steps={STEPS}",
        f"plan.modules.{EBC}.ids=dynamic", f"plan.modules.{EBC}.capacity=40", f"plan.modules.{EBC}.evict=lru",
        f"plan.modules.{EBC}.partitions=4", "checkpoint.every=5"]
pytestmark = pytest.mark.slow


def _train(out: Path, ckpt: Path, servers: int, *extra: str):
    return run_hybrid(["launch", "-n", str(2 + servers), "train", "--plan", "conf/plans/dlrm.yaml", "--config",
                       "conf/train/dlrm.yaml", *TINY, f"plan.topology.parameter_servers={servers}",
                       f"train.out_dir={out}", f"checkpoint.dir={ckpt}", *extra], timeout=300)


def _losses(out: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if r["kind"] == "train"}


def _tables(ckpt: Path) -> dict[str, dict[str, torch.Tensor]]:
    """Every dynamic table of a checkpoint, its servers' files merged and sorted by id."""
    m = read_manifest(ckpt)
    out = {}
    for coll in m["collections"]:
        for t in coll["tables"]:
            assert t["dynamic"]["capacity"] == 40
            parts = [load_tensors(ckpt, FileEntry(f["path"], int(f["size"]), f["sha256"])) for f in t["files"]]
            order = torch.argsort(torch.cat([p["ids"] for p in parts]))
            merged = {k: torch.cat([p[k] for p in parts])[order] for k in parts[0]
                      if k not in ("info", "seen_ids", "seen_counts", "counters")}
            merged["counters"] = sum(p["counters"] for p in parts if "counters" in p)[:2]  # admitted, evicted
            seen_ids = torch.cat([p["seen_ids"] for p in parts if "seen_ids" in p])
            seen = torch.argsort(seen_ids)
            merged["seen_ids"] = seen_ids[seen]
            merged["seen_counts"] = torch.cat([p["seen_counts"] for p in parts if "seen_ids" in p])[seen]
            out[t["key"]] = merged
    return out


# admit_window: the step-5 checkpoint falls inside a window of 3 steps, so it carries sightings
# that the resumed run must count on with, and the windows go on at the same steps.
@pytest.mark.parametrize("admission", [[], [f"plan.modules.{EBC}.admit_after=2", f"plan.modules.{EBC}.admit_window=3"]],
                         ids=["first-touch", "admit2-window3"])
def test_dynamic_tables_resume_exactly_at_another_server_count(tmp_path, admission):
    straight = tmp_path / "straight"
    res = _train(straight / "out", straight / "ckpt", 2, *admission)
    assert res.returncode == 0, res.output
    resumed = tmp_path / "resumed"
    (resumed / "ckpt").mkdir(parents=True)
    shutil.copytree(straight / "ckpt" / "step_00000005", resumed / "ckpt" / "step_00000005")
    if admission:
        mid = _tables(resumed / "ckpt" / "step_00000005")
        assert all(t["seen_ids"].numel() for t in mid.values()), "the checkpoint holds sightings"
    res = _train(resumed / "out", resumed / "ckpt", 1, "checkpoint.resume=latest", *admission)
    assert res.returncode == 0, res.output
    assert "resuming at step 5 from" in res.stderr, res.output
    summary = (resumed / "out" / "summary.txt").read_text()
    assert "dynamic tables:" in summary and "evicted" in summary and "hit ratio" in summary, summary
    assert ("ids counted without a row" in summary) == bool(admission), summary  # step 9's sightings
    got, want = _losses(resumed / "out"), _losses(straight / "out")
    assert sorted(got) == list(range(6, STEPS + 1)) and got == {s: want[s] for s in got}
    a, b = _tables(straight / "ckpt" / "step_00000010"), _tables(resumed / "ckpt" / "step_00000010")
    assert list(a) == list(b) and a
    for key in a:
        assert set(a[key]) == set(b[key])
        for k in a[key]:
            assert torch.equal(a[key][k], b[key][k]), (key, k)
        assert 0 < a[key]["ids"].numel() <= 40
        assert int(a[key]["counters"][1]) > 0 or admission  # full tables, rows evicted
    state = export_state_dict(straight / "ckpt" / "step_00000010")
    for key in a:
        ids_key = key[: -len("weight")] + "ids"
        assert torch.equal(state[ids_key], a[key]["ids"]) and torch.equal(state[key], a[key]["rows"])


def test_a_full_table_with_evict_none_stops_the_run_with_exit_2(tmp_path):
    res = run_hybrid(["launch", "-n", "3", "train", "--plan", "conf/plans/dlrm.yaml", "--config", "conf/train/dlrm.yaml",
                      *[a for a in TINY if not a.startswith((f"plan.modules.{EBC}.capacity", f"plan.modules.{EBC}.evict"))],
                      f"plan.modules.{EBC}.capacity=8", f"plan.modules.{EBC}.evict=none",
                      "plan.topology.parameter_servers=1", f"train.out_dir={tmp_path / 'out'}",
                      f"checkpoint.dir={tmp_path / 'ckpt'}"], timeout=300)
    assert res.returncode == 2, res.output
    assert "dynamic table" in res.stderr and "is full" in res.stderr and "nothing was changed" in res.stderr, res.output
    assert "Traceback" not in res.stderr, res.output
