"""Which model a run trains: a :class:`ModelSpec`, and how a name finds one (:func:`resolve_model`).

A model is named in one of two forms, wherever a model is named (``hybrid train --model``,
``hybrid plan show/check --model``, a training config's ``model.name``, a plan's ``model:``):

- ``package.module:attr`` -- ``attr`` is a :class:`ModelSpec`, or a callable that builds the
  ``nn.Module`` (it becomes ``ModelSpec(build=attr)``); the module is imported from
  ``sys.path`` (``PYTHONPATH``);
- a bare name registered by an installed distribution in the entry-point group
  ``hybrid.models``, e.g. in its ``pyproject.toml``::

      [project.entry-points."hybrid.models"]
      my_model = "my_package.models:spec"

The examples (``dlrm``, ``dcn``, ``two_tower``) register themselves this way; the library never
imports them. A name that finds nothing is a :class:`~hybrid.plan.PlanError` naming where the
name came from, what was tried and the names that are known.
"""

from __future__ import annotations

import importlib
import inspect
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hybrid.data.config import Schema
from hybrid.errors import PlanError, UserCodeError, did_you_mean
from hybrid.train.tasks import TASKS, Task, make_task

ENTRY_POINT_GROUP = "hybrid.models"
"""The entry-point group in which distributions register their models by name."""


@dataclass(kw_only=True)
class ModelSpec:
    """A trainable model: how to build it, what its step computes, what data it reads."""

    build: Callable[..., nn.Module]
    """Builds the plain model (no distribution code). Called with the keyword arguments of the
    training config's ``model:`` section (all but ``name``), plus ``device`` when it takes one
    (``torch.device("meta")`` for plan checks: shapes without storage) and ``seed`` (the
    config's ``train.seed``) when it takes one; a builder without ``seed`` is called right after
    ``torch.manual_seed(seed)``, so every trainer starts from the same weights either way. A
    builder refuses a bad option with ``ValueError`` (or ``TypeError``): one ``error:`` line, exit
    2; a message that starts with ``model.<option>:`` is located at that option's line in the
    config, or at the command-line override that set it."""
    task: str | Task = "ctr"
    """What a step computes: a built-in task's name (``ctr``, ``retrieval``:
    :mod:`hybrid.train.tasks`) or any object with the :class:`~hybrid.train.tasks.Task` members."""
    schema: Callable[[nn.Module], Schema] | None = None
    """The inputs the built model reads (given a model on any device, meta included), which the
    data readers produce. ``None``: :func:`model_schema` with its defaults -- one sparse feature
    per feature of the model's ``EmbeddingBagCollection`` s with its table's rows, a dense width
    of the model's ``num_dense`` attribute (0 when it has none), click labels."""

    def __post_init__(self) -> None:
        if not callable(self.build):
            raise TypeError(f"ModelSpec.build: got {self.build!r}; expected a callable that returns an nn.Module")
        if isinstance(self.task, str):
            if self.task not in TASKS:
                raise ValueError(f"ModelSpec.task: got {self.task!r}; expected one of "
                                 f"{', '.join(map(repr, TASKS))} or a Task object")
        elif not isinstance(self.task, Task):
            raise TypeError(f"ModelSpec.task: got {self.task!r}; expected a task name or an object with "
                            f"name, forward, loss and eval_outputs (hybrid.train.tasks.Task)")

    def options(self) -> list[str] | None:
        """The keyword arguments a config may give ``build`` (``None``: any, it takes ``**kwargs``)."""
        names = _keywords(self.build)
        return None if names is None else [n for n in names if n != "device"]

    def make_model(self, options: Mapping[str, Any] | None = None, *, device: torch.device | str | None = None,
                   seed: int | None = None, name: str | None = None) -> nn.Module:
        """``build(**options)``, with ``device`` and ``seed`` passed as the field's docstring says.

        ``TypeError`` and ``ValueError`` of the builder pass through (it refuses its options: bad
        input); any other exception of the builder becomes a :class:`~hybrid.errors.UserCodeError`
        naming the model ``name`` (default: the builder's qualified name), with the builder's
        frames of the traceback."""
        kwargs = dict(options or {})
        names = _keywords(self.build)
        if device is not None and (names is None or "device" in names):
            kwargs["device"] = device
        if seed is not None:
            if names is None or "seed" in names:
                kwargs.setdefault("seed", seed)
            else:
                torch.manual_seed(seed)
        try:
            model = self.build(**kwargs)
        except (TypeError, ValueError):
            raise
        except Exception as e:  # noqa: BLE001 - the user's code failed: report it as theirs
            on = f" on device {kwargs['device']}" if "device" in kwargs else ""
            what = f"building the model {name or _qualname(self.build)!r}{on}"
            tb = e.__traceback__.tb_next if e.__traceback__ is not None else None  # from the builder's frame on
            raise UserCodeError(what, e, tb) from e
        if not isinstance(model, nn.Module):
            raise TypeError(f"{_qualname(self.build)} returned {type(model).__name__}; a model builder returns an nn.Module")
        return model

    def data_schema(self, model: nn.Module) -> Schema:
        """The schema of ``model``'s inputs (:attr:`schema`, or :func:`model_schema`)."""
        return self.schema(model) if self.schema is not None else model_schema(model)

    def make_task(self, *, temperature: float = 0.05) -> Task:
        """The task object (``temperature``: the config's ``train.temperature``, for ``retrieval``)."""
        return make_task(self.task, temperature=temperature)


