"""docs/checkpoints.md, "From Python": every reader takes the same ``path``, a ``step_N``
checkpoint or the root holding them (its newest), as ``hybrid export`` and ``Checkpoint`` do."""

from __future__ import annotations

import torch

from hybrid import checkpoint
from hybrid.ps.config import OptimizerSpec
from tests.unit.test_checkpoint import _full, _save


def test_load_tables_reads_the_newest_checkpoint_of_a_root(tmp_path):
    spec = OptimizerSpec(name="rowwise_adagrad")
    full = _full(spec)
    step = _save(tmp_path, "row_wise", 2, spec, full)
    assert step.parent == tmp_path and checkpoint.Checkpoint(tmp_path).path == step
    (tmp_path / "step_00000009").mkdir()  # a save that did not finish: not a checkpoint
    from_root, from_step = checkpoint.load_tables(tmp_path), checkpoint.load_tables(step)
    assert from_root.keys() == from_step.keys() and len(from_root) == len(full)
    for key, (w, state) in from_root.items():
        assert torch.equal(w, full[key.split(".")[-2]][0])
        assert torch.equal(state["sum"], from_step[key][1]["sum"])
