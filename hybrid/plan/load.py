"""Plan YAML -> typed :class:`Plan`, with command-line overrides and errors that say where.

The file is parsed by ``OmegaConf.load``, whose loader is built on yaml's ``SafeLoader``: it
never constructs Python objects, and a ``!!python/object`` (or any unknown) tag is refused
with the file and line. Each section is then merged onto its structured config
(``OmegaConf.structured(cls)``) so that unknown keys and wrong types are caught with their key
path, and instantiated, which runs the dataclasses' own checks. Errors carry ``file:line``
(or the override that set the value); see :mod:`hybrid.plan.overrides` for ``key=value``.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

from hybrid.plan.errors import PlanError, did_you_mean, join_key, one_of
from hybrid.plan.overrides import apply_overrides, override_key, override_where
from hybrid.plan.schema import STRATEGY_OPTIONS, Plan, Rule, SparseOptimizer, SyncOptions, Topology

_SECTIONS = ("model", "world_size", "topology", "modules", "sync")
_YAML_TAG_PREFIX = "tag:yaml.org,2002:"


@dataclasses.dataclass(kw_only=True)
class _PlanHeader:
    """Everything in a plan file but ``modules`` (whose rules are typed one by one)."""

    model: str | None = None
    world_size: int | None = None
    topology: Topology = dataclasses.field(default_factory=Topology)
    sync: SyncOptions = dataclasses.field(default_factory=SyncOptions)


def load_plan(path: str | Path, overrides: Sequence[str] = (), *, prefix: str = "") -> Plan:
    """Read the plan YAML at ``path``, apply ``key=value`` ``overrides``, and type-check it.

    Raises :class:`PlanError` naming the file and line (or the override) for every mistake the
    plan alone can show; mistakes that need the model and world size are found by
    :func:`hybrid.plan.resolve`, located the same way (:meth:`Plan.where`). ``prefix``: what the
    command line wrote before each override (``plan.`` for ``hybrid train``), for messages.
    """
    path = Path(path)
    raw, text = _read_yaml(path)
    locate = _Locator(str(path), _key_lines(text), overrides, prefix)
    return _build(raw, overrides, locate, source=str(path))


def plan_from_dict(d: Mapping[str, Any], overrides: Sequence[str] = ()) -> Plan:
    """Type-check a plan given as a (nested) mapping, as it would appear in YAML."""
    if isinstance(d, DictConfig):
        d = _to_plain(d)
    return _build(d, overrides, _Locator("", {}, overrides), source="")


def _build(raw: Any, overrides: Sequence[str], locate: _Locator, source: str) -> Plan:
    try:
        raw = _check_top(apply_overrides(_check_top(raw), overrides, locate.prefix))
        header = _load_section(_PlanHeader, {k: v for k, v in raw.items() if k != "modules"}, "")
        return Plan(
            model=header.model,
            world_size=header.world_size,
            topology=header.topology,
            sync=header.sync,
            modules=_load_rules(raw.get("modules"), locate),
            source=source,
            locate=locate,
        )
    except PlanError as e:
        raise e.at(locate(e.key)) from None


def _read_yaml(path: Path, what: str = "plan") -> tuple[Any, str]:
    """A YAML file (``what``: the plan or the training config, for messages) as plain data, and its text."""
    where = str(path)
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        line = path.read_bytes()[: e.start].count(b"\n") + 1
        raise PlanError(f"the {what} file is not UTF-8 text (byte {e.object[e.start]:#04x})", category="io",
                        where=f"{where}:{line}") from None
    except OSError as e:
        detail = f"cannot read the {what} file: {e.strerror or e}"
        raise PlanError(detail, category="io", where=where) from None
    try:
        return _to_plain(OmegaConf.load(path)), text
    except yaml.MarkedYAMLError as e:
        raise _yaml_error(e, where, text, what) from None
    except (yaml.YAMLError, OmegaConfBaseException) as e:
        raise PlanError(f"invalid YAML: {e}", category="yaml_syntax", where=where) from None
    except PlanError as e:
        raise e.at(where) from None


def _yaml_error(e: yaml.MarkedYAMLError, path: str, text: str, what: str = "plan") -> PlanError:
    mark = e.problem_mark or e.context_mark
    where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else path
    problem = e.problem or str(e)
    if problem.startswith("could not determine a constructor for the tag"):
        tag = problem.split("tag", 1)[1].strip(" '").replace(_YAML_TAG_PREFIX, "!!")
        detail = (
            f"refusing YAML tag {tag!r}: a {what} is plain data (mappings, lists, strings, "
            "numbers, booleans) and may not construct Python objects; remove the tag"
        )
        return PlanError(detail, category="unsafe_yaml", where=where)
    if problem.startswith("found duplicate key"):
        name = problem.removeprefix("found duplicate key").strip()
        detail = f"duplicate key {name!r}; YAML would keep only the last one: merge the two entries"
        return PlanError(detail, category="yaml_syntax", where=where)
    detail = f"invalid YAML: {problem}"
    if e.context and e.context_mark and e.context_mark is not mark:
        detail += f" ({e.context} at line {e.context_mark.line + 1})"
    lines = text.splitlines()
    if mark and mark.line < len(lines) and lines[mark.line].lstrip().startswith("*"):
        detail += '; a key starting with * is a YAML alias: quote it, as in "*":'
    return PlanError(detail, category="yaml_syntax", where=where)


def _to_plain(cfg: Any) -> Any:
    try:
        return OmegaConf.to_container(cfg, resolve=True)
    except OmegaConfBaseException as e:
        detail = f"cannot resolve an interpolation: {str(e).splitlines()[0]}"
        key = str(getattr(e, "full_key", "") or "")
        raise PlanError(detail, category="bad_value", key=key) from None


def _check_top(raw: Any) -> dict[str, Any]:
    if raw is None:
        return {}
    sections = ", ".join(_SECTIONS)
    if not isinstance(raw, dict):
        detail = f"a plan is a mapping with keys {sections}; got {type(raw).__name__} {raw!r}"
        raise PlanError(detail, category="bad_value")
    for key in raw:
        if key not in _SECTIONS:
            hint = did_you_mean(str(key), _SECTIONS)
            detail = f"unknown key {key!r}{hint}; a plan has {sections}"
            raise PlanError(detail, category="unknown_key", key=str(key))
    return raw


def _load_section(cls: type, raw: Mapping[str, Any], path: str) -> Any:
    """``raw`` merged onto ``OmegaConf.structured(cls)``, then built; errors keyed by ``path``."""
    hints = typing.get_type_hints(cls)
    raw = dict(raw)
    for name, value in list(raw.items()):
        sub = _dataclass_in(hints.get(name)) if isinstance(name, str) else None
        if sub is not None and value is None and not _is_optional(hints[name]):
            del raw[name]  # an empty section (only comments under it) means "all defaults"
        elif sub is not None and value is not None and not isinstance(value, dict):
            raise _expected(join_key(path, name), value, hints[name])
    try:
        node = OmegaConf.merge(OmegaConf.structured(cls), raw)
    except ConfigKeyError as e:
        raise _unknown_key_error(e, path) from None
    except ValidationError as e:
        raise _validation_error(e, path) from None
    except OmegaConfBaseException as e:
        raise PlanError(str(e).splitlines()[0], category="bad_value", key=path) from None
    return _instantiate(cls, node, path)


def _instantiate(cls: type, node: DictConfig, path: str) -> Any:
    """Build ``cls`` from a merged node, so that each ``__post_init__`` error gets its full path."""
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        key = join_key(path, f.name)
        if OmegaConf.is_missing(node, f.name):
            detail = f"required; expected {_describe(hints[f.name])}"
            raise PlanError(detail, category="bad_value", key=key)
        value = node[f.name]
        sub = _dataclass_in(hints[f.name])
        if sub is not None and value is not None:
            kwargs[f.name] = _instantiate(sub, value, key)
        else:
            kwargs[f.name] = OmegaConf.to_container(value) if OmegaConf.is_config(value) else value
    try:
        return cls(**kwargs)
    except PlanError as e:
        raise e.under(path) from None


def _load_rules(raw: Any, locate: _Locator) -> dict[str, Rule]:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        detail = f'got {raw!r}; expected a mapping of module path (or glob, or "*") to rule'
        raise PlanError(detail, category="bad_value", key="modules")
    rules = {}
    for key, body in raw.items():
        rule = _build_rule(str(key), body)
        rules[rule.key] = dataclasses.replace(rule, where=locate(f"modules.{rule.key}", whole=True))
    return rules


def _build_rule(key: str, body: Any) -> Rule:
    path = f"modules.{key}"
    if not isinstance(body, dict):
        detail = (
            f"got {body!r}; a rule is a mapping with 'strategy' and its options, "
            f"e.g. {key}: {{strategy: ddp}}"
        )
        raise PlanError(detail, category="bad_value", key=path)
    body = dict(body)
    strategy = body.pop("strategy", None)
    if strategy not in STRATEGY_OPTIONS:
        got = "missing" if strategy is None else f"got {strategy!r}"
        hint = did_you_mean(str(strategy), STRATEGY_OPTIONS) if strategy is not None else ""
        detail = f"{got}{hint}; expected {one_of(STRATEGY_OPTIONS)}"
        raise PlanError(detail, category="bad_value", key=f"{path}.strategy")
    cls = STRATEGY_OPTIONS[strategy]
    _check_option_names(cls, strategy, body, path)
    return Rule(key=key, strategy=strategy, options=_load_section(cls, body, path))


def _check_option_names(cls: type, strategy: str, body: Mapping[str, Any], path: str) -> None:
    """Unknown rule options, with the hint a flat rule needs: which strategy has that option."""
    known = [f.name for f in dataclasses.fields(cls)]
    for name in body:
        if name in known:
            continue
        owners = [s for s, c in STRATEGY_OPTIONS.items() if name in _field_names(c)]
        if owners:
            hint = f"; it is an option of {' and '.join(owners)}, not {strategy}"
        else:
            hint = did_you_mean(str(name), known)
        allowed = ", ".join(known) if known else "none (it has no options)"
        detail = f"unknown option {name!r} for strategy {strategy}{hint}; {strategy} options: "
        detail += allowed
        raise PlanError(detail, category="unknown_key", key=join_key(path, str(name)))


def _unknown_key_error(e: ConfigKeyError, path: str) -> PlanError:
    known = _field_names(e.object_type) if dataclasses.is_dataclass(e.object_type) else []
    name = str(e.key)
    detail = f"unknown key {name!r}{did_you_mean(name, known)}; known keys here: {', '.join(known)}"
    return PlanError(detail, category="unknown_key", key=join_key(path, str(e.full_key)))


def _validation_error(e: ValidationError, path: str) -> PlanError:
    key = join_key(path, str(e.full_key or ""))
    cls = e.object_type if dataclasses.is_dataclass(e.object_type) else None
    hint = typing.get_type_hints(cls).get(str(e.key)) if cls else None
    if hint is None:
        return PlanError(str(e.msg).splitlines()[0], category="bad_value", key=key)
    if cls is SparseOptimizer and e.key == "name":
        detail = (
            f"unknown sparse optimizer {e.value!r}"
            f"{did_you_mean(str(e.value), typing.get_args(hint))}; "
            f"the servers implement {_describe(hint)}"
        )
        return PlanError(detail, category="unknown_optimizer", key=key)
    return _expected(key, e.value, hint)


def _expected(key: str, value: Any, hint: Any) -> PlanError:
    choices = typing.get_args(hint) if typing.get_origin(hint) is Literal else ()
    hint_text = did_you_mean(str(value), [str(c) for c in choices]) if choices else ""
    detail = f"got {value!r}{hint_text}; expected {_describe(hint)}"
    return PlanError(detail, category="bad_value", key=key)


_SCALARS = {
    bool: ("true or false", "booleans"),
    int: ("an integer", "integers"),
    float: ("a number", "numbers"),
    str: ("a string", "strings"),
}


def _describe(hint: Any) -> str:
    """Plain words for a type hint: ``one of 'a', 'b'``, ``a list of integers or 'all'``..."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Literal:
        return one_of(args)
    if origin in (typing.Union, types.UnionType):
        if set(args) == {bool, str}:
            return "true, false or 'auto'"  # DDPOptions.broadcast_buffers: the only string is 'auto'
        described = [_describe(a) for a in args if a is not type(None)]
        if str in args and any(typing.get_origin(a) is list for a in args):
            # PSOptions.servers: the only string allowed is the keyword 'all'.
            described = [d for d in described if d != "a string"] + ["'all'"]
        if type(None) in args:
            described.append("null")
        return " or ".join(described)
    if origin is list:
        return "a list of " + (_SCALARS[args[0]][1] if args[0] in _SCALARS else _describe(args[0]))
    if dataclasses.is_dataclass(hint):
        return "a mapping with keys " + ", ".join(_field_names(hint))
    return _SCALARS[hint][0] if hint in _SCALARS else str(hint)


