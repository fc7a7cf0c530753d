"""``hybrid train``: one process of a run, as a trainer or a parameter server.

Every process loads the plan and the training config, checks the plan against the model (so a
mistake ends every process with the same message, exit code 2), takes its role from its rank
(the last ``topology.parameter_servers`` ranks are servers), and joins RPC (and, on trainers,
the trainers' process group). Servers then just serve (:mod:`hybrid.launch.serve`); trainers
build the model, its task and its data from the config's :class:`~hybrid.train.ModelSpec`
(:func:`build_trainer`) and run :class:`Trainer`, which takes them as objects. The end is
ordered: trainers finish their last push, meet at a barrier, trainer 0 releases the servers,
and everyone shuts down.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import json
import logging
import math
import os
import signal
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import hybrid
from hybrid.data import Batch, check_files, make_dataset
from hybrid.errors import EXIT_FAILED, EXIT_USAGE, InputError, UserCodeError, exit_status, print_error, remove_at_exit
from hybrid.launch.init import init_hybrid, shutdown, trainer_device
from hybrid.launch.roles import Role, role_of
from hybrid.launch.failure import fail
from hybrid.launch.serve import release_servers, serve
from hybrid.log import init_logging, logger
from hybrid.plan import Plan, PlanError, ResolvedPlan, load_plan, resolve, summarize
from hybrid.ps.client import RemoteCollection, RemoteTable, pipeline_of
from hybrid.train import metrics as M
from hybrid.train.config import RunConfig, config_dict, load_config
from hybrid.train.report import MetricsWriter, fmt, table
from hybrid.train.spec import meta_model
from hybrid.train.tasks import Task

EXIT_OK = 0
PLAN_PREFIX = "plan."


class NonFiniteBatch(InputError):
    """A batch with NaN or inf in its dense features or labels (``train.nonfinite: error``)."""


def split_overrides(overrides: Sequence[str]) -> tuple[list[str], list[str]]:
    """``plan.``-prefixed overrides go to the plan (prefix removed), the rest to the config."""
    plan = [o[len(PLAN_PREFIX):] for o in overrides if o.startswith(PLAN_PREFIX)]
    config = [o for o in overrides if not o.startswith(PLAN_PREFIX)]
    return plan, config


def load_run(plan_path: str, config_path: str | None, overrides: Sequence[str], world_size: int, *,
             model: str | None = None) -> tuple[Plan, RunConfig, nn.Module, ResolvedPlan]:
    """Plan + config + the model they describe, checked against each other and the world size.

    ``model`` (``--model``) names the model over the config's and the plan's (see
    :func:`~hybrid.train.config.load_config`). The model is built on the meta device here (shapes
    only, when its builder takes ``device``), for the check; raises PlanError, or UserCodeError
    when the builder itself fails.
    """
    plan_over, config_over = split_overrides(overrides)
    plan = load_plan(plan_path, plan_over, prefix=PLAN_PREFIX)
    cfg = load_config(config_path, config_over, model=plan.model, model_flag=model, plan_source=plan.where("model"))
    meta = meta_model(cfg.spec, cfg.model_kwargs, name=cfg.model_name, locate=cfg.where)
    resolved = resolve(plan, meta, world_size=world_size)
    _check_data_files(cfg, meta)
    return plan, cfg, meta, resolved


def checkpoint_start(cfg: RunConfig, *, key: bytes | None):
    """The checkpoint a run resumes from (``checkpoint.resume``; ``None``: step 0), with
    ``checkpoint.dir`` checked for it: it can be made and written, and holds no checkpoint of
    another run that the run's saves would overwrite or prune. Raises ``CheckpointError`` naming
    the key; the launcher calls it before any process starts, every trainer before its first step."""
    from hybrid.checkpoint import find_resume
    from hybrid.checkpoint.files import CheckpointError, refuse_overwrite

    ck = cfg.checkpoint
    try:
        resume = find_resume(ck.resume, ck.dir, key=key)
    except CheckpointError as e:
        raise CheckpointError(f"checkpoint.resume={ck.resume}: {e}") from None
    if ck.dir:
        path = Path(ck.dir).expanduser()
        _writable_folder(path, f"checkpoint.dir {ck.dir}", CheckpointError)
        refuse_overwrite(path, resume.step if resume is not None else 0, resumed=resume is not None)
    return resume


def check_out_dir(cfg: RunConfig) -> None:
    """``train.out_dir`` is a folder this process can write in, made if missing. Raises
    ``InputError`` naming the key; the launcher calls it before any process starts, trainer 0
    before it writes there."""
    _writable_folder(cfg.out_dir, f"train.out_dir {cfg.out_dir}", InputError)


def _writable_folder(path: Path, what: str, error: type[Exception]) -> None:
    """Make folder ``path`` if missing and check that this process can write in it; else raise
    ``error`` whose message starts with ``what`` (the key and its value)."""
    if path.exists() and not path.is_dir():
        raise error(f"{what}: a file is there, not a folder")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise error(f"{what}: cannot create it ({e.strerror or e})") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise error(f"{what}: not writable by this process")


def _check_data_files(cfg: RunConfig, meta: nn.Module) -> None:
    """The data files exist, can be read, are not empty and have the named columns (PlanError,
    located at the data.* key its message starts with, if any: its line or its override)."""
    try:
        check_files(cfg.spec.data_schema(meta), cfg.data)
    except ValueError as e:  # InputError (a file) or a data.* key that names no usable file
        key = str(e).partition(":")[0]
        named = key.startswith("data.") and key[len("data."):] in {f.name for f in dataclasses.fields(cfg.data)}
        raise PlanError(str(e), category="io", where=cfg.where(key) if named else "") from None


def main(plan_path: str, config_path: str | None, overrides: Sequence[str], *, model: str | None = None) -> int:
    """Entry of ``hybrid train``: one process started by torchrun (RANK, WORLD_SIZE, MASTER_*),
    or, without torchrun (no RANK), the whole job in this one process: one trainer that holds
    every ``parameter_server`` table itself (one-process mode, :attr:`ResolvedPlan.in_process`)."""
    if "RANK" not in os.environ:
        return _main_one_process(plan_path, config_path, overrides, model=model)
    missing = [k for k in ("WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        print(f"error: hybrid train under torchrun misses {', '.join(missing)} in the environment; "
              f"start it with `hybrid launch -n N train ...` or `torchrun --nproc-per-node N -m hybrid.cli train ...`",
              file=sys.stderr)
        return EXIT_USAGE
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    # Ctrl-C ends a worker as SIGTERM does, at once and silently (no KeyboardInterrupt unwinding
    # through RPC's and gloo's threads); the launcher says so in one line.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    init_logging(f"rank{rank}")
    _quiet_known_warnings()
    try:
        plan, cfg, _, resolved = load_run(plan_path, config_path, overrides, world_size, model=model)
    except (PlanError, UserCodeError) as e:
        if rank == 0:
            print_error(e)
        return exit_status(e)
    role = role_of(rank, world_size, resolved.num_servers)
    init_logging(role.name)
    _name_process(role.name)
    return run_process(role, plan, cfg, resolved, init_method="env://")


def _main_one_process(plan_path: str, config_path: str | None, overrides: Sequence[str], *,
                      model: str | None) -> int:
    """The job in this process: a world of one trainer, its process group and RPC agent on a
    file store of its own (no port), the tables held here."""
    import tempfile

    signal.signal(signal.SIGINT, signal.SIG_DFL)
    init_logging("trainer0")
    _quiet_known_warnings()
    try:
        plan, cfg, _, resolved = load_run(plan_path, config_path, overrides, 1, model=model)
    except (PlanError, UserCodeError) as e:
        print_error(e)
        return exit_status(e)
    if plan.topology.parameter_servers and resolved.in_process:
        logger.info("one process: the %d parameter server(s) of the plan are held in this trainer",
                    plan.topology.parameter_servers)
    with tempfile.TemporaryDirectory(prefix="hybrid-one-") as tmp:
        remove_at_exit(tmp)  # a run that fails ends at once (hybrid.launch.failure), past this block
        return run_process(role_of(0, 1, 0), plan, cfg, resolved, init_method=f"file://{tmp}/store")


def _quiet_known_warnings() -> None:
    """Silence torch warnings that every run would print and that say nothing about the run."""
    import warnings

    warnings.filterwarnings("ignore", message="You are using a Backend .* as a ProcessGroup")
    logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", category=DeprecationWarning, module="fbgemm_gpu")


def _name_process(name: str) -> None:
    """The process's name (``ps``, ``top``, ``/proc/PID/comm``) becomes its role, e.g. ``trainer1``
    or ``ps0``: a job's processes all run the same interpreter and command otherwise."""
    try:
        with open("/proc/self/comm", "w") as f:  # the main thread's name is the process's (Linux)
            f.write(name[:15])
    except OSError:
        pass


