"""Fault injection for tests that run the real command line (torchrun's workers).

Python imports ``sitecustomize`` at start-up from the first ``sys.path`` entry that has one, so a
test that puts this folder on ``PYTHONPATH`` gets this file run in every process of the job. With
``HYBRID_TEST_FAULT=RANK:METHOD:N`` the worker of global rank ``RANK`` SIGKILLs itself on the
``N``-th call of ``hybrid.ps.server.CollectionShard.METHOD`` -- only in torchrun's first attempt
(``TORCHELASTIC_RESTART_COUNT`` 0), so the restarted job runs clean. Nothing happens without the
variable, and nothing of this is in the product. With ``HYBRID_TEST_FAULT_SIGNAL=SIGSTOP`` the
worker stops itself instead (a hung process), after printing the time it did.
"""

import os

_spec = os.environ.get("HYBRID_TEST_FAULT", "")
if _spec and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0" and \
        os.environ.get("RANK") == _spec.split(":")[0]:
    import signal
    import sys

    from hybrid.ps import server as _srv

    _rank, _method, _n = _spec.split(":")
    _original = getattr(_srv.CollectionShard, _method)
    _calls = [0]

    _signal = getattr(signal, os.environ.get("HYBRID_TEST_FAULT_SIGNAL", "SIGKILL"))

    def _wrapped(self, *args, **kwargs):
        import time

        _calls[0] += 1
        if _calls[0] >= int(_n):
            verb = "stops" if _signal == signal.SIGSTOP else "kills"
            print(f"fault injection: rank {_rank} {verb} itself in CollectionShard.{_method} (call {_calls[0]}) "
                  f"at {time.time():.3f}", file=sys.stderr, flush=True)
            os.kill(os.getpid(), _signal)
        return _original(self, *args, **kwargs)

    setattr(_srv.CollectionShard, _method, _wrapped)
