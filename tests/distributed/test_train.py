"""``hybrid launch ... train`` end to end: each example under its shipped plan, through torchrun.

Each run's per-step losses (``metrics.jsonl``, ``log_every=1``) are compared with one process
training the plain model on the same global batches (the composer's equivalence check, here
through the whole product: CLI, torchrun, config, data, loop).
"""

from __future__ import annotations

import csv
import dataclasses
import json
import os
import re
from pathlib import Path

import pytest
import torch
from torchrec.modules.embedding_modules import EmbeddingBagCollection

import hybrid
from hybrid.data import make_dataset
from hybrid.train.loop import dense_optimizer, load_run
from tests.support.cli import REPO, run_hybrid
from tests.support.sparse import ReferenceSparseOptimizer

STEPS = 6
SMALL = {  # small models keep the run short; the structure is the shipped one
    "dlrm": ["model.num_embeddings=500", "model.bottom_mlp=[16,16]", "model.top_mlp=[16,1]"],
    "dcn": ["model.num_embeddings=500", "model.bottom_mlp=[16,16]", "model.top_mlp=[16,1]",
            "model.dcn_num_layers=2", "model.dcn_low_rank_dim=8"],
    "two_tower": ["model.num_embeddings=500", "model.tower=[16,8]"],
}


def _overrides(name: str, out: Path) -> list[str]:
    return [*SMALL[name], f"train.steps={STEPS}", "train.log_every=1", "train.eval_every=3", "data.batch_size=16",
            "data.eval_batches=2", f"train.out_dir={out}", "train.plot=false", "train.progress=false"]


def reference_losses(name: str, overrides: list[str], world_size: int) -> list[float]:
    """One process, the plain model, the global batches: the per-step mean of the trainers' losses."""
    plan, cfg, _, resolved = load_run(str(REPO / f"conf/plans/{name}.yaml"), str(REPO / f"conf/train/{name}.yaml"),
                                      overrides, world_size)
    trainers = resolved.num_trainers
    b = cfg.data.batch_size
    # What hybrid train starts from: built on meta, tables as the servers fill them, the rest as
    # compose initializes it.
    from hybrid.train.loop import model_seed

    seed = model_seed(cfg)
    model = hybrid.materialize(cfg.spec.make_model(cfg.model_kwargs, seed=seed, device=torch.device("meta")), seed=seed)
    task = cfg.spec.make_task(temperature=cfg.train.temperature)
    schema = cfg.spec.data_schema(model)
    ebcs = {fqn: m for fqn, m in model.named_modules() if isinstance(m, EmbeddingBagCollection)}
    table_params = {id(m.embedding_bags[c.name].weight) for m in ebcs.values() for c in m.embedding_bag_configs()}
    opt = dense_optimizer(cfg.train.optimizer, [p for p in model.parameters() if id(p) not in table_params],
                          cfg.train.lr)
    sparse = {}
    for fqn, m in ebcs.items():
        popt = resolved.entry(fqn).options.optimizer
        for c in m.embedding_bag_configs():
            w = m.embedding_bags[c.name].weight
            sparse[c.name] = (w, c.feature_names[0],
                              ReferenceSparseOptimizer(popt.name, w.data, lr=popt.lr, eps=popt.eps))
    data = iter(make_dataset(schema, dataclasses.replace(cfg.data, batch_size=trainers * b), split="train",
                             rank=0, world_size=1))
    losses = []
    for _ in range(STEPS):
        batch = next(data)
        parts = [task.loss(task.forward(model, s), s) for s in (batch.slice(r * b, (r + 1) * b) for r in range(trainers))]
        loss = torch.stack(parts).mean()
        opt.zero_grad()
        for w, _, _ in sparse.values():
            w.grad = None
        loss.backward()
        opt.step()
        ids = batch.sparse.to_dict()
        for w, feature, ref in sparse.values():
            touched = torch.zeros(w.shape[0], dtype=torch.bool)
            touched[ids[feature].values()] = True
            ref.step(w.grad, touched)
        losses.append(loss.item())
    return losses


def rows(out: Path, kind: str) -> list[dict]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