def run_process(role: Role, plan: Plan, cfg: RunConfig, resolved: ResolvedPlan, *, init_method: str) -> int:
    """Join the job as ``role``, do its part, shut down in order; returns the exit code.

    A failure ends the process at once (:func:`hybrid.launch.failure.fail`): one line, exit code
    2 for a mistake the user can fix (data, checkpoint, address), 1 otherwise.
    """
    from hybrid.checkpoint import CheckpointError

    options = cfg.runtime
    try:
        init_hybrid(role, init_method=init_method, backend=plan.topology.backend, options=options)
    except PlanError as e:  # runtime.address on a machine without hybrid._C's transport
        fail(role, e, user_error=True)
    except Exception as e:  # noqa: BLE001
        from hybrid.launch.address import link_down

        down = link_down(options.address)  # torch's own message then names an address it could not reach, not why
        logger.error("%s could not join the job: %s%s", role.name, f"{down}: " if down else "", e)
        return EXIT_FAILED
    try:
        if role.is_trainer:
            build_trainer(role, plan, cfg, resolved).run()
        else:
            serve(role, heartbeat_s=options.heartbeat_s, timeout_s=options.rpc_timeout_s)
    except (CheckpointError, InputError, PlanError) as e:  # PlanError: a server's tables do not fit
        fail(role, e, user_error=True)
    except Exception as e:  # noqa: BLE001
        fail(role, e, user_error=False)
    try:
        shutdown(role, graceful=True, timeout_s=options.shutdown_timeout_s)
    except Exception as e:  # noqa: BLE001 - a peer that died or hangs while the processes leave
        fail(role, e, user_error=False)
    return EXIT_OK


