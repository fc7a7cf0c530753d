"""The ``hybrid`` command. One argparse subcommand per verb; each registers its own handler.

    hybrid plan show PLAN [--model MODEL] [--world-size N] [key=value ...]
    hybrid plan check PLAN [--model MODEL] [--world-size N] [key=value ...]
    hybrid train --plan PLAN [--config CONFIG] [--model MODEL] [key=value ...]  (one process of a job
                                                      under torchrun; without torchrun: the whole job, tables held in-process)
    hybrid launch -n N [--max-restarts K] train --plan PLAN ...     (torchrun on this machine)
    hybrid export CKPT OUT                                          (a checkpoint -> one plain state_dict)

MODEL is ``package.module:attr`` (a :class:`hybrid.train.ModelSpec` or a model builder) or a name
registered in the ``hybrid.models`` entry-point group (:mod:`hybrid.train.spec`).

A new verb (``train``, ``launch``, ``export``) is one ``_add_<verb>_parser(commands)`` function
that sets ``handler`` to its ``_<verb>_main(args) -> int``, plus one line in
:func:`build_parser`. Exit codes: 0 success, 2 a user mistake, printed as ``error: ...`` on
stderr without a traceback (``hybrid --debug COMMAND`` shows it, in every process the command
starts); 1 a failure, such as the model's builder raising (its traceback, then ``error: building
the model ... failed: ...``).
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple, NoReturn

# torch-free: `hybrid launch` checks the plan in a process forked from the workers' server, and
# imports torch (for torchrun) only once the check passed; each verb imports what it needs
from hybrid.errors import (DEBUG_ENV, EXIT_USAGE, InputError, PlanError, UserCodeError, exit_now, exit_status,
                           print_error)
from hybrid.launch.stopping import Stopped, stop_signals_raise

if TYPE_CHECKING:
    from hybrid.plan import Plan

MODEL_HELP = "the model: package.module:attr (a ModelSpec or a builder) or a name registered in hybrid.models"


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``hybrid`` console script; returns the exit code."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # argparse (before 3.12) stops filling a nargs="*" positional at the first option, so
    # overrides written after an option come back unparsed; keep them if they are key=value.
    if extra and hasattr(args, "overrides") and all(_is_override(a) for a in extra):
        args.overrides = [*args.overrides, *extra]
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if not hasattr(args, "handler"):
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    if args.debug:  # the processes a command starts inherit it
        os.environ[DEBUG_ENV] = "1"
    try:
        return args.handler(args)
    except KeyboardInterrupt:  # Ctrl-C in a verb that runs here (export, plan): one line, as a shell's 130
        print(f"hybrid {args.verb}: interrupted", file=sys.stderr)
        return 128 + signal.SIGINT
    except Stopped as e:  # SIGTERM, SIGHUP or SIGQUIT to `hybrid launch` before its agent runs
        print(f"hybrid {args.verb}: stopped by {signal.Signals(e.signum).name}", file=sys.stderr)
        return 128 + e.signum


class _Parser(argparse.ArgumentParser):
    """argparse's parser whose usage errors are one line (its own print the usage first)."""

    def error(self, message: str):  # noqa: ANN201 - never returns
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (--help for the usage)\n")


def build_parser() -> argparse.ArgumentParser:
    """The ``hybrid`` parser with every subcommand registered (subparsers are of its class)."""
    parser = _Parser(
        prog="hybrid", description="Hybrid FSDP/DDP + parameter-server training."
    )
    parser.add_argument("--debug", action="store_true",
                        help="show the traceback of a user error (plan, config, data, checkpoint) too")
    commands = parser.add_subparsers(dest="verb", metavar="COMMAND")
    _add_plan_parser(commands)
    _add_train_parser(commands)
    _add_launch_parser(commands)
    _add_export_parser(commands)
    return parser


_PLAN_ACTIONS = {
    "show": "print which module goes where, with parameters and bytes per trainer/server",
    "check": "validate the plan against the model; exit 0 if it is OK, 2 if not",
}