def meta_model(spec: ModelSpec, options: Mapping[str, Any] | None = None, *, name: str, key: str = "model",
               where: str = "", locate: Callable[..., str] | None = None) -> nn.Module:
    """``spec``'s model on the meta device (shapes, no storage: instant even with huge tables), for
    checking a plan against it. A builder that refuses ``options`` (``TypeError``/``ValueError``)
    is a :class:`~hybrid.plan.PlanError` at ``key`` naming the model ``name``, at ``where``; or,
    given ``locate`` (:meth:`hybrid.train.config.RunConfig.where`), where the option the builder's
    message starts with (``model.embedding_dim: ...``) was written, else where the ``model``
    section and its overrides were."""
    try:
        return spec.make_model(options, device=torch.device("meta"), name=name)
    except (TypeError, ValueError) as e:
        if locate is not None:
            named = re.match(r"model\.(\w+)\b", str(e))
            if named and named.group(1) in (options or {}):
                where = locate(f"model.{named.group(1)}")
            else:
                where = locate("model", whole=True)
        raise PlanError(" ".join(f"building {name!r} failed: {e}".split()), category="bad_value", key=key,
                        where=where) from None


def model_schema(model: nn.Module, *, num_dense: int | None = None, task: str = "ctr",
                 query_features: list[str] | tuple[str, ...] = ()) -> Schema:
    """The schema of a model's inputs: every feature of its ``EmbeddingBagCollection`` s (in
    ``named_modules`` order, then table order) with its table's rows; ``num_dense`` (default:
    the model's ``num_dense`` attribute, else 0); ``task`` and ``query_features`` as in
    :class:`~hybrid.data.Schema`. Works on meta-device models."""
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    features: list[str] = []
    rows: list[int] = []
    for _, m in model.named_modules():
        if isinstance(m, EmbeddingBagCollection):
            for cfg in m.embedding_bag_configs():
                for f in cfg.feature_names:
                    if f not in features:
                        features.append(f)
                        rows.append(cfg.num_embeddings)
    if num_dense is None:
        num_dense = int(getattr(model, "num_dense", 0))
    return Schema(num_dense=num_dense, features=features, num_embeddings=rows, task=task,
                  query_features=list(query_features))