def dense_optimizer(name: str, params, lr: float) -> torch.optim.Optimizer:
    from torch.distributed.tensor import DTensor

    params = [p for p in params if p.requires_grad]
    # torch's multi-tensor (foreach) kernels, its default on GPUs, take a list of DTensors (FSDP2's
    # parameters) or of plain tensors (DDP's), not both: a model with both steps tensor by tensor.
    opts = {"foreach": False} if len({isinstance(p, DTensor) for p in params}) > 1 else {}
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, **opts)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr, **opts)
    return torch.optim.Adagrad(params, lr=lr, **opts)


def remote_collections(model: nn.Module) -> list[RemoteCollection]:
    out = []
    for m in model.modules():
        if isinstance(m, RemoteCollection):
            out.append(m)
        elif isinstance(m, RemoteTable):
            out.append(m.collection)
    return out


@dataclasses.dataclass
class _Drawn:
    """One training batch as drawn: the batch (on the host as :meth:`Trainer._batches` yields it,
    on the trainer's device once :meth:`Trainer._draw` took it), this trainer's share of the
    step's loss, its place in the data (epoch, batch, and the records of the epoch before it) and
    the batches skipped through it (NaN/inf)."""

    batch: Any
    share: float
    pos: tuple[int, int, int]
    skipped: int


@dataclasses.dataclass
class _Window:
    """Sums over the steps since the last train row."""

    steps: int = 0
    samples: int = 0
    loss: float = 0.0
    data: float = 0.0
    lookup: float = 0.0
    dense: float = 0.0
    push: float = 0.0
    optimizer: float = 0.0
    wall: float = 0.0


def model_seed(cfg: RunConfig) -> int:
    """The seed of the model's initial weights: ``model.seed`` if given, else ``train.seed``."""
    return int(cfg.model_kwargs.get("seed", cfg.train.seed) or 0)


def build_trainer(role: Role, plan: Plan, cfg: RunConfig, resolved: ResolvedPlan) -> Trainer:
    """The trainer ``hybrid train`` runs: the model, its task and trainer ``role.index``'s share
    of the data, built from the config's :class:`~hybrid.train.ModelSpec` and ``data`` section."""
    spec = cfg.spec
    # On meta when the builder takes ``device``: no table is ever allocated on a trainer (the
    # servers fill theirs from the seed; a checkpoint replaces them on resume) and compose
    # materializes the dense part from the same seed on every trainer.
    model = spec.make_model(cfg.model_kwargs, seed=model_seed(cfg), device=torch.device("meta"), name=cfg.model_name)
    schema = spec.data_schema(model)
    n, me = role.num_trainers, role.index
    return Trainer(role, plan, cfg, resolved, model=model, task=spec.make_task(temperature=cfg.train.temperature),
                   train_data=make_dataset(schema, cfg.data, split="train", rank=me, world_size=n,
                                           stats_dir=cfg.out_dir),
                   eval_data=make_dataset(schema, cfg.data, split="eval", rank=me, world_size=n,
                                          stats_dir=cfg.out_dir))