def _add_plan_parser(commands: argparse._SubParsersAction) -> None:
    plan = commands.add_parser("plan", help="show or check a plan file against a model")
    actions = plan.add_subparsers(dest="action", metavar="ACTION", required=True)
    for action, help_text in _PLAN_ACTIONS.items():
        p = actions.add_parser(action, help=help_text, description=help_text)
        p.add_argument("plan", metavar="PLAN", help="plan YAML, e.g. conf/plans/dlrm.yaml")
        p.add_argument(
            "overrides", nargs="*", default=[], metavar="key=value",
            help="plan overrides, e.g. topology.parameter_servers=2 modules.over_arch.strategy=ddp",
        )  # fmt: skip
        p.add_argument("--model", metavar="MODEL", help=f"{MODEL_HELP} (default: the plan's model)")
        p.add_argument(
            "--config", metavar="CONFIG",
            help="training config whose model section sizes the model, e.g. conf/train/dlrm.yaml "
                 "(default: the builder's defaults)",
        )  # fmt: skip
        p.add_argument(
            "--world-size", type=int,
            help="processes, trainers + servers (default: the plan's world_size)",
        )  # fmt: skip
        if action == "show":
            p.add_argument(
                "--dense-optimizer", default=None, metavar="NAME",
                help="dense optimizer whose state the byte estimates count: sgd, adagrad or adam "
                     "(default: the --config's train.optimizer, else adagrad)",
            )  # fmt: skip
        p.set_defaults(handler=_plan_main)


def _plan_main(args: argparse.Namespace) -> int:
    """``hybrid plan show|check``: load, build the model, resolve, then print the table or OK."""
    from hybrid.plan import format_plan, load_plan, resolve, summarize
    from hybrid.plan.report import dense_optimizer_state
    from hybrid.train.spec import known_models, meta_model, resolve_model

    try:
        if getattr(args, "dense_optimizer", None) is not None:  # `plan show` only
            dense_optimizer_state(args.dense_optimizer, key="--dense-optimizer")
        plan = load_plan(args.plan, args.overrides)
        name, key = (args.model, "--model") if args.model else (plan.model, "model")
        dense_optimizer = "adagrad"
        if args.config:  # the model as a run finds it: --model, else the config's model.name, else the plan's
            from hybrid.train.config import load_config

            cfg = load_config(args.config, model=plan.model, model_flag=args.model, plan_source=plan.where("model"))
            name = cfg.model_name
            model = meta_model(cfg.spec, cfg.model_kwargs, name=name, locate=cfg.where)
            dense_optimizer = cfg.train.optimizer
        else:
            if not name:
                raise PlanError(f"no model: set `model:` in the plan, pass --model (package.module:attr or a "
                                f"registered name: {', '.join(known_models()) or 'none'}) or a --config that names "
                                f"one", category="unknown_model", key="model")
            where = plan.where("model") if key == "model" else ""
            model = meta_model(resolve_model(name, key=key, where=where), name=name, key=key, where=where)
        world_size, note = _world_size(args.world_size, plan)
        resolved = resolve(plan, model, world_size=world_size)
        if args.action == "show":
            print(format_plan(resolved, model, dense_optimizer=args.dense_optimizer or dense_optimizer) + note)
        else:
            print(f"plan OK: {args.plan} on {name}: {summarize(resolved)}{note}")
    except (PlanError, UserCodeError) as e:  # a builder that raises: its traceback, exit 1
        print_error(e)
        return exit_status(e)
    return 0


def _add_train_parser(commands: argparse._SubParsersAction) -> None:
    help_text = "train a model under its plan (one process of a torchrun job)"
    p = commands.add_parser("train", help=help_text, description=help_text + (
        ". Overrides: `plan.KEY=VALUE` sets a plan key (e.g. plan.topology.parameter_servers=2), "
        "any other KEY=VALUE a training-config key (e.g. train.steps=50 data.batch_size=128)."))
    p.add_argument("--plan", required=True, metavar="PLAN", help="plan YAML, e.g. conf/plans/dlrm.yaml")
    p.add_argument("--config", metavar="CONFIG", help="training config YAML, e.g. conf/train/dlrm.yaml")
    p.add_argument("--model", metavar="MODEL", help=f"{MODEL_HELP} (default: the config's model.name, else the "
                                                     "plan's model)")
    p.add_argument("overrides", nargs="*", default=[], metavar="key=value", help="config and plan. overrides")
    p.set_defaults(handler=_train_main)


def _train_main(args: argparse.Namespace) -> int:
    from hybrid.train.loop import main as train_main

    return train_main(args.plan, args.config, args.overrides, model=args.model)


