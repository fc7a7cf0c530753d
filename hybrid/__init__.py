"""hybrid: dense layers under FSDP2/DDP on trainers, embedding tables on parameter servers.

The main entry points::

    model = hybrid.compose(model, plan, role=role)      # on each trainer
    with hybrid.step(model, optimizer) as s:            # one training step
        s.backward(loss_fn(model(dense, sparse), labels))
"""

from hybrid.autograd import step
from hybrid.compose import compose

__all__ = ["compose", "step"]
__version__ = "0.1.0"
