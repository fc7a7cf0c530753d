"""Fault injection for tests that run the real command line (torchrun's workers).

Python imports ``sitecustomize`` at start-up from the first ``sys.path`` entry that has one, so a
test that puts this folder on ``PYTHONPATH`` gets this file run in every process of the job: in
each worker torchrun execs, or once in the fork server that ``hybrid launch``'s workers are forked
from (:mod:`hybrid.launch.workers`). The wrapped function therefore reads the worker's environment
(its rank, torchrun's attempt) when it is called, not here. Nothing happens without one of the
variables, and nothing of this is in the product.

- ``HYBRID_TEST_FAULT=RANK:METHOD:N``: the worker of global rank ``RANK`` SIGKILLs itself on the
  ``N``-th call of ``hybrid.ps.server.shard.CollectionShard.METHOD`` -- only in torchrun's first
  attempt (``TORCHELASTIC_RESTART_COUNT`` 0), so the restarted job runs clean. With
  ``HYBRID_TEST_FAULT_SIGNAL=SIGSTOP`` it stops itself instead (a hung process), after printing
  the time it did.
- ``HYBRID_TEST_CHECKPOINT_KILL=WORKER:STEP`` (e.g. ``ps1:20``): that server SIGKILLs itself
  while writing its shards of the checkpoint of step ``STEP``, after one whole file and half of
  the next (a crash mid-save).
"""

import os

_spec = os.environ.get("HYBRID_TEST_FAULT", "")
if _spec:
    import signal
    import sys

    from hybrid.ps.server import shard as _shard

    _rank, _method, _n = _spec.split(":")
    _original = getattr(_shard.CollectionShard, _method)
    _calls = [0]

    _signal = getattr(signal, os.environ.get("HYBRID_TEST_FAULT_SIGNAL", "SIGKILL"))

    def _wrapped(self, *args, **kwargs):
        import time

        if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0" or os.environ.get("RANK") != _rank:
            return _original(self, *args, **kwargs)
        _calls[0] += 1
        if _calls[0] >= int(_n):
            verb = "stops" if _signal == signal.SIGSTOP else "kills"
            print(f"fault injection: rank {_rank} {verb} itself in CollectionShard.{_method} (call {_calls[0]}) "
                  f"at {time.time():.3f}", file=sys.stderr, flush=True)
            os.kill(os.getpid(), _signal)
        return _original(self, *args, **kwargs)

    setattr(_shard.CollectionShard, _method, _wrapped)

_kill = os.environ.get("HYBRID_TEST_CHECKPOINT_KILL", "")
if _kill:
    import signal

    import torch.distributed.rpc as _rpc

    from hybrid.checkpoint import files as _files
    from hybrid.checkpoint import server_io as _io

    _who, _, _at = _kill.partition(":")
    _saved = _io.save_tensors
    _writes = [0]

    def _save_or_die(obj, path):
        info = _rpc.get_worker_info()
        if info.name == _who and f"step_{int(_at):08d}" in str(path):
            _writes[0] += 1
            if _writes[0] == 2:
                data = _files.dumps_plain(obj)
                with open(path, "wb") as f:
                    f.write(data[: len(data) // 2])
                    f.flush()
                    os.fsync(f.fileno())
                os.kill(os.getpid(), signal.SIGKILL)
        return _saved(obj, path)

    _io.save_tensors = _save_or_die