@pytest.mark.parametrize("name", ["dlrm", "dcn", "two_tower"])
def test_example_trains_under_its_plan_and_matches_one_process(name, tmp_path):
    out = tmp_path / "run"
    over = _overrides(name, out)
    res = run_hybrid(["launch", "-n", "3", "train", "--plan", f"conf/plans/{name}.yaml",
                      "--config", f"conf/train/{name}.yaml", *over], timeout=240)
    assert res.returncode == 0, res.output
    assert "== hybrid run summary ==" in res.stdout, res.output
    got = [r["loss"] for r in rows(out, "train")]
    assert [r["step"] for r in rows(out, "train")] == list(range(1, STEPS + 1))
    want = reference_losses(name, over, world_size=3)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-5)
    assert got[0] != got[-1]  # it trained
    evals = rows(out, "eval")
    assert [r["step"] for r in evals] == [0, 3, STEPS]
    quality = "recall@10" if name == "two_tower" else "auc"
    assert all(0.0 <= r[quality] <= 1.0 for r in evals), evals
    with open(out / "metrics.csv", newline="") as f:  # the CSV holds the same train rows as the JSONL
        table = list(csv.DictReader(f))
    assert {"kind", "step", "loss", quality} <= set(table[0]), table[0]
    csv_losses = [float(r["loss"]) for r in table if r["kind"] == "train"]
    torch.testing.assert_close(torch.tensor(csv_losses), torch.tensor(got), rtol=1e-6, atol=1e-6)
    assert (out / "summary.txt").exists()


def test_demo_config_learns_held_out_auc_well_above_chance(tmp_path):
    """The demo's model, data and plan, fewer steps: held-out AUC ends well above chance."""
    out = tmp_path / "demo"
    res = run_hybrid(["launch", "-n", "3", "train", "--plan", "conf/plans/dlrm.yaml", "--config", "conf/train/dlrm.yaml",
                      "train.steps=120", "train.eval_every=60", f"train.out_dir={out}", "train.progress=false"],
                     timeout=300)
    assert res.returncode == 0, res.output
    evals = rows(out, "eval")
    assert [r["step"] for r in evals] == [0, 60, 120]
    assert evals[-1]["auc"] > 0.75 and evals[-1]["auc"] > evals[0]["auc"] + 0.1, evals
    assert evals[-1]["ne"] < evals[0]["ne"]
    summary = res.stdout[res.stdout.index("== hybrid run summary =="):]
    for line in ("throughput", "step time", "eval auc", "ps0", "output"):
        assert line in summary, summary
    assert (out / "curves.png").stat().st_size > 10_000
    # The server's CPU while the trainers trained: its window (CPU over share) lies within the run.
    cpu = re.search(r"ps0 .*CPU ([0-9.]+) ms/step \(([0-9]+)% of a core\)", summary)
    times = re.search(r"time +([0-9.]+)s training, ([0-9.]+)s with evaluation", summary)
    assert cpu and times, summary
    ms, share = float(cpu[1]), int(cpu[2]) / 100
    assert ms > 0 and 0 < share <= (os.cpu_count() or 1), summary
    window = ms * 120 / 1e3 / share
    assert 0.5 * float(times[1]) < window < 1.5 * float(times[2]) + 1.0, (window, summary)


def test_async_demo_with_hot_rows_reports_its_cache(tmp_path):
    """``hot_rows`` from the command line, under ``hybrid launch``: the run trains and its summary
    says how many rows trainer 0's cache served."""
    out = tmp_path / "hot"
    res = run_hybrid(["launch", "-n", "3", "train", "--plan", "conf/plans/dlrm.yaml", "--config", "conf/train/dlrm.yaml",
                      "train.steps=40", "train.eval_every=0", f"train.out_dir={out}", "train.progress=false",
                      "plan.sync.staleness=3", "plan.modules.sparse_arch.embedding_bag_collection.hot_rows=5000"],
                     timeout=300)
    assert res.returncode == 0, res.output
    summary = res.stdout[res.stdout.index("== hybrid run summary =="):]
    line = next(l for l in summary.splitlines() if l.strip().startswith("hot rows"))
    served = float(line.split(": ")[1].split("%")[0])
    assert 0 < served < 100, line
    assert rows(out, "train")[-1]["step"] == 40