class Trainer:
    """The training loop of one trainer: compose, train, evaluate, report.

    Args:
        role: this trainer's role in the job.
        plan, resolved: the plan, and the plan resolved against the model (for the record).
        cfg: the training config: ``train``, ``checkpoint`` and ``runtime`` options.
        model: the plain model (the same initial weights on every trainer); composed here.
        task: what a step computes (:class:`~hybrid.train.tasks.Task`).
        train_data: this trainer's training batches (:class:`~hybrid.data.Batch`), one pass
            per ``iter()``; every trainer yields as many. Passes repeat until ``train.steps``
            (or ``train.epochs``).
        eval_data: this trainer's held-out batches, read in full at every evaluation.

    Batches go to the trainer's device as they are drawn (pinned, copied without blocking, on
    a GPU trainer); on the CPU they are used as they come.
    """

    def __init__(self, role: Role, plan: Plan, cfg: RunConfig, resolved: ResolvedPlan, *, model: nn.Module,
                 task: Task, train_data: Iterable[Batch], eval_data: Iterable[Batch]) -> None:
        self.role, self.plan, self.cfg = role, plan, cfg
        self.t = cfg.train
        self.rank0 = role.index == 0
        self.task = task
        self.device = trainer_device()
        # Checkpoint to resume from (hybrid.checkpoint), found before composing: its step numbers
        # the trainers' runtime and the servers' step bookkeeping, and its tables replace the init.
        self._ckpt_key = self._checkpoint_key()
        self.resume = checkpoint_start(cfg, key=self._ckpt_key)
        self.start_step = self.resume.step if self.resume is not None else 0
        self.model = hybrid.compose(model, resolve(plan, model, world_size=role.world_size), role=role,
                                    runtime_options=cfg.runtime, start_step=self.start_step,
                                    init_tables="server" if self.resume is not None else "auto",
                                    seed=model_seed(cfg))
        self.optimizer = dense_optimizer(self.t.optimizer, self.model.parameters(), self.t.lr)
        self.remotes = remote_collections(self.model)
        self.staleness = plan.sync.staleness
        self.train_data, self.eval_data = train_data, eval_data
        self.out_dir = cfg.out_dir
        if self.rank0:
            check_out_dir(cfg)
        try:
            # A resumed run continues the metrics of the run it resumes, when it writes to the same place.
            self.writer = (MetricsWriter(self.out_dir, tensorboard=self.t.tensorboard,
                                         resume_step=self.start_step if self.resume is not None else None)
                           if self.rank0 else None)
        except OSError as e:
            raise InputError(f"train.out_dir {self.out_dir}: cannot write {e.filename or 'there'} "
                             f"({e.strerror or e})") from None
        self.skipped = 0
        self.evals: list[dict[str, Any]] = []
        if self.rank0:
            (self.out_dir / "config.json").write_text(json.dumps(
                {"config": config_dict(cfg), "plan_source": plan.source, "processes": summarize(resolved)},
                indent=2, default=str))
        self._global_batch = role.num_trainers * cfg.data.batch_size
        self._data_start: tuple[int, int] = (0, 0)  # (epoch, batch) of the first training batch
        self._record_start: int | None = None  # the records of its epoch before it, when a checkpoint says
        self._resume_at: dict[str, Any] | None = None  # where the files' chunk holding that record starts
        # (epoch, batch, records of the epoch before it) of the last batch handed out
        self._data_pos: tuple[int, int, int] = (0, -1, -self._global_batch)
        self._coming: collections.deque[_Drawn] = collections.deque()  # drawn for a prefetch, not yet taken
        self._draw_error: Exception | None = None  # what drawing one of them raised, for its step to raise
        self._last_saved: int | None = None
        if self.resume is not None:
            self._restore(self.resume)

    # -- data ------------------------------------------------------------------------------------
    def _passes(self) -> Iterator[tuple[tuple[int, int, int], Any]]:
        """Every training batch the data gives from the run's start (a resumed run's data
        position), with its place (epoch, batch, records of the epoch before it): passes over the
        data until ``train.epochs``.

        A resumed run starts file readers (``start_record``) at the record the checkpoint's run
        stopped at, whatever its number of trainers and batch size, reading from where the
        checkpoint says that record's chunk starts (``resume_at``) when it can; a synthetic stream
        (``start``) at the same batch number; any other data by passing over as many batches."""
        data, gb = self.train_data, self._global_batch
        epoch, first = self._data_start
        records = self._record_start if self._record_start is not None else first * gb
        by_record = isinstance(getattr(data, "start_record", None), int)
        at = self._resume_at
        while True:
            produced = False
            base = 0
            if by_record:
                data.start_record, data.epoch, data.resume_at, at = records, epoch, at, None
                base = first = records // gb
            elif first and isinstance(getattr(data, "start", None), int):
                data.start = base = first  # synthetic: the stream starts at any batch
            for index, batch in enumerate(data, start=base):
                produced = True
                if index < first:
                    continue  # batches a resumed checkpoint already trained on
                yield (epoch, index, records + (index - base) * gb), batch
            # A resumed run that stopped at the end of a pass starts the next one.
            produced = produced or (by_record and records > 0 and data.counts["good"] > 0)
            epoch, first, records = epoch + 1, 0, 0
            if not produced:
                raise InputError(f"{self.role.name}: the training data yielded no batch of data.batch_size="
                                 f"{self.cfg.data.batch_size} samples per trainer (no samples, or fewer than "
                                 f"one batch for every trainer)")
            if self.t.epochs and epoch >= self.t.epochs:
                return
            if hasattr(self.train_data, "restart"):
                self.train_data.restart()

    def _batches(self) -> Iterator[_Drawn]:
        """The batches the loop trains on, each with this trainer's share of the step's loss (on
        the host: :meth:`_take` moves it to the device): one a step, or fewer when ``epochs``
        passes end first (a resumed run with no step left still draws the first, for its final
        checkpoint's data position).

        A batch with NaN/inf is refused or skipped by every trainer together, so the trainers
        never disagree on which step a batch is: they draw ``data.read_ahead`` batches at a time
        and agree on them in one small all-reduce (which also adds up each step's samples), one
        collective per group instead of one a step. A refused batch raises when its step comes.
        The share is ``trainers x samples here / samples of the step``: 1 when every trainer has
        a full batch; an unevenly split last batch (``data.drop_last: false``) weighs each
        trainer's mean loss by its samples, so that the trainers' averaged gradients are those of
        the mean over the whole step, as one process computes it.
        """
        passes = self._passes()
        limit = max(1, self.t.steps - self.start_step)
        taken, skipped = 0, self.skipped
        while taken < limit:
            # As many as the steps left need: every trainer draws groups of the same sizes, since
            # they agree on every batch's fate.
            group = list(itertools.islice(passes, min(self.cfg.data.read_ahead, limit - taken)))
            if not group:
                return
            # On the trainer's device: the trainers' group may be NCCL, which has no CPU tensors.
            counts = torch.tensor([[0.0 if self._finite(b) else 1.0, float(len(b))] for _, b in group],
                                  dtype=torch.float64, device=self.device)
            dist.all_reduce(counts)
            for ((pos, batch), (bad, samples)) in zip(group, counts.tolist()):
                if bad:
                    if self.t.nonfinite == "error":
                        raise NonFiniteBatch(
                            f"{self.role.name}: a training batch holds NaN or inf in its dense features or "
                            f"labels (step {self.start_step + taken}); set train.nonfinite=skip to skip such "
                            f"batches")
                    skipped += 1
                    continue
                yield _Drawn(batch, self.role.num_trainers * len(batch) / samples, pos, skipped)
                taken += 1

    def _take(self, batches: Iterator[_Drawn]) -> tuple[Any, float] | None:
        """The next batch (on the trainer's device) and its loss share, or None; the data position
        and the skipped count move to it (what a checkpoint saved now records)."""
        if self._coming:
            d = self._coming.popleft()
        elif self._draw_error is not None:
            raise self._draw_error
        else:
            d = self._draw(batches)
        if d is None:
            return None
        self._data_pos, self.skipped = d.pos, d.skipped
        return d.batch, d.share

    def _draw(self, batches: Iterator[_Drawn]) -> _Drawn | None:
        d = next(batches, None)
        return None if d is None else dataclasses.replace(d, batch=self._on_device(d.batch))

    def _after_next(self, batches: Iterator[_Drawn], n: int) -> list[Any]:
        """The ``n`` batches after the next one, or as many as are left: drawn now (for their
        prefetch) and taken by their steps, so the data position stays the next batch's."""
        while len(self._coming) < n and self._draw_error is None:
            try:
                d = self._draw(batches)
            except Exception as e:  # noqa: BLE001 - a refused or unreadable batch fails at its own step
                self._draw_error = e
                break
            if d is None:
                break
            self._coming.append(d)
        return [d.batch for d in itertools.islice(self._coming, n)]

    @staticmethod
    def _finite(batch) -> bool:
        return bool(torch.isfinite(batch.dense).all()) and bool(torch.isfinite(batch.labels).all())

    def _on_device(self, batch: Batch) -> Batch:
        """``batch`` on the trainer's device: pinned, then copied without blocking, so the copy
        of the next batch overlaps this step's work (a CPU trainer uses it as it is)."""
        if self.device.type == "cpu":
            return batch
        return batch.pin_memory().to(self.device, non_blocking=True)

    # -- the loop --------------------------------------------------------------------------------
    def run(self) -> None:
        t = self.t
        self.step = self.start_step
        window = _Window()
        batches = self._batches()
        nxt = self._take(batches)
        if t.eval_every and self.resume is None:
            self._evaluate()  # the untrained model's numbers, for comparison
        bar = self._progress()
        started = time.perf_counter()
        servers_before = self._server_stats()
        train_time = 0.0
        last_loss = float("nan")
        prev_times = None
        while nxt is not None and self.step < t.steps:
            batch, share = nxt
            t0 = time.perf_counter()
            with hybrid.step(self.model, self.optimizer) as s:
                outputs = self.task.forward(self.model, batch)
                td = time.perf_counter()
                nxt = self._take(batches)  # None after the last step's batch: _batches knows how many
                later = self._after_next(batches, max(s.prefetch_depth - 1, 0)) if nxt is not None else []
                data_time = time.perf_counter() - td
                if nxt is not None:
                    # The next step's rows travel while this one computes (sync: they are read
                    # once this step is applied, and asked for with this step's gradient push);
                    # in async mode, on CPU under DDP, the step after's too (s.prefetch_depth).
                    s.prefetch(nxt[0].sparse, *(b.sparse for b in later))
                loss = self.task.loss(outputs, batch)
                if share != 1.0:
                    loss = loss * share
                s.backward(loss)
            wall = time.perf_counter() - t0
            train_time += wall
            self.step += 1
            times = s.times
            window.steps += 1
            window.samples += len(batch)
            window.loss += float(loss.detach())
            window.data += data_time
            window.lookup += times.lookup
            window.dense += times.dense - data_time
            # A step's push is waited for when the next step begins: count it one step late.
            window.push += prev_times.push if prev_times is not None else 0.0
            prev_times = times
            window.optimizer += times.optimizer
            window.wall += wall
            if bar is not None:
                bar.update(1)
            if self.step % t.log_every == 0 or self.step == t.steps or nxt is None:
                last_loss = self._log_train(window)
                if bar is not None:
                    bar.set_postfix(loss=f"{last_loss:.4f}")
                window = _Window()
            if t.eval_every and self.step % t.eval_every == 0 and self.step < t.steps and nxt is not None:
                self._evaluate()
            if self.cfg.checkpoint.dir and self.cfg.checkpoint.every and self.step % self.cfg.checkpoint.every == 0:
                self._save(nxt)
        if bar is not None:
            bar.close()
        pipeline = pipeline_of(self.model)
        if pipeline is not None:
            pipeline.flush()
        # Read once every push is in (the counters cover every step), before the last evaluation
        # and checkpoint (the servers' CPU covers the steps, and what ran between them).
        stats = self._server_stats()
        _cpu_per_step(stats, servers_before, started, time.perf_counter())
        self._evaluate()
        if self.cfg.checkpoint.dir and self._last_saved != self.step:
            self._save(nxt)  # nxt: None, or the first batch when a resumed run had no step left
        total = time.perf_counter() - started
        self.finish(train_time=train_time, total=total, last_loss=last_loss, stats=stats)

    # -- checkpoints (hybrid.checkpoint) ---------------------------------------------------------
    def _checkpoint_key(self) -> bytes | None:
        from hybrid.checkpoint.files import checkpoint_key

        return checkpoint_key(self.cfg.checkpoint.key_file)

    def _restore(self, ckpt) -> None:
        """Model, optimizers, tables (by the servers), step numbering, RNG, data position."""
        ckpt.restore(self.model, self.optimizer)
        state = ckpt.train_state
        self._data_start = tuple(state.get("data", (0, 0)))
        # The data's records before the next batch; without them (an older checkpoint) the batch
        # number times this run's global batch.
        self._record_start = state.get("records")
        self._resume_at = state.get("data_at")
        self.skipped = int(state.get("skipped", 0))
        if self.cfg.checkpoint.dir and ckpt.path.parent == Path(self.cfg.checkpoint.dir).resolve():
            self._last_saved = ckpt.step  # it is already there: do not write the same step again
        if self.rank0:
            where = (f"record {self._record_start:,}" if isinstance(getattr(self.train_data, "start_record", None), int)
                     and self._record_start is not None else f"batch {self._data_start[1]}")
            if (at := self._resume_at) is not None and getattr(self.train_data, "can_seek", False):
                where += (f", read from {at['path']} " + (f"byte {at['offset']:,}" if "offset" in at else
                                                          f"row {at['row'] + 1:,}"))
            logger.info("resuming at step %d from %s (data at epoch %d, %s)", ckpt.step, ckpt.path,
                        self._data_start[0], where)

    def _save(self, nxt) -> None:
        """Checkpoint after ``self.step`` steps; ``nxt`` is the batch already drawn for the next one."""
        from hybrid.checkpoint import save

        epoch, index, records = self._data_pos
        if nxt is None:  # the next batch is the one after the last handed out
            index, records = index + 1, records + self._global_batch
        state = {"data": [epoch, index], "records": records, "skipped": self.skipped}
        seek_point = getattr(self.train_data, "seek_point", None)
        if seek_point is not None and (at := seek_point(epoch, records)) is not None:
            state["data_at"] = at  # a resumed run reads its files from there
        ck = self.cfg.checkpoint
        save(ck.dir, self.step, self.model, self.optimizer, keep=ck.keep, train_state=state, key=self._ckpt_key)
        self._last_saved = self.step

    def _progress(self):
        if not (self.rank0 and self.t.progress):
            return None
        try:
            from tqdm import tqdm
        except ImportError:
            return None
        return tqdm(total=self.t.steps, desc=f"train {self.cfg.model_name}", unit="step", dynamic_ncols=True,
                    file=sys.stderr, mininterval=1.0)

    def _log_train(self, w: _Window) -> float:
        """One train row: losses and times averaged over the window and the trainers."""
        sums = torch.tensor([w.loss, w.samples, w.data, w.lookup, w.dense, w.push, w.optimizer, w.wall],
                            dtype=torch.float64, device=self.device)
        dist.all_reduce(sums)
        n = self.role.num_trainers
        loss, samples, data, lookup, dense, push, opt, wall = sums.tolist()
        per_step = lambda x: 1000 * x / (w.steps * n)  # noqa: E731 - milliseconds per step, mean over trainers
        row = {
            "kind": "train", "step": self.step, "loss": loss / (w.steps * n),
            "samples_per_s": samples / (wall / n) if wall > 0 else float("nan"),
            "step_ms": per_step(wall), "data_ms": per_step(data), "lookup_ms": per_step(lookup),
            "dense_ms": per_step(dense), "push_ms": per_step(push), "optimizer_ms": per_step(opt),
            "skipped_batches": self.skipped,
        }
        if self.writer is not None:
            self.writer.write(row)
        return row["loss"]

    @torch.no_grad()
    def _evaluate(self) -> None:
        """Metrics on the held-out data, over every trainer's share (everyone gets the same numbers)."""
        self.model.eval()
        outs: dict[str, list[torch.Tensor]] = {}
        for batch in map(self._on_device, self.eval_data):
            o = self.task.eval_outputs(self.task.forward(self.model, batch), batch)
            for k, v in o.items():
                outs.setdefault(k, []).append(v)
        self.model.train()
        if not outs:
            return
        result = M.compute(outs, ks=list(self.t.recall_k))
        # Every eval row has a loss column (NaN where the task's outputs give none, as for
        # retrieval, whose in-batch loss is not what its metrics need).
        result.setdefault("loss", float("nan"))
        row = {"kind": "eval", "step": self.step, **result}
        self.evals.append(row)
        if self.writer is not None:
            self.writer.write(row)
            shown = ", ".join(f"{k} {fmt(v)}" for k, v in result.items() if k != "candidates")
            logger.info("eval at step %d: %s", self.step, shown)

    def _server_stats(self) -> dict[str, dict]:
        """Each server's counters, summed over the collections (trainer 0; empty elsewhere)."""
        return merge_server_stats([r.stats() for r in self.remotes]) if self.rank0 else {}

    def finish(self, *, train_time: float, total: float, last_loss: float, stats: dict[str, dict]) -> None:
        """Close the step pipeline, barrier, release the servers (trainer 0), then the summary and
        the files."""
        pipeline = pipeline_of(self.model)
        if pipeline is not None:
            pipeline.close()
        dist.barrier()
        if self.rank0:
            release_servers(self.role, self.cfg.runtime.rpc_timeout_s)
        if self.writer is None:
            return
        self.writer.close()
        last = {k: v for k, v in self.evals[-1].items() if k not in ("kind", "step")} if self.evals else {}
        quality = M.headline(last) or "loss"
        png = self.writer.plot(self.out_dir / "curves.png", quality=quality) if self.t.plot else None
        summary = self._summary(train_time, total, last_loss, stats, png)
        (self.out_dir / "summary.txt").write_text(summary + "\n")
        print(summary, flush=True)

    def _summary(self, train_time, total, last_loss, stats, png) -> str:
        run = self.step - self.start_step  # the steps this run trained: a resumed run starts at its checkpoint's
        samples = run * self.cfg.data.batch_size * self.role.num_trainers
        own = self.writer.own_rows  # the rows of this run's steps
        mean = self.writer.mean
        first_loss = self.writer.first_loss
        first_eval = self.evals[0] if self.evals else {}
        last_eval = self.evals[-1] if self.evals else {}
        lines = [
            ("model", f"{self.cfg.model_name} ({self.task.name}), plan {self.plan.source or '<dict>'}"),
            ("processes", (f"{_plural(self.role.num_trainers, 'trainer')} + "
                           f"{_plural(self.role.num_servers, 'parameter server')}" if self.role.num_servers or
                           not self.remotes else "1 trainer holding the tables (one process)")
                          + f", staleness {self.staleness}"),
            ("steps", f"{self.step} ({samples:,} samples{f' from step {self.start_step}' if self.start_step else ''}, "
                      f"{self.skipped} batches skipped)"),
            ("time", f"{train_time:.1f}s training, {total:.1f}s with evaluation"),
            ("throughput", f"{samples / train_time:,.0f} samples/s" if train_time > 0 and samples else "n/a"),
            ("step time", f"{mean('step_ms'):.1f} ms = data {mean('data_ms'):.1f} + lookup {mean('lookup_ms'):.1f} "
                          f"+ dense fwd/bwd {mean('dense_ms'):.1f} + push {mean('push_ms'):.1f} "
                          f"+ optimizer {mean('optimizer_ms'):.1f} (+ rest)" if own else "n/a"),
            ("train loss", f"{fmt(first_loss) if first_loss is not None else 'n/a'} -> {fmt(last_loss)}"),
        ]
        for k, v in last_eval.items():
            if k in ("kind", "step", "candidates") or (isinstance(v, float) and math.isnan(v)):
                continue
            before = first_eval.get(k)
            shown = f"{fmt(before)} (step {first_eval['step']}) -> {fmt(v)}" if len(self.evals) > 1 else fmt(v)
            lines.append((f"eval {k}", shown))
        for server, d in sorted(stats.items()):
            steps = max(run, 1)  # the servers' counters cover this run's steps
            uniq = d.get("rows_served", 0) / d["ids_requested"] if d.get("ids_requested") else float("nan")
            cpu = (f", CPU {1e3 * d['train_cpu_s'] / steps:.1f} ms/step ({d['train_cpu_share']:.0%} of a core)"
                   if "train_cpu_s" in d else "")
            lines.append((server, f"{d.get('lookups', 0) / steps / self.role.num_trainers:.1f} lookups/step/trainer, "
                                  f"{d.get('bytes_in', 0) / steps / 1024:.1f} KiB in + {d.get('bytes_out', 0) / steps / 1024:.1f} "
                                  f"KiB out per step, unique ids {fmt(uniq) if math.isnan(uniq) else f'{uniq:.2f}'}"
                                  + cpu + _dynamic_counters(d)))
        for r in self.remotes:
            if r.hot_rows is not None:  # this trainer's cache (trainer 0 writes the summary)
                c = r.hot_rows.counters
                lines.append(("hot rows", f"{r.cid}: {c.hit_ratio:.1%} of {c.looked_up:,} rows from "
                                          f"trainer 0's cache, {c.refreshed:,} refreshed, {c.evicted:,} evicted"))
        outputs = ["metrics.jsonl", "metrics.csv", "summary.txt"] + (["curves.png"] if png else [])
        lines.append(("output", f"{self.out_dir}/ ({', '.join(outputs)})"))
        return "== hybrid run summary ==\n" + table(lines)


