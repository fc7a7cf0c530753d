"""One-process mode: the whole job in one trainer that holds the ``parameter_server`` tables.

``hybrid launch -n 1 train`` and ``hybrid train`` without torchrun run the plan's tables through
the servers' own code (shards, sparse optimizers, step bookkeeping) inside the trainer, so a run
on one global batch of ``2 x B`` equals a sync run of 2 trainers of ``B`` + 1 server, step by step.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.support.cli import run_hybrid

STEPS = 6
SMALL = ["model.num_embeddings=500", "model.bottom_mlp=[16,16]", "model.top_mlp=[16,1]", f"train.steps={STEPS}",
         "train.log_every=1", "train.eval_every=3", "train.plot=false", "train.progress=false"]
DEMO = ["--plan", "conf/plans/dlrm.yaml", "--config", "conf/train/dlrm.yaml"]


def rows(out: Path, kind: str) -> list[dict]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def test_one_process_equals_two_trainers_and_a_server(tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    res = run_hybrid(["launch", "-n", "1", "train", *DEMO, *SMALL, "data.batch_size=32", "data.eval_batches=2",
                      f"train.out_dir={one}"], timeout=240)
    assert res.returncode == 0, res.output
    assert "1 trainer holding the tables" in res.stdout, res.output
    res = run_hybrid(["launch", "-n", "3", "train", *DEMO, *SMALL, "data.batch_size=16", "data.eval_batches=2",
                      f"train.out_dir={two}"], timeout=240)
    assert res.returncode == 0, res.output
    got, want = [r["loss"] for r in rows(one, "train")], [r["loss"] for r in rows(two, "train")]
    assert len(got) == STEPS and got[0] != got[-1]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-5)
    auc = [[r["auc"] for r in rows(out, "eval")] for out in (one, two)]
    torch.testing.assert_close(torch.tensor(auc[0]), torch.tensor(auc[1]), rtol=0, atol=1e-4)
    # The servers' counters come from the same server code, held in the trainer.
    assert "ps0" in res.stdout


def test_hybrid_train_without_torchrun_runs_a_zero_server_plan_in_process(tmp_path):
    """No RANK in the environment: the job runs here; ``parameter_servers: 0`` with
    ``parameter_server`` modules is the same mode (tables trained by the plan's sparse optimizer)."""
    out = tmp_path / "run"
    res = run_hybrid(["train", *DEMO, *SMALL, "plan.topology.parameter_servers=0", "data.batch_size=32",
                      "data.eval_batches=2", f"train.out_dir={out}"], timeout=240)
    assert res.returncode == 0, res.output
    assert "optimizer rowwise_adagrad" in res.output, res.output
    evals = rows(out, "eval")
    assert [r["step"] for r in evals] == [0, 3, STEPS]
    assert evals[-1]["auc"] != evals[0]["auc"]


def test_a_zero_server_plan_with_tables_and_two_trainers_is_refused(tmp_path):
    res = run_hybrid(["launch", "-n", "2", "train", *DEMO, *SMALL, "plan.topology.parameter_servers=0",
                      f"train.out_dir={tmp_path}"], timeout=120)
    assert res.returncode == 2, res.output
    assert "topology.parameter_servers: 0 with 2 trainers" in res.stderr, res.output
    assert "Traceback" not in res.output


def test_one_process_checkpoint_and_resume_equal_the_straight_run(tmp_path):
    """The tables' checkpoint is written and read by the same server code, held in the trainer."""
    base = ["launch", "-n", "1", "train", *DEMO, *SMALL, "data.batch_size=32", "train.eval_every=0"]
    ck = [f"checkpoint.dir={tmp_path / 'ck'}"]
    res = run_hybrid([*base, "train.steps=4", "checkpoint.every=2", *ck, f"train.out_dir={tmp_path / 'a'}"],
                     timeout=240)
    assert res.returncode == 0, res.output
    res = run_hybrid([*base, "checkpoint.resume=latest", *ck, f"train.out_dir={tmp_path / 'a'}"], timeout=240)
    assert res.returncode == 0 and "resuming at step 4" in res.output, res.output
    res = run_hybrid([*base, f"train.out_dir={tmp_path / 'b'}"], timeout=240)
    assert res.returncode == 0, res.output
    got, want = ([r["loss"] for r in rows(tmp_path / d, "train")] for d in "ab")
    assert len(want) == STEPS and got == want


def test_a_one_process_run_ends_cleanly_while_its_tables_are_still_being_filled(tmp_path):
    """Tables far larger than a 2-step run needs: the background fill of their initial rows is
    still at work when the run ends. The run stops that thread before the interpreter exits (a
    daemon thread inside a native call at exit aborts the process: exit code 134)."""
    res = run_hybrid(["train", *DEMO, "model.num_embeddings=100000", "train.steps=2", "train.eval_every=0",
                      "train.plot=false", "train.progress=false", "plan.topology.parameter_servers=0",
                      "data.batch_size=32", f"train.out_dir={tmp_path / 'run'}"], timeout=240)
    assert res.returncode == 0, res.output
    assert "background fill:" not in res.output, "the fill ended before the run: this test shows nothing"


def test_a_one_process_run_that_fails_leaves_no_temp_folder(tmp_path):
    """A one-process run keeps its store in a temp folder; one that fails (here: a
    checkpoint.dir that cannot be made, found once the run has set up) ends at once, past the
    block that removes the folder, and removes it on its way out."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    blocker = tmp_path / "blocker"
    blocker.write_text("")
    res = run_hybrid(["train", *DEMO, *SMALL, f"checkpoint.dir={blocker / 'ckpt'}", "checkpoint.every=2",
                      f"train.out_dir={tmp_path / 'run'}"], timeout=240, env={"TMPDIR": str(tmp)})
    errors = [line for line in res.output.splitlines() if line.startswith("error:")]
    assert res.returncode == 2 and len(errors) == 1 and "cannot create it" in errors[0], res.output
    assert not list(tmp.glob("hybrid-one-*")), sorted(p.name for p in tmp.iterdir())
