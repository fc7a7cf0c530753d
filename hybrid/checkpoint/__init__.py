"""Checkpoints: save, resume exactly, reshard, export.

One directory per saved step::

    <checkpoint.dir>/step_00000010/
        manifest.json                      written last, atomically: step, world, tables, every file's size + sha256
        dense/.metadata, dense/__<r>_0.distcp   torch.distributed.checkpoint: dense model + optimizer (FSDP sharded)
        trainers/trainer<r>.pt             each trainer's RNG states and training position
        tables/<collection>/<table>/shard<k>-of-<S>.part<i>.pt   written by the server holding it: rows + optimizer state, 64 MiB a file

Use::

    ckpt_dir = hybrid.checkpoint.save(root, step, model, optimizer, keep=3, train_state={...})
    ckpt = hybrid.checkpoint.Checkpoint(path)          # or find_resume("latest", root)
    model = hybrid.compose(model, plan, role=role, init_tables="server", start_step=ckpt.step)
    ckpt.restore(model, optimizer)
    hybrid.checkpoint.export(path, "model.pt")         # one plain state_dict (in parts past 1 GiB), no job needed
    state = hybrid.checkpoint.load_export("model.pt")
"""

from hybrid.checkpoint.core import (
    Checkpoint,
    capture_rng,
    dense_only,
    find_resume,
    restore_rng,
    save,
)
from hybrid.checkpoint.export import dense_state_dict, export, export_state_dict, load_export, load_tables
from hybrid.checkpoint.files import CheckpointError, checkpoints, latest, read_manifest, verify

__all__ = [
    "Checkpoint", "CheckpointError", "capture_rng", "checkpoints", "dense_only", "dense_state_dict", "export",
    "export_state_dict", "find_resume", "latest", "load_export", "load_tables", "read_manifest", "restore_rng", "save",
    "verify",
]
