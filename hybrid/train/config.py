"""The training config (``conf/train/<model>.yaml``): typed, loaded like a plan, errors that say where.

Sections: ``model`` (``name``: the model, as :mod:`hybrid.train.spec` resolves it, and its
builder's keyword arguments), ``data`` (:class:`hybrid.data.DataConfig`), ``train``
(:class:`TrainOptions`), ``runtime``
(:class:`hybrid.launch.init.RuntimeOptions`: timeouts, transport, listening address) and
``checkpoint`` (:class:`CheckpointOptions`). Loading reuses the plan loader (safe YAML only,
unknown keys and wrong types refused with ``file:line``, ``key=value`` overrides), and raises the
same :class:`~hybrid.plan.PlanError`.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hybrid.data import DataConfig, check_data_config
from hybrid.launch.address import check_address
from hybrid.launch.init import RuntimeOptions
from hybrid.plan.errors import PlanError, did_you_mean, one_of
from hybrid.plan.load import _key_lines, _load_section, _Locator, _read_yaml
from hybrid.plan.overrides import apply_overrides
from hybrid.train.spec import ModelSpec, known_models, resolve_model

DENSE_OPTIMIZERS = ("sgd", "adagrad", "adam")


@dataclass(kw_only=True)
class TrainOptions:
    """The ``train`` section: how long, how fast, what to report and where."""

    steps: int = 300
    """Training steps (each one global batch of ``trainers x data.batch_size`` samples)."""
    epochs: int = 0
    """File sources: passes over the training files (0 = run ``steps`` steps, restarting the
    files as needed). When > 0, training ends after ``epochs`` passes or ``steps``, whichever first."""
    optimizer: str = "adagrad"
    """Optimizer of the dense part on the trainers: sgd, adagrad or adam. (The tables' optimizer
    is the plan's, applied on the servers.)"""
    lr: float = 0.01
    """Learning rate of the dense optimizer."""
    eval_every: int = 100
    """Evaluate on the held-out data every this many steps (0 = only at the end)."""
    log_every: int = 10
    """Write a metrics row (loss, throughput, step-time breakdown) every this many steps."""
    out_dir: str = "runs/{model}"
    """Where metrics (metrics.jsonl, metrics.csv), the curves PNG, the summary and TensorBoard
    events go; ``{model}`` is replaced by the model's name."""
    progress: bool = True
    """A progress bar on trainer 0 (when stderr is a terminal or ``progress`` is forced on)."""
    plot: bool = True
    """Write curves.png (loss and AUC/recall over steps) at the end (needs matplotlib)."""
    tensorboard: bool = True
    """Also write TensorBoard events when the ``tensorboard`` package is installed."""
    recall_k: list[int] = field(default_factory=lambda: [1, 5, 10])
    """Retrieval: the k of recall@k (among the eval batch's items)."""
    temperature: float = 0.05
    """Retrieval: softmax temperature of the in-batch loss."""
    nonfinite: str = "error"
    """A batch with NaN/inf dense features or labels: ``error`` (stop, naming the step) or
    ``skip`` (count it, change nothing)."""
    seed: int = 0
    """Seed of the model's initial weights (the same on every process)."""

    def __post_init__(self) -> None:
        _check("steps", self.steps, self.steps >= 1, "an integer >= 1")
        _check("epochs", self.epochs, self.epochs >= 0, "an integer >= 0")
        _check("optimizer", self.optimizer, self.optimizer in DENSE_OPTIMIZERS, one_of(DENSE_OPTIMIZERS))
        _check("lr", self.lr, self.lr > 0, "a number > 0")
        _check("eval_every", self.eval_every, self.eval_every >= 0, "an integer >= 0")
        _check("log_every", self.log_every, self.log_every >= 1, "an integer >= 1")
        _check("recall_k", self.recall_k, all(k >= 1 for k in self.recall_k), "integers >= 1")
        _check("temperature", self.temperature, self.temperature > 0, "a number > 0")
        _check("nonfinite", self.nonfinite, self.nonfinite in ("error", "skip"), "'error' or 'skip'")


@dataclass(kw_only=True)
class CheckpointOptions:
    """The ``checkpoint`` section."""

    dir: str = ""
    """Checkpoint root (one ``step_N`` directory per save); empty = no checkpoints."""
    every: int = 0
    """Save every this many steps (0 = only at the end, when ``dir`` is set)."""
    keep: int = 3
    """Keep the newest this many complete checkpoints."""
    resume: str = ""
    """``latest`` (the newest complete checkpoint under ``dir``, if any) or a checkpoint path."""
    key_file: str = ""
    """A file holding the key that signs manifests on save and verifies them on resume (an
    HMAC-SHA256); empty: ``$HYBRID_CHECKPOINT_KEY`` if set, else manifests are not signed."""

    def __post_init__(self) -> None:
        _check("every", self.every, self.every >= 0, "an integer >= 0")
        _check("keep", self.keep, self.keep >= 1, "an integer >= 1")
        _check("resume", self.resume, self.resume != "latest" or bool(self.dir),
               "a checkpoint path, or 'latest' together with checkpoint.dir")


@dataclass(kw_only=True)
class _ConfigFile:
    model: dict[str, Any] = field(default_factory=dict)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainOptions = field(default_factory=TrainOptions)
    runtime: RuntimeOptions = field(default_factory=RuntimeOptions)
    checkpoint: CheckpointOptions = field(default_factory=CheckpointOptions)


@dataclass
class RunConfig:
    """A loaded training config."""

    model_name: str
    """The model as it was named (``dlrm``, ``my_package.models:spec``)."""
    model_kwargs: dict[str, Any]
    """The ``model:`` section without ``name``: keyword arguments of ``spec.build``."""
    spec: ModelSpec
    """The model the name resolved to."""
    data: DataConfig
    train: TrainOptions
    runtime: RuntimeOptions
    checkpoint: CheckpointOptions
    source: str = ""
    locate: Callable[..., str] | None = field(default=None, compare=False, repr=False)
    """Config key -> where its value was written (set by :func:`load_config`; see :meth:`where`)."""

    def where(self, key: str, *, whole: bool = False) -> str:
        """Where the value of config key ``key`` came from: ``file:line``, the command-line override
        that set it, or the file alone. ``whole``: the error concerns everything under ``key`` (the
        model's options), so overrides below it are named too."""
        return self.locate(key, whole=whole) if self.locate is not None else self.source

    @property
    def out_dir(self) -> Path:
        """``train.out_dir`` with ``{model}`` replaced by the model's name (made safe for a path)."""
        return Path(self.train.out_dir.replace("{model}", re.sub(r"[^\w.-]", "_", self.model_name)))


SECTIONS = ("model", "data", "train", "runtime", "checkpoint")


def _check(key: str, value: Any, ok: bool, expected: str) -> None:
    if not ok:
        raise PlanError(f"got {value!r}; expected {expected}", category="bad_value", key=key)


def load_config(path: str | Path | None, overrides: Sequence[str] = (), *, model: str | None = None,
                model_flag: str | None = None, plan_source: str = "") -> RunConfig:
    """Read the training config at ``path`` (``None``: all defaults), apply ``key=value`` overrides.

    The model trained is ``model_flag`` (``hybrid train --model``) if given, else the config's
    ``model.name``, else ``model`` (the plan's ``model:``, written at ``plan_source``: the plan's
    ``file:line`` or override). A config or a plan naming another model than the one chosen is
    refused, since each was written for one.
    """
    if path is None:
        raw, locate, source = {}, _Locator("", {}, overrides), ""
    else:
        raw, text = _read_yaml(Path(path), "training config")
        locate, source = _Locator(str(path), _key_lines(text), overrides), str(path)
    try:
        cfg = _build(raw or {}, overrides, source, flag=model_flag, plan_model=model, plan_source=plan_source)
    except PlanError as e:
        raise (e if e.key == FLAG else e.at(locate(e.key))) from None
    return dataclasses.replace(cfg, locate=locate)


FLAG = "--model"


def _build(raw: Any, overrides: Sequence[str], source: str, *, flag: str | None, plan_model: str | None,
           plan_source: str) -> RunConfig:
    if not isinstance(raw, dict):
        raise PlanError(f"a training config is a mapping with keys {', '.join(SECTIONS)}; got {raw!r}",
                        category="bad_value")
    raw = apply_overrides(raw, overrides)
    for key in raw:
        if key not in SECTIONS:
            raise PlanError(f"unknown section {key!r}{did_you_mean(str(key), SECTIONS)}; a training config has "
                            f"{', '.join(SECTIONS)}", category="unknown_key", key=str(key))
    for section in ("model", "data"):  # train, runtime and checkpoint are checked as dataclass fields
        value = raw.get(section)
        if value is not None and not isinstance(value, dict):
            raise PlanError(f"got {value!r}; expected a mapping (the {section} section's keys)",
                            category="bad_value", key=section)
    model_raw = dict(raw.get("model") or {})
    name, spec = _model(model_raw.pop("name", None), flag, plan_model, plan_source)
    params = spec.options()
    for k in model_raw:
        if params is not None and k not in params:
            raise PlanError(f"{name} takes no option {k!r}{did_you_mean(k, params)}; it takes {', '.join(params)}",
                            category="unknown_key", key=f"model.{k}")
    header = {k: v for k, v in raw.items() if k in ("train", "runtime", "checkpoint")}
    data_raw = raw.get("data") or {}
    if isinstance(data_raw, dict):
        _derive_model_inputs(model_raw, data_raw, params)
    cfg = _load_section(_ConfigFile, header, "")
    check_address(cfg.runtime.address)  # every socket of the run listens there: refuse one that cannot be used
    data = _load_section(DataConfig, raw.get("data") or {}, "data")
    try:
        check_data_config(data)
    except ValueError as e:
        key = str(e).split(":", 1)[0] if str(e).startswith("data.") else "data"
        raise PlanError(str(e).split(": ", 1)[-1] if key != "data" else str(e), category="bad_value", key=key) from None
    return RunConfig(name, model_raw, spec, data, cfg.train, cfg.runtime, cfg.checkpoint, source)


def _derive_model_inputs(model_raw: dict[str, Any], data_raw: dict[str, Any], params: list[str] | None) -> None:
    """A model that takes ``features`` / ``num_dense`` gets them from ``data.sparse_columns`` /
    ``data.dense_columns`` (a user names each column once). Given in both places, they must
    agree (PlanError naming the key)."""
    for key, column_key, value in (
        ("features", "sparse_columns", lambda cols: list(cols)),
        ("num_dense", "dense_columns", lambda cols: len(cols)),
    ):
        columns = data_raw.get(column_key)
        if not columns or not isinstance(columns, (list, tuple)) or (params is not None and key not in params):
            continue
        derived = value(columns)
        if key not in model_raw:
            model_raw[key] = derived
            continue
        given = list(model_raw[key]) if key == "features" else model_raw[key]
        if given != derived:
            raise PlanError(f"got {given!r}, but data.{column_key} gives {derived!r}; name the columns once, in "
                            f"data.{column_key} (the model takes its {key} from there), and drop model.{key}",
                            category="bad_value", key=f"model.{key}")


def _model(config_name: str | None, flag: str | None, plan_model: str | None,
           plan_source: str) -> tuple[str, ModelSpec]:
    """The chosen model's name and spec (see :func:`load_config`); errors name where it came from."""
    if flag:
        if config_name and config_name != flag:
            raise PlanError(f"the config trains {config_name!r} but --model names {flag!r}", category="bad_value",
                            key="model.name")
        if plan_model and plan_model != flag:
            raise PlanError(f"--model names {flag!r} but the plan is written for {plan_model!r}",
                            category="bad_value", key=FLAG)
        return flag, resolve_model(flag, key=FLAG)
    if config_name:
        if plan_model and config_name != plan_model:
            raise PlanError(f"the config trains {config_name!r} but the plan is written for {plan_model!r}",
                            category="bad_value", key="model.name")
        return config_name, resolve_model(config_name, key="model.name")
    if plan_model:
        return plan_model, resolve_model(plan_model, key="model", where=plan_source or "plan")
    raise PlanError(f"no model: set model.name, the plan's model: or --model to package.module:attr or a "
                    f"registered name ({', '.join(known_models()) or 'none registered'})", category="unknown_model",
                    key="model.name")


def config_dict(cfg: RunConfig) -> dict[str, Any]:
    """The whole config as plain data (written next to the metrics of a run)."""
    return {
        "model": {"name": cfg.model_name, **cfg.model_kwargs},
        "data": dataclasses.asdict(cfg.data),
        "train": dataclasses.asdict(cfg.train),
        "runtime": dataclasses.asdict(cfg.runtime),
        "checkpoint": dataclasses.asdict(cfg.checkpoint),
    }
