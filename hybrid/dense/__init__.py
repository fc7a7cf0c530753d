"""One ``apply_*`` function per dense strategy, looked up by the composer in :data:`DENSE_STRATEGIES`.

Every function has the signature ``apply_X(model, fqn, *, mesh, options) -> None``: it applies
strategy ``X`` in place to ``model.get_submodule(fqn)`` (``fqn == ""`` is the root), over the
trainers' 1-D ``mesh``, with ``options`` the plan's options object for that strategy (read by
attribute name only), and logs one line. State-dict keys, ``named_parameters()`` and
``get_submodule`` paths of the model are the same before and after, so checkpoints and exports
written from the composed model load into the plain one and back.

A new strategy is one function and one line here.
"""

from __future__ import annotations

from hybrid.dense.ddp import apply_ddp
from hybrid.dense.fsdp import apply_fsdp
from hybrid.dense.local import apply_local

DENSE_STRATEGIES = {"fsdp": apply_fsdp, "ddp": apply_ddp, "local": apply_local}
"""Strategy name (as in the plan) -> its ``apply_*`` function."""

__all__ = ["DENSE_STRATEGIES", "apply_ddp", "apply_fsdp", "apply_local"]
