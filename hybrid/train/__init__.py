"""Training: the model entry (:class:`ModelSpec`), tasks, the loop (:mod:`hybrid.train.loop`),
its config (:mod:`hybrid.train.config`), metrics and reports."""

from hybrid.train.spec import ModelSpec, model_schema, resolve_model
from hybrid.train.tasks import CTRTask, RetrievalTask, Task

__all__ = ["CTRTask", "ModelSpec", "RetrievalTask", "Task", "model_schema", "resolve_model"]
