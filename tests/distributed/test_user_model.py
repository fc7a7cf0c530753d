"""A model of one's own, from outside the repository, trains through the real command:
``hybrid launch -n 3 train --model usermod:build`` with the user's plan and config, the module
found through ``PYTHONPATH`` alone (the command runs in a folder of its own)."""

from __future__ import annotations

import json
import os
import textwrap

from tests.support.cli import run_hybrid

USER_MODULE = '''
"""A user's model: two tables and a small MLP over them and 4 dense features."""
import torch
from torch import nn
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection


class Clicks(nn.Module):
    num_dense = 4  # the dense width the data readers produce (hybrid.train.model_schema)

    def __init__(self, rows, dim, device=None):
        super().__init__()
        self.tables = EmbeddingBagCollection(tables=[
            EmbeddingBagConfig(name="t_user", embedding_dim=dim, num_embeddings=rows, feature_names=["user"]),
            EmbeddingBagConfig(name="t_item", embedding_dim=dim, num_embeddings=rows, feature_names=["item"]),
        ], device=device)
        self.head = nn.Sequential(nn.Linear(4 + 2 * dim, 16, device=device), nn.ReLU(),
                                  nn.Linear(16, 1, device=device))

    def forward(self, dense, sparse):
        return self.head(torch.cat([dense, self.tables(sparse).values()], dim=1))


def build(*, rows=100, dim=8, device=None):
    return Clicks(rows, dim, device)
'''

PLAN = """
topology: {parameter_servers: 1}
modules:
  tables:
    strategy: parameter_server
    optimizer: {name: adagrad, lr: 0.1}
  "*": {strategy: ddp}
"""

CONFIG = """
model: {{rows: 300}}
data: {{batch_size: 32, eval_batches: 2}}
train: {{steps: 8, log_every: 2, eval_every: 4, out_dir: {out}, plot: false, progress: false}}
"""


def test_a_user_model_outside_the_repo_trains_through_hybrid_launch(tmp_path):
    src, job = tmp_path / "src", tmp_path / "job"
    src.mkdir()
    job.mkdir()
    (src / "usermod.py").write_text(USER_MODULE)
    (job / "plan.yaml").write_text(PLAN)
    out = job / "run"
    (job / "train.yaml").write_text(textwrap.dedent(CONFIG.format(out=out)))
    path = os.pathsep.join(p for p in (str(src), os.environ.get("PYTHONPATH", "")) if p)
    res = run_hybrid(["launch", "-n", "3", "train", "--model", "usermod:build", "--plan", "plan.yaml",
                      "--config", "train.yaml"], timeout=240, cwd=job, env={"PYTHONPATH": path})
    assert res.returncode == 0, res.output
    summary = res.stdout[res.stdout.index("== hybrid run summary =="):]
    assert "usermod:build (ctr), plan plan.yaml" in summary, summary
    assert "2 trainers + 1 parameter server" in summary and "eval auc" in summary, summary
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["kind"] == "train"] == [2, 4, 6, 8]
    evals = [r for r in rows if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [0, 4, 8] and all(0.0 <= r["auc"] <= 1.0 for r in evals), evals
    config = json.loads((out / "config.json").read_text())["config"]
    assert config["model"] == {"name": "usermod:build", "rows": 300}
