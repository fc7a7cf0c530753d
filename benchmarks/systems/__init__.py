"""The systems a benchmark compares, one module (and one ``run_*`` function) each.

Every ``run_*(w, *, timeout_s, ...)`` trains workload ``w`` in fresh processes and returns one
report per process (:func:`benchmarks.systems.common.train` for trainers, the meter for servers).
"""

from __future__ import annotations

from collections.abc import Callable

from benchmarks.systems.hybrid_ps import (
    run_hybrid_async,
    run_hybrid_sync,
    run_hybrid_sync_dynamic,
    run_hybrid_sync_fsdp,
)
from benchmarks.systems.local import run_local
from benchmarks.systems.rpc_tutorial import run_rpc_tutorial
from benchmarks.systems.torchrec_dmp import run_torchrec_dmp, run_torchrec_dmp_batch

SYSTEMS: dict[str, Callable[..., list[dict]]] = {
    "local": run_local,
    "rpc_tutorial": run_rpc_tutorial,
    "torchrec_dmp": run_torchrec_dmp,
    "hybrid_sync": run_hybrid_sync,
    "hybrid_async": run_hybrid_async,
    "hybrid_sync_fsdp": run_hybrid_sync_fsdp,
    "hybrid_sync_dynamic": run_hybrid_sync_dynamic,
    "torchrec_dmp_batch": run_torchrec_dmp_batch,
}
"""System name (``--systems``) -> its run function, in the order they run."""

DEFAULT_SYSTEMS = [name for name in SYSTEMS if name != "torchrec_dmp_batch"]
"""What ``benchmarks.run`` runs without ``--systems``."""

__all__ = ["DEFAULT_SYSTEMS", "SYSTEMS"]