def _dataclass_in(hint: Any) -> type | None:
    """The dataclass in ``hint`` (``X`` or ``X | None``), if any."""
    if dataclasses.is_dataclass(hint):
        return hint
    return next((a for a in typing.get_args(hint) if dataclasses.is_dataclass(a)), None)


def _is_optional(hint: Any) -> bool:
    return type(None) in typing.get_args(hint)


def _field_names(cls: Any) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


class _Locator:
    """Plan key -> where its value was written: ``file:line``, or the override that set it.

    ``prefix`` is what the command line wrote before each override (``plan.`` for ``hybrid
    train``), so that an override is quoted as it was typed.
    """

    def __init__(self, source: str, lines: dict[str, int], overrides: Sequence[str], prefix: str = "") -> None:
        self.source, self.lines, self.prefix = source, lines, prefix
        self.overrides = []
        for text in overrides:
            try:
                self.overrides.append((override_key(text), override_where(prefix + text)))
            except PlanError:
                pass  # a malformed override is reported by apply_overrides itself

    def __call__(self, key: str, *, whole: bool = False) -> str:
        """Where ``key`` was set. ``whole``: the error concerns everything under ``key`` (a rule,
        the model's options), so overrides of keys below it are named next to its line."""
        at_or_above = [o for k, o in self.overrides if key == k or key.startswith(k + ".")]
        below = [o for k, o in self.overrides if key and k.startswith(key + ".")]
        if at_or_above:
            return at_or_above[-1]
        if key in self.lines:
            line = f"{self.source}:{self.lines[key]}"
            return " and ".join([line, *below]) if whole else line
        if below:  # e.g. a rule that only overrides created
            return " and ".join(below) if whole else below[-1]
        probe = key.rpartition(".")[0]
        while probe and probe not in self.lines:
            probe = probe.rpartition(".")[0]
        return f"{self.source}:{self.lines[probe]}" if probe else self.source


def _key_lines(text: str) -> dict[str, int]:
    """Every mapping key path in the YAML ``text`` -> its 1-based line."""
    lines: dict[str, int] = {}

    def walk(node: yaml.Node, prefix: str) -> None:
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                path = join_key(prefix, str(k.value))
                lines.setdefault(path, k.start_mark.line + 1)
                walk(v, path)

    root = yaml.compose(text, Loader=yaml.SafeLoader)  # composing builds no Python objects
    if root is not None:
        walk(root, "")
    return lines

