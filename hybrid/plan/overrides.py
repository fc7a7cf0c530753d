"""Command-line overrides of a plan: omegaconf-style ``key=value`` applied to the raw mapping.

``topology.parameter_servers=2``, ``sync.staleness=1``, ``modules.over_arch.strategy=ddp``,
``modules."*".strategy=fsdp``, ``modules.sparse_arch.embedding_bag_collection.sharding=table_wise``.

Module paths contain dots, so under ``modules`` the rule key is the longest prefix that names a
rule of the file, or else everything up to the first option name (``strategy``, ``sharding``...);
quote a path to say it outright (``modules."a.b".strategy=ddp``). Overriding a rule's
``strategy`` starts the rule afresh, because the file's options belonged to the old strategy;
the other overrides of that rule then apply on top, whatever their order.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from hybrid.plan.errors import PlanError, join_key
from hybrid.plan.schema import OPTION_NAMES

_EXAMPLES = "e.g. topology.parameter_servers=2 or modules.over_arch.strategy=ddp"


def apply_overrides(raw: dict[str, Any], overrides: Sequence[str], prefix: str = "") -> dict[str, Any]:
    """A copy of the plan mapping ``raw`` with every ``key=value`` of ``overrides`` set.

    ``prefix`` is what the command line wrote before each override (``plan.`` for ``hybrid
    train``); messages quote the override as it was typed."""
    raw = copy.deepcopy(raw)
    parsed = [_parse(text, raw, prefix + text) for text in overrides]
    parsed.sort(key=lambda p: p[0][-1:] != ["strategy"])  # stable: strategy resets go first
    for parts, value, shown in parsed:
        try:
            _set(raw, parts, value)
        except PlanError as e:
            raise e.at(override_where(shown)) from None
    return raw


def override_where(shown: str) -> str:
    """The ``where`` of an error whose value came from the override ``shown`` (as typed)."""
    return f"override {shown!r}"


def override_key(text: str) -> str:
    """The plan key an override sets, as error keys spell it (``modules.*.strategy``)."""
    return ".".join(_split_key(text.partition("=")[0].strip(), text))


def _parse(text: str, raw: Mapping[str, Any], shown: str) -> tuple[list[str], Any, str]:
    """``text`` -> (key parts, value, ``shown``); ``shown`` is ``text`` as typed, for messages."""
    key, sep, value_text = text.partition("=")
    if not sep or not key.strip():
        raise _error(f"override {shown!r} is not key=value; {_EXAMPLES}")
    parts = _split_key(key.strip(), shown)
    if parts[0] == "modules" and len(parts) > 1:
        rules = raw.get("modules") if isinstance(raw.get("modules"), dict) else {}
        parts = ["modules", *_split_rule_path(parts[1:], rules)]
    return parts, _parse_value(value_text, shown), shown


def _parse_value(value_text: str, text: str) -> Any:
    # omegaconf's own dotlist parser (a yaml SafeLoader), so values read as in omegaconf.
    try:
        return OmegaConf.to_container(OmegaConf.from_dotlist([f"v={value_text}"]))["v"]
    except (yaml.YAMLError, OmegaConfBaseException) as e:
        first = str(e).splitlines()[0]
        category = "unsafe_yaml" if "could not determine a constructor" in first else "bad_override"
        detail = f"override {text!r}: cannot read the value {value_text!r} ({first})"
        raise _error(detail, category) from None


def _split_key(key: str, text: str) -> list[str]:
    """``modules."a.b".x`` -> ``["modules", "a.b", "x"]``."""
    parts, current, quote = [], "", ""
    for ch in key:
        if quote:
            quote, current = ("", current) if ch == quote else (quote, current + ch)
        elif ch in "\"'":
            quote = ch
        elif ch == ".":
            parts.append(current)
            current = ""
        else:
            current += ch
    parts.append(current)
    if quote or any(not p for p in parts):
        raise _error(f"override {text!r}: cannot parse the key {key!r}; {_EXAMPLES}")
    return parts


def _split_rule_path(parts: list[str], rules: Mapping[str, Any]) -> list[str]:
    """``[sparse_arch, embedding_bag_collection, sharding]`` -> ``[<its rule key>, sharding]``."""
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in rules:
            return [".".join(parts[:n]), *parts[n:]]
    for i in range(1, len(parts)):
        if parts[i] in OPTION_NAMES:
            return [".".join(parts[:i]), *parts[i:]]
    return [".".join(parts)]


def _set(raw: dict[str, Any], parts: list[str], value: Any) -> None:
    node = raw
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise PlanError(
                f"cannot set {'.'.join(parts[i + 1:])!r} inside it: it is {child!r}, not a mapping",
                category="bad_override",
                key=join_key(*parts[: i + 1]),
            )
        node = child
    is_strategy = len(parts) == 3 and parts[0] == "modules" and parts[2] == "strategy"
    if is_strategy and node.get("strategy") != value:
        node.clear()  # the file's options belonged to the old strategy
    node[parts[-1]] = value


def _error(detail: str, category: str = "bad_override") -> PlanError:
    return PlanError(detail, category=category, where="command line")  # type: ignore[arg-type]
