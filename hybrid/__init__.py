"""hybrid: dense layers under FSDP2/DDP on trainers, embedding tables on parameter servers.

The main entry points::

    ebc = EmbeddingBagCollection(tables, device=torch.device("meta"))  # no table on a trainer
    model = hybrid.compose(DLRM(ebc, ...), plan, role=role)          # the servers fill the tables
    with hybrid.step(model, optimizer) as s:            # one training step
        s.backward(loss_fn(model(dense, sparse), labels))

    hybrid.init_tables(local_ebc, seed=0)               # one process: the servers' initial rows
    hybrid.materialize(meta_model, seed=0)              # one process: the whole model compose starts from

All are imported on first use: ``import hybrid`` (and the ``hybrid`` command's launcher, which
only starts torchrun) does not pay for torchrec's import, several seconds on a small machine.
"""

from __future__ import annotations

import sys
import types
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hybrid.ps.client.pipeline import step
    from hybrid.compose import compose, materialize
    from hybrid.ps.init import init_tables

__all__ = ["compose", "init_tables", "materialize", "step"]
__version__ = "0.1.0"

_LAZY = {"compose": "hybrid.compose", "init_tables": "hybrid.ps.init", "materialize": "hybrid.compose",
         "step": "hybrid.ps.client.pipeline"}


class _Package(types.ModuleType):
    """``hybrid.compose``, ``hybrid.init_tables``, ``hybrid.materialize`` and ``hybrid.step`` are
    the functions, imported on first use. Importing the submodule ``hybrid.compose`` would otherwise rebind the package's
    ``compose`` to that module; it stays in ``sys.modules["hybrid.compose"]`` instead."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _LAZY and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)

    def __getattr__(self, name: str) -> Any:
        if name not in _LAZY:
            raise AttributeError(f"module 'hybrid' has no attribute {name!r}")
        import importlib

        fn = getattr(importlib.import_module(_LAZY[name]), name)
        super().__setattr__(name, fn)
        return fn


sys.modules[__name__].__class__ = _Package
