"""Run a module-level function on N real processes (gloo on CPU) and collect results.

``run_distributed(fn, world_size, **kw)`` starts ``world_size`` processes (forked from a server
that imported torch, torchrec and hybrid once: :func:`_context`); each calls
``fn(rank, world_size, **kw)`` after joining a gloo process group over all ranks (``setup="pg"``),
or the hybrid runtime -- RPC for everyone, a trainers' group, roles from ``num_servers``
(``setup="hybrid"``) -- or nothing (``setup="none"``). Rendezvous goes through file stores in a
temp dir, so no port is ever fixed. Each rank's return value comes back in a list.

Failures: a rank that raises is reported with its traceback and role; a run that passes the
timeout is killed (every child, SIGKILL) and reported with each live rank's Python stack, dumped
by faulthandler shortly before the deadline.
"""

from __future__ import annotations

import faulthandler
import inspect
import multiprocessing as mp
import os
import pickle
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.launch import kill_all
from tests.support.sockets import state_of


class DistributedTestError(AssertionError):
    """One or more ranks failed or the run timed out; the message holds every rank's story."""


def _name(rank: int, world_size: int, num_servers: int | None) -> str:
    if num_servers is None:
        return f"rank {rank}"
    from hybrid.launch.roles import role_of

    return f"rank {rank} ({role_of(rank, world_size, num_servers).name})"


def _child(fn, rank, world_size, tmp, setup, num_servers, deadline, env, kwargs) -> None:
    os.environ.update(env)
    timeout = deadline - time.time()
    stack_file = open(Path(tmp) / f"stack{rank}.txt", "w")
    # Dump every thread's stack shortly before the parent kills us, so a hang shows where.
    faulthandler.dump_traceback_later(max(timeout - 2.0, 0.5), file=stack_file, exit=False)
    role = None
    code = 0
    try:
        import torch.distributed as dist

        if setup == "pg":
            dist.init_process_group(
                "gloo", init_method=f"file://{tmp}/pg", rank=rank, world_size=world_size
            )
        elif setup == "hybrid":
            from hybrid.launch.init import RuntimeOptions, init_hybrid
            from hybrid.launch.roles import role_of
            from hybrid.log import init_logging

            role = role_of(rank, world_size, num_servers)
            init_logging(role.name)
            init_hybrid(
                role,
                init_method=f"file://{tmp}/rpc",
                backend="gloo",
                options=kwargs.pop("_runtime", None) or RuntimeOptions(rpc_timeout_s=timeout),
            )
        if num_servers is not None and "num_servers" in inspect.signature(fn).parameters:
            kwargs["num_servers"] = num_servers
        result = fn(rank, world_size, **kwargs)
        with open(Path(tmp) / f"result{rank}.pkl", "wb") as f:
            pickle.dump(result, f)
    except BaseException:
        code = 1
        (Path(tmp) / f"error{rank}.txt").write_text(traceback.format_exc())
    finally:
        try:
            if setup == "pg":
                import torch.distributed as dist

                if dist.is_initialized():
                    dist.destroy_process_group()
            elif setup == "hybrid" and role is not None:
                from hybrid.launch.init import shutdown

                shutdown(role, graceful=code == 0, timeout_s=timeout)
        except BaseException:
            if code == 0:
                code = 1
                (Path(tmp) / f"error{rank}.txt").write_text(traceback.format_exc())
        faulthandler.cancel_dump_traceback_later()
        stack_file.close()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


PRELOAD = ["torch", "torch.distributed.rpc", "torch.distributed.fsdp", "torchrec", "hybrid.compose",
           "hybrid.launch.init", "tests.support.sparse"]
"""What the ranks' fork server imports once, before it forks any rank."""


def _context(start: str) -> mp.context.BaseContext:
    """``start="spawn"``: each rank is a fresh interpreter. Tests that use CUDA need it: the fork
    server's imports ask torch how many GPUs there are, and CUDA cannot be used in a process forked
    after that.

    Otherwise ranks fork from a server process that imported torch, torchrec and hybrid once
    (``forkserver`` with preloading): a rank starts in a fraction of a second instead of paying
    the imports again (several seconds of CPU each, the bulk of a short test on 2 cores). The
    server forks before it runs anything else, so a rank shares no threads, process group or RPC
    state; like spawned ranks, they are fresh in everything but the imported modules. The
    server's environment is the test session's at its start (ranks get ``env=`` on top)."""
    if start == "spawn":
        return mp.get_context("spawn")
    assert start == "forkserver", start
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped (SIGSTOP; state ``T`` in /proc)."""
    return state_of(pid) in ("T", "t")


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *,
    setup: str = "pg",
    num_servers: int | None = None,
    timeout: float = 60.0,
    failure_grace: float = 10.0,
    env: dict[str, str] | None = None,
    start: str = "forkserver",
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(rank, world_size, **kwargs)`` on ``world_size`` fresh processes.

    Returns the ranks' return values (index = rank). Raises :class:`DistributedTestError` naming
    every failed or hung rank. After one rank fails, the others get ``failure_grace`` seconds to
    finish before they are killed (a peer's failure often leaves them waiting forever); once only
    stopped ranks (SIGSTOP) are left, they are killed at once.
    """
    assert setup in ("pg", "hybrid", "none"), setup
    if setup == "hybrid" and num_servers is None:
        raise ValueError("setup='hybrid' needs num_servers")
    ctx = _context(start)
    wall_deadline = time.time() + timeout
    with tempfile.TemporaryDirectory(prefix="hybrid-test-") as tmp:
        procs = [
            ctx.Process(
                target=_child,
                args=(fn, r, world_size, tmp, setup, num_servers, wall_deadline, env or {}, dict(kwargs)),
                daemon=False,
            )
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        first_failure: float | None = None
        timed_out = False
        try:
            while any(p.is_alive() for p in procs):
                now = time.monotonic()
                if first_failure is None and any(
                    p.exitcode not in (None, 0) for p in procs
                ):
                    first_failure = now
                if now > deadline or (first_failure and now > first_failure + failure_grace):
                    timed_out = now > deadline
                    break
                if first_failure and all(_stopped(p.pid) for p in procs if p.is_alive()):
                    break  # only stopped ranks (SIGSTOP: a hung peer) are left; none will end by itself
                time.sleep(0.05)
        finally:
            # Give hung ranks' faulthandler a moment, then make sure nothing survives the test.
            kill_all(procs)
        problems = []
        for r, p in enumerate(procs):
            err = Path(tmp) / f"error{r}.txt"
            who = _name(r, world_size, num_servers)
            if err.exists():
                problems.append(f"--- {who} raised (exit code {p.exitcode}):\n{err.read_text()}")
            elif p.exitcode != 0:
                stack = Path(tmp) / f"stack{r}.txt"
                why = (
                    f"did not finish within the {timeout:.0f}s timeout and was killed"
                    if timed_out
                    else f"was killed or exited with code {p.exitcode} "
                    + ("after a peer failed" if first_failure else "")
                )
                text = stack.read_text() if stack.exists() else ""
                problems.append(f"--- {who} {why}." + (f" Its stacks:\n{text}" if text else ""))
        if problems:
            raise DistributedTestError(
                f"{len(problems)} of {world_size} ranks failed:\n" + "\n".join(problems)
            )
        results = []
        for r in range(world_size):
            with open(Path(tmp) / f"result{r}.pkl", "rb") as f:
                results.append(pickle.load(f))
        return results