def _add_launch_parser(commands: argparse._SubParsersAction) -> None:
    help_text = "start N local processes with torchrun and run a hybrid command in each"
    p = commands.add_parser("launch", help=help_text, description=help_text + (
        ", e.g. `hybrid launch -n 3 train --plan conf/plans/dlrm.yaml --config conf/train/dlrm.yaml`. "
        "For several machines run torchrun yourself (see docs/training.md, Several machines)."))
    p.add_argument("-n", "--nproc", type=int, required=True, help="processes (trainers + parameter servers)")
    p.add_argument("--max-restarts", type=int, default=0,
                   help="torchrun restarts of the whole group on a failure (not on a plan, config or data "
                        "mistake: exit 2 at once)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="train and its arguments: train --plan ...")
    p.set_defaults(handler=_launch_main)


class _Checked(NamedTuple):
    """What ``hybrid launch`` needs of a checked ``train`` command: plain values, so that the
    launcher unpickles them from the process that checked it without importing torch."""

    status: int
    """0, or the exit status of the mistake (its message printed; the rest is then unset)."""
    address: str
    """``runtime.address``."""
    kill_grace_s: float
    """``runtime.kill_grace_s``."""
    names: tuple[str, ...]
    """Each rank's process name."""


def _check_train(argv: Sequence[str], world_size: int) -> _Checked:
    """Check a ``train`` command's plan, config and data files and the folders it writes in."""
    from hybrid.checkpoint.files import CheckpointError, checkpoint_key
    from hybrid.launch.roles import role_of
    from hybrid.train.loop import check_out_dir, checkpoint_start, load_run

    from hybrid.plan import check_server_memory

    args = build_parser().parse_args(["train", *argv])
    try:
        plan, cfg, model, resolved = load_run(args.plan, args.config, args.overrides, world_size, model=args.model)
        # Every process runs here: tables that do not fit are refused before any starts.
        check_server_memory(resolved, model, fraction=cfg.runtime.server_memory_fraction)
        checkpoint_start(cfg, key=checkpoint_key(cfg.checkpoint.key_file))
        check_out_dir(cfg)
    except (PlanError, CheckpointError, InputError, UserCodeError) as e:  # UserCodeError: a builder raised (exit 1)
        print_error(e)
        return _Checked(exit_status(e), "", 0.0, ())
    names = tuple(role_of(r, world_size, resolved.num_servers).name for r in range(world_size))
    return _Checked(0, cfg.runtime.address, cfg.runtime.kill_grace_s, names)


def torchrun_args(nproc: int, command: Sequence[str], max_restarts: int = 0, address: str = "127.0.0.1",
                  kill_grace_s: float = 5.0, names: Sequence[str] = ()) -> list[str]:
    """The arguments of :func:`hybrid.launch.torchrun.main` that ``hybrid launch`` runs: a local
    rendezvous on a free port, every store torchrun hosts listening on ``address`` only, no log
    directory (torchrun would make one in the system's temp folder and leave it), and
    ``kill_grace_s`` between SIGTERM and SIGKILL once a process fails. ``names`` (rank i's role)
    let its messages say ``trainer1`` rather than ``rank 1``."""
    return [
        "--address", address, *(["--names", ",".join(names)] if names else []), "--standalone",
        f"--nproc-per-node={nproc}", f"--max-restarts={max_restarts}", f"--log-dir={os.devnull}",
        f"--shutdown-timeout={math.ceil(kill_grace_s)}", "-m", "hybrid.cli", *command,
    ]


def launch_command(*args, **kwargs) -> list[str]:
    """:func:`torchrun_args` as a command line of its own (``python -m hybrid.launch.torchrun``)."""
    return [sys.executable, "-m", "hybrid.launch.torchrun", *torchrun_args(*args, **kwargs)]


def _launch_main(args: argparse.Namespace) -> NoReturn:
    """``hybrid launch``; exits with the job's status at once. The launcher holds nothing to tear
    down (its output went straight to the terminal), and the interpreter's teardown of torch and
    the model it checked takes a second or two on a busy machine."""
    exit_now(_launch(args))


def _launch(args: argparse.Namespace) -> int:
    if args.nproc < 1:
        print(f"error: launch -n: got {args.nproc}; expected 1 (one process: the trainer holds the tables) "
              "or more (trainers + parameter servers)", file=sys.stderr)
        return EXIT_USAGE
    if args.max_restarts < 0:
        print(f"error: launch --max-restarts: got {args.max_restarts}; expected 0 or more", file=sys.stderr)
        return EXIT_USAGE
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        print("error: launch: no command; e.g. hybrid launch -n 3 train --plan conf/plans/dlrm.yaml", file=sys.stderr)
        return EXIT_USAGE
    if command[0] != "train":
        print(f"error: launch runs `train`, the one command that runs on several processes; got {command[0]!r} "
              f"(run `hybrid {command[0]} ...` by itself)", file=sys.stderr)
        return EXIT_USAGE
    from hybrid.launch import workers
    from hybrid.launch.address import numeric_address

    os.environ.setdefault("OMP_NUM_THREADS", "1")  # torchrun's default too; said here so it is not a surprise
    # torch's C++ warnings off in the processes started here (TORCH_CPP_LOG_LEVEL=WARNING brings
    # them back): when a process ends, every peer's RPC agent would print its raw "EOF"/"connection
    # reset" lines before hybrid's own message that names the process. Set before the workers'
    # fork server starts: torch reads it when it is loaded.
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    # plan, config and data are checked here: a mistake is one message, exit 2. With workers to
    # fork, in a process forked from their server: this one then never imports torchrec, and
    # imports torch (for torchrun) only once the check passed.
    if args.nproc > 1:
        stop_signals_raise()  # a stop before the agent runs is the launcher's to report (main)
    if args.nproc > 1 and workers.forked():
        checked = workers.call("hybrid.cli:_check_train", command[1:], args.nproc)
    else:
        checked = _check_train(command[1:], args.nproc)
    if checked.status:  # the fork server ends with this process (its parent-death signal)
        return checked.status
    if args.nproc == 1:
        # One-process mode: the whole job runs here, as `hybrid train` without torchrun runs it
        # (torch, the plan and the model are loaded already).
        import torch

        for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            os.environ.pop(key, None)
        if os.environ["OMP_NUM_THREADS"].isdigit():  # torch read it when it was imported
            torch.set_num_threads(max(1, int(os.environ["OMP_NUM_THREADS"])))
        return main(command)
    # torchrun's agent starts the workers in sessions of their own and stops them on
    # SIGINT/SIGTERM; it exits itself when one fails. With workers to fork it runs in a process
    # forked from their server, which has imported torch; else in this one.
    argv = torchrun_args(args.nproc, command, args.max_restarts, numeric_address(checked.address),
                         checked.kill_grace_s, checked.names)
    if workers.forked():
        return workers.run_agent(argv)
    from hybrid.launch import torchrun

    torchrun.main(argv)
    return 0


def _add_export_parser(commands: argparse._SubParsersAction) -> None:
    help_text = "write a checkpoint as one plain state_dict with the unsharded model's keys"
    p = commands.add_parser("export", help=help_text, description=help_text + (
        ": dense part and every table whole, no optimizer state; load it with "
        "`model.load_state_dict(torch.load(OUT, weights_only=True))` for evaluation or serving."))
    p.add_argument("checkpoint", metavar="CKPT",
                   help="a checkpoint directory (runs/ckpt/step_00000400) or a checkpoint root (its newest)")
    p.add_argument("out", metavar="OUT", help="the .pt file to write")
    p.add_argument("--key-file", default="", metavar="FILE",
                   help="the key the checkpoint's manifest was signed with (default: $HYBRID_CHECKPOINT_KEY, "
                        "if set); a manifest that does not verify is refused")
    p.set_defaults(handler=_export_main)


def _export_main(args: argparse.Namespace) -> int:
    from hybrid.checkpoint import Checkpoint, CheckpointError, export
    from hybrid.checkpoint.files import checkpoint_key

    try:
        key = checkpoint_key(args.key_file)
        ckpt = Checkpoint(args.checkpoint, key=key)
        written = export(ckpt.path, args.out, key=key)
    except CheckpointError as e:
        print_error(e)
        return EXIT_USAGE
    files = "" if len(written["files"]) == 1 else f" in {len(written['files'])} files (index {args.out}.index.json)"
    print(f"exported {ckpt.path} (step {ckpt.step}) to {args.out}: {len(written['keys'])} tensors, "
          f"{written['values']:,} values{files}")
    return 0


def _world_size(flag: int | None, plan: Plan) -> tuple[int, str]:
    """The world size to check against, and a note when it was guessed."""
    if flag is not None:
        if flag < 1:  # named as the flag: the plan's world_size is not the value refused
            raise PlanError(f"got {flag}; expected a number of processes >= 1", category="topology", key="--world-size")
        return flag, ""
    if plan.world_size is not None:
        return plan.world_size, ""
    smallest = plan.topology.parameter_servers + 1
    note = f"\n(world size {smallest} = parameter_servers + 1 trainer; set world_size or pass --world-size)"
    return smallest, note


def _is_override(arg: str) -> bool:
    return "=" in arg and not arg.startswith("-")


if __name__ == "__main__":  # how torchrun starts each process of a job (`python -m hybrid.cli train ...`)
    # Once a command has returned its files are written and closed and RPC and the process groups
    # are down; the interpreter's teardown would cost every process ~2 CPU s (7.2 s against 5.1).
    exit_now(main())
