"""Imported by the fork server of a job's workers (:mod:`hybrid.launch.workers`) before anything
else, and by no other process: the server ends with the process that started it (``hybrid
launch``, or torchrun's agent under ``python -m hybrid.launch.torchrun``), and it and each process
it forks get sessions of their own.

- The server asks the kernel for SIGKILL when the process that started it dies (Linux's
  parent-death signal), as each worker does for its parent (:func:`hybrid.launch.init.end_with_the_agent`)
  and ``hybrid launch``'s agent does (:func:`hybrid.launch.workers.run_agent`), here the server:
  a launcher killed outright (``kill -9``, the OOM killer) takes the server and so the agent and
  every worker with it. ``multiprocessing``'s own end of the server, when its
  client's pipe closes, never comes while workers live: each holds a copy of that pipe.
- torchrun starts its workers in sessions of their own (and stops one by signalling its process
  group), so that a signal to the launcher's group -- Ctrl-C in a terminal, a closed terminal's
  SIGHUP, a scheduler's SIGTERM -- reaches the launcher alone, and torchrun stops the workers
  itself, each with the time to say why. The fork server would otherwise share the launcher's
  group: SIGHUP or SIGTERM would end it there, and with it every worker, at once and silently. A
  worker's new session is made in the child right after the fork; torchrun may have its pid a
  moment before, and a signal it sends then goes to the worker itself
  (:func:`hybrid.launch.workers.install`).
- A process forked after its parent initialized CUDA cannot use it, and
  ``torch.cuda.is_available()`` initializes it, unless ``PYTORCH_NVML_BASED_CUDA_CHECK=1`` has it
  ask NVML instead (torch's documented way not to "poison" a fork); fbgemm_gpu asks at import.
  The server sets it for its own imports; a worker gets its command's environment back
  (:func:`hybrid.launch.workers._worker`).
"""

import os
import signal

# A session of its own first: importing torch takes seconds, and a Ctrl-C to the launcher's group
# meanwhile would interrupt the import here (a KeyboardInterrupt's traceback) besides the launcher.
if os.getpid() != os.getsid(0):
    os.setsid()
os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"  # before torch: see above

from hybrid import ops  # noqa: E402 - after the session and the variable

if ops.die_with_parent(int(signal.SIGKILL)) and os.getppid() == 1:  # the agent is gone already
    os.kill(os.getpid(), signal.SIGKILL)
_SERVER = os.getpid()


# SIGINT ends each process forked here at once and silently, as SIGTERM does (a worker keeps it
# so: hybrid.train.loop), from its first instant: multiprocessing ignores it in the server and
# gives each child this disposition back, and a SIGINT that comes meanwhile waits, blocked.
signal.signal(signal.SIGINT, signal.SIG_DFL)
signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGINT])


def _own_session() -> None:
    if os.getppid() == _SERVER:  # forked by the server (not by a worker: its own children stay its)
        os.setsid()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])


os.register_at_fork(after_in_child=_own_session)