def known_models() -> list[str]:
    """The names registered in the ``hybrid.models`` entry-point group, sorted."""
    from importlib.metadata import entry_points

    return sorted({ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)})


def resolve_model(ref: str | None, *, key: str, where: str = "") -> ModelSpec:
    """The :class:`ModelSpec` that ``ref`` names (``package.module:attr`` or a registered name).

    Raises :class:`~hybrid.plan.PlanError` (category ``unknown_model``) at ``key`` (the plan or
    config key, or ``--model``) and ``where`` for an empty or unknown name, a module that cannot
    be imported, a missing attribute, or an object that is neither a spec nor a callable.
    """
    def error(detail: str) -> PlanError:
        return PlanError(" ".join(detail.split()), category="unknown_model", key=key, where=where)

    if not ref:
        raise error(f"no model: name one as package.module:attr or as a registered name ({_known()})")
    if ":" in ref:
        return _from_module(ref, error)
    return _from_entry_point(ref, error)


def _from_module(ref: str, error: Callable[[str], PlanError]) -> ModelSpec:
    module_name, _, attr = ref.partition(":")
    if not module_name or not attr:
        raise error(f"got {ref!r}; expected package.module:attr or a registered name ({_known()})")
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as e:  # noqa: BLE001 - any failure of the user's module is reported in one line
        raise error(f"cannot import module {module_name!r} for {ref!r} ({type(e).__name__}: {e}); "
                    f"is it on PYTHONPATH? registered names: {_known()}") from None
    for i, part in enumerate(attr.split(".")):
        if not hasattr(obj, part):
            owner = ".".join([module_name, *attr.split(".")[:i]])
            names = [n for n in dir(obj) if not n.startswith("_")]
            raise error(f"{owner!r} has no attribute {part!r}{did_you_mean(part, names)} (looking up {ref!r}); "
                        f"registered names: {_known()}")
        obj = getattr(obj, part)
    return _as_spec(obj, ref, error)


def _from_entry_point(name: str, error: Callable[[str], PlanError]) -> ModelSpec:
    from importlib.metadata import entry_points

    found = {}
    for ep in entry_points(group=ENTRY_POINT_GROUP, name=name):
        found.setdefault(ep.value, ep)  # one distribution seen twice on sys.path is one entry
    if not found:
        names = known_models()
        raise error(f"unknown model {name!r}{did_you_mean(name, names)}; registered in entry-point group "
                    f"{ENTRY_POINT_GROUP!r}: {', '.join(names) or 'none'}; or name one as package.module:attr")
    if len(found) > 1:
        raise error(f"model {name!r} is registered more than once in {ENTRY_POINT_GROUP!r} "
                    f"({', '.join(sorted(found))}); name one as package.module:attr")
    (ep,) = found.values()
    try:
        obj = ep.load()
    except Exception as e:  # noqa: BLE001
        raise error(f"model {name!r} (entry point {name} = {ep.value}): cannot load it ({type(e).__name__}: {e})") from None
    return _as_spec(obj, f"{name} = {ep.value}", error)


def _as_spec(obj: Any, ref: str, error: Callable[[str], PlanError]) -> ModelSpec:
    if isinstance(obj, ModelSpec):
        return obj
    if callable(obj):
        return ModelSpec(build=obj)
    raise error(f"{ref!r} is a {type(obj).__name__}; expected a hybrid.train.ModelSpec or a callable that "
                f"builds an nn.Module; registered names: {_known()}")


def _known() -> str:
    names = known_models()
    return ", ".join(names) if names else f"none in entry-point group {ENTRY_POINT_GROUP!r}"


def _keywords(fn: Callable[..., Any]) -> list[str] | None:
    """The keyword arguments ``fn`` takes, in order (``None``: any -- ``**kwargs``, or no signature)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # some callables have no signature
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    return [p.name for p in params if p.kind in (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)]


def _qualname(fn: Callable[..., Any]) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"