_PROCESS_WIDE = ("cpu_s", "huge_page_bytes")
"""Server statistics of the whole process, not of one collection."""


def merge_server_stats(collections: list[dict[str, dict]]) -> dict[str, dict]:
    """Each server's statistics from every collection's (``RemoteCollection.stats``): counters
    summed, ``ids: dynamic`` tables' summed as ``dynamic_*``, the process's own
    (:data:`_PROCESS_WIDE`) taken once."""
    out: dict[str, dict] = {}
    for stats in collections:
        for server, d in stats.items():
            agg = out.setdefault(server, {})
            for k, v in d.items():
                if k in _PROCESS_WIDE:  # the server process's, reported by each collection alike
                    agg[k] = v
                elif isinstance(v, (int, float)):
                    agg[k] = agg.get(k, 0) + v
            for table in (d.get("dynamic") or {}).values():  # ids: dynamic tables, summed
                for k in ("rows", "sightings", "admitted", "evicted", "hits", "looked_up"):
                    agg[f"dynamic_{k}"] = agg.get(f"dynamic_{k}", 0) + table[k]
    return out


def _cpu_per_step(stats: dict[str, dict], before: dict[str, dict], since: float, now: float) -> None:
    """Add to each server's ``stats`` the CPU its process spent while the trainers trained
    (``train_cpu_s``, from ``before``'s reading at ``since`` to ``stats``' at ``now``) and that
    time's share of one core (``train_cpu_share``)."""
    for server, d in stats.items():
        start = before.get(server, {}).get("cpu_s")
        if start is None or "cpu_s" not in d:
            continue
        d["train_cpu_s"] = d["cpu_s"] - start
        d["train_cpu_share"] = d["train_cpu_s"] / (now - since) if now > since else 0.0


def _dynamic_counters(d: dict) -> str:
    """The ``ids: dynamic`` counters of one server's summary line (empty without such tables)."""
    if "dynamic_rows" not in d:
        return ""
    hit = d["dynamic_hits"] / d["dynamic_looked_up"] if d["dynamic_looked_up"] else 1.0
    seen = f", {d['dynamic_sightings']:,} ids counted without a row" if d["dynamic_sightings"] else ""
    return (f"; dynamic tables: {d['dynamic_rows']:,} rows, {d['dynamic_admitted']:,} admitted, "
            f"{d['dynamic_evicted']:,} evicted, hit ratio {hit:.3f}{seen}")


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"
