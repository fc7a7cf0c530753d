"""Plan + model + world size -> which module gets which strategy (:class:`ResolvedPlan`).

Keys under ``modules`` are module paths (``named_modules()`` names) or globs: ``*`` and ``?``
stay inside one path component, ``**`` crosses dots. A leading ``**.`` may match nothing, so
``**.embedding_bag_collection`` also matches a top-level one; ``a.**`` matches what is inside
``a``. A rule applies to the module it matches and to that module's whole subtree; a glob that
matches a module and its descendants applies at the outermost one, and skips matched modules
without parameters.

The default rule ``"*"`` covers the root of every maximal subtree that has parameters and
contains no explicitly ruled module: with rules for DLRM's ``sparse_arch.embedding_bag_collection``
alone, the default covers ``dense_arch`` and ``over_arch`` separately, never the root.

Exact paths beat globs. Only fsdp may nest in fsdp (both are listed;
:meth:`ResolvedPlan.apply_order` puts inner modules first, the order ``fully_shard`` needs).
"""

from __future__ import annotations

import difflib
import fnmatch
import re
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from hybrid.log import warn_once
from hybrid.plan.errors import Category, PlanError, join_key
from hybrid.plan.schema import DEFAULT_RULE, FSDPOptions, Plan, PSOptions, Rule


@dataclass(frozen=True)
class ResolvedModule:
    """One module and the strategy it gets."""

    fqn: str
    """Its ``named_modules()`` path (``""`` for the root)."""
    strategy: str
    """A key of :data:`hybrid.plan.schema.STRATEGY_OPTIONS`."""
    options: Any
    """The rule's options dataclass."""
    rule_key: str
    """The ``modules`` key that gave it (``"*"`` for the default rule)."""
    module_type: str
    """Class name of the module, e.g. ``EmbeddingBagCollection``."""


@dataclass
class ResolvedPlan:
    """Every ruled module of a model, in module order, with the process counts."""

    entries: list[ResolvedModule]
    plan: Plan
    world_size: int
    num_servers: int
    num_trainers: int
    _by_fqn: dict[str, ResolvedModule] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._by_fqn = {e.fqn: e for e in self.entries}

    @property
    def in_process(self) -> bool:
        """One-process mode: no server process, so this (only) trainer holds every
        ``parameter_server`` table itself, trained by the same server code (:mod:`hybrid.ps.transport`)."""
        return self.num_servers == 0 and bool(self.by_strategy("parameter_server"))

    @property
    def table_servers(self) -> int:
        """How many servers hold the tables: ``num_servers``, or 1 (``ps0``, this trainer) in
        one-process mode."""
        return 1 if self.in_process else self.num_servers

    def by_strategy(self, name: str) -> list[ResolvedModule]:
        """The entries with strategy ``name``, in module order."""
        return [e for e in self.entries if e.strategy == name]

    def entry(self, fqn: str) -> ResolvedModule:
        """The entry for module path ``fqn`` (``KeyError`` if it has none)."""
        return self._by_fqn[fqn]

    def apply_order(self) -> list[ResolvedModule]:
        """Entries with every module before its ancestors (post-order), siblings in module order."""
        out: list[ResolvedModule] = []
        stack: list[ResolvedModule] = []
        for e in self.entries:
            while stack and not _is_ancestor(stack[-1].fqn, e.fqn):
                out.append(stack.pop())
            stack.append(e)
        out.extend(reversed(stack))
        return out


def resolve(plan: Plan, model: nn.Module, *, world_size: int) -> ResolvedPlan:
    """Match ``plan``'s rules to ``model``'s modules and check that they fit ``world_size``.

    Raises :class:`PlanError` for a key that matches no module, conflicting or illegally
    nested rules, ``parameter_server`` on a non-embedding module, rules on modules without
    parameters, parameters no rule covers, and topologies that leave no trainer. Each error
    names where its key was written (:meth:`Plan.where`): the plan's line, or the override.
    """
    try:
        return _resolve(plan, model, world_size)
    except PlanError as e:
        if e.key == "world_size":  # the launch's process count, not a plan key
            raise
        raise e.at(plan.where(e.key)) from None


def _resolve(plan: Plan, model: nn.Module, world_size: int) -> ResolvedPlan:
    modules = dict(model.named_modules())
    # One process (``hybrid launch -n 1``, ``hybrid train`` without torchrun): no server process;
    # the trainer holds every parameter_server table itself (ResolvedPlan.in_process).
    num_servers = 0 if world_size == 1 else plan.topology.parameter_servers
    _check_world(world_size, num_servers)
    direct = _explicit_rules(plan, modules)
    _check_nesting(direct)
    covered = dict(direct)
    _cover_rest(model, "", direct, _ancestors_of(direct), plan.default_rule, covered)
    order = {fqn: i for i, fqn in enumerate(modules)}
    entries = [
        ResolvedModule(fqn, r.strategy, r.options, r.key, type(modules[fqn]).__name__)
        for fqn, r in sorted(covered.items(), key=lambda kv: order[kv[0]])
    ]
    for e in entries:
        _check_entry(e, modules[e.fqn], plan, num_servers, world_size)
    if num_servers and not any(e.strategy == "parameter_server" for e in entries):
        warn_once(f"plan: {num_servers} parameter server(s) but no module uses parameter_server")
    return ResolvedPlan(entries, plan, world_size, num_servers, world_size - num_servers)


def _check_world(world_size: int, num_servers: int) -> None:
    if world_size < 1:
        detail = f"got {world_size}; expected a number of processes >= 1"
        raise PlanError(detail, category="topology", key="world_size")
    if world_size - num_servers < 1:
        raise PlanError(
            f"{num_servers} parameter server(s) leave no trainer in world_size={world_size}: "
            f"start at least {num_servers + 1} processes or lower topology.parameter_servers",
            category="topology",
            key="topology.parameter_servers",
        )


def _explicit_rules(plan: Plan, modules: dict[str, nn.Module]) -> dict[str, Rule]:
    """Module path -> the explicit rule that names it (after specificity and conflict checks)."""
    hits: dict[str, list[Rule]] = {}
    for key, rule in plan.modules.items():
        if key == DEFAULT_RULE:
            continue
        for fqn in _matches(rule, modules):
            hits.setdefault(fqn, []).append(rule)
    return {fqn: _most_specific(fqn, rules) for fqn, rules in hits.items()}


def _matches(rule: Rule, modules: dict[str, nn.Module]) -> list[str]:
    key = rule.key
    if not _is_glob(key):
        if key not in modules:
            detail = f"no module {key!r} in the model{_suggest(key, modules)}"
            raise _rule_error(rule, detail, "unknown_module")
        if not _has_params(modules[key]):
            raise _rule_error(rule, _no_params_text(key, modules), "no_parameters")
        return [key]
    pattern = _glob_regex(key)
    found = [fqn for fqn in modules if fqn and pattern.fullmatch(fqn)]
    if not found:
        detail = f"the pattern {key!r} matches no module{_suggest(key, modules)}"
        raise _rule_error(rule, detail, "unknown_module")
    with_params = [fqn for fqn in found if _has_params(modules[fqn])]
    if not with_params:
        found_text = ", ".join(found[:5])
        detail = f"the pattern {key!r} matches only modules without parameters ({found_text})"
        raise _rule_error(rule, detail, "no_parameters")
    return [f for f in with_params if not any(_is_ancestor(g, f) for g in with_params if g != f)]


def _most_specific(fqn: str, rules: list[Rule]) -> Rule:
    exact = [r for r in rules if r.key == fqn]
    if exact:
        return exact[0]
    first = rules[0]
    for other in rules[1:]:
        if (other.strategy, other.options) != (first.strategy, first.options):
            raise PlanError(
                f"module {fqn!r} is matched by {first.key!r} ({first.strategy}) and {other.key!r} "
                f"({other.strategy}), equally specific globs with different settings; add an exact "
                f"rule for {fqn!r} or narrow one of the patterns",
                category="conflicting_rules",
                key=f"modules.{other.key}",
                where=other.where,
            )
    return first


_NESTING_ERRORS: dict[tuple[str, str], Category] = {
    ("ddp", "fsdp"): "fsdp_under_ddp",
    ("fsdp", "ddp"): "ddp_under_fsdp",
}


def _check_nesting(direct: dict[str, Rule]) -> None:
    for fqn, inner in direct.items():
        for anc in _proper_ancestors(fqn):
            outer = direct.get(anc)
            if outer is None or (outer.strategy, inner.strategy) == ("fsdp", "fsdp"):
                continue
            category = _NESTING_ERRORS.get((outer.strategy, inner.strategy), "nested_rules")
            detail = (
                f"{inner.strategy} on {fqn!r} lies inside {anc!r}, which rule {outer.key!r} "
                f"already puts under {outer.strategy}; only fsdp may nest inside fsdp. Remove one "
                f"of the two rules, or rule the children of {anc!r} one by one instead of "
                f"{anc!r} itself"
            )
            raise _rule_error(inner, detail, category)


def _cover_rest(
    module: nn.Module,
    fqn: str,
    direct: dict[str, Rule],
    holds_rule: set[str],
    default: Rule | None,
    covered: dict[str, Rule],
) -> None:
    """Give the default rule to each maximal ruled-free subtree with parameters below ``fqn``."""
    if fqn in direct:
        return
    if fqn not in holds_rule:
        if _has_params(module):
            if default is None:
                detail = (
                    f"module {fqn or '<root>'!r} ({type(module).__name__}, {_count(module)} "
                    'parameters) matches no rule; add a rule for it or a default rule "*": '
                    "{strategy: ddp}"
                )
                raise PlanError(detail, category="no_rule", key="modules")
            covered[fqn] = default
        return
    own = [name for name, _ in module.named_parameters(recurse=False)]
    if own:
        ruled = sorted(f for f in direct if _is_ancestor(fqn, f))
        split = ", ".join(f"{f}: {direct[f].strategy}" for f in ruled)
        detail = (
            f"module {fqn or '<root>'!r} has its own parameters ({', '.join(own)}) but rules split "
            f"its children ({split}), so nothing would own them; give {fqn or 'the root'!r} itself "
            "a rule (fsdp may wrap inner fsdp rules), or rule the children without splitting it"
        )
        raise PlanError(detail, category="own_parameters", key=f"modules.{ruled[0]}")
    for name, child in module.named_children():
        _cover_rest(child, join_key(fqn, name), direct, holds_rule, default, covered)


def _check_entry(e: ResolvedModule, module: nn.Module, plan: Plan, num_servers: int, world_size: int) -> None:
    rule = plan.modules[e.rule_key]
    if e.strategy == "parameter_server":
        _check_embedding(e, module, rule)
        _check_servers(e, rule, num_servers, world_size, plan.topology.parameter_servers)
    if isinstance(e.options, FSDPOptions):
        _check_wrap(e, module, rule)


def _check_embedding(e: ResolvedModule, module: nn.Module, rule: Rule) -> None:
    from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection

    accepted = (EmbeddingBagCollection, EmbeddingCollection, nn.EmbeddingBag, nn.Embedding)
    if not isinstance(module, accepted):
        detail = (
            "parameter_server needs an embedding module (EmbeddingBagCollection, "
            f"EmbeddingCollection, nn.EmbeddingBag or nn.Embedding); {e.fqn!r} is a "
            f"{e.module_type}{_suggest_embedding(module, e.fqn, accepted)}"
        )
        raise _rule_error(rule, detail, "not_an_embedding")
    # torchrec collections only pool with sum or mean; a plain EmbeddingBag may also use max.
    if isinstance(module, nn.EmbeddingBag) and module.mode not in ("sum", "mean"):
        detail = (
            f"table {e.fqn!r} pools with {module.mode!r}; the parameter servers support "
            "'sum' and 'mean'"
        )
        raise _rule_error(rule, detail, "unsupported_table")
    # The servers apply their own sparse optimizer to plain rows: nothing renormalizes rows, scales
    # gradients by frequency or hands torch a sparse gradient.
    # An nn.EmbeddingBag's padding_idx drops that id from its bags, which the servers' pooling
    # does not do (an nn.Embedding's padding row is kept at zero and never sent); its sparse
    # gradients change no number (the servers never hand torch a gradient).
    if isinstance(module, (nn.Embedding, nn.EmbeddingBag)):
        bag = isinstance(module, nn.EmbeddingBag)
        refused = [f"{k}={v!r}" for k, v in (("max_norm", module.max_norm),
                                             ("scale_grad_by_freq", module.scale_grad_by_freq),
                                             ("sparse", None if bag else module.sparse),
                                             ("padding_idx", module.padding_idx if bag else None))
                   if v is not None and v is not False]  # padding_idx 0 counts
        if refused:
            detail = (f"{'nn.EmbeddingBag' if bag else 'nn.Embedding'} {e.fqn!r} has {', '.join(refused)}, which "
                      f"the parameter servers do not support; build it without"
                      f"{'' if bag else ' (padding_idx is supported)'}")
            raise _rule_error(rule, detail, "unsupported_table")


def _check_servers(e: ResolvedModule, rule: Rule, num_servers: int, world_size: int, declared: int) -> None:
    if num_servers == 0:
        if world_size == 1:
            # One-process mode: the trainer holds the tables; the server indices must still fit
            # the plan's own topology, which a launch on more processes would use.
            if declared:
                _check_servers(e, rule, declared, declared + 1, declared)
            return
        detail = (
            f"0 with {world_size} trainers, but {e.fqn!r} (rule {rule.key!r}) uses parameter_server; "
            f"set parameter_servers >= 1, run one process (one-process mode holds the tables in "
            f"the trainer), or give {e.fqn!r} another strategy"
        )
        raise PlanError(detail, category="topology", key="topology.parameter_servers")
    options: PSOptions = e.options
    bad = [s for s in options.server_list(num_servers) if s >= num_servers]
    if bad:
        raise PlanError(
            f"server indices {bad} do not exist: topology.parameter_servers={num_servers} gives "
            f"ps0..ps{num_servers - 1}; use indices in 0..{num_servers - 1} or 'all'",
            category="topology",
            key=f"modules.{rule.key}.servers",
        )


def _check_wrap(e: ResolvedModule, module: nn.Module, rule: Rule) -> None:
    classes = {type(m).__name__ for name, m in module.named_modules() if name}
    for i, cls in enumerate(e.options.wrap):
        if cls not in classes:
            there = ", ".join(sorted(classes)) or "none"
            detail = f"no module of class {cls!r} under {e.fqn!r}; classes there: {there}"
            key = f"modules.{rule.key}.wrap.{i}"
            raise PlanError(detail, category="bad_value", key=key)


def _rule_error(rule: Rule, detail: str, category: Category) -> PlanError:
    return PlanError(detail, category=category, key=f"modules.{rule.key}", where=rule.where)


def _suggest(key: str, modules: dict[str, nn.Module]) -> str:
    names = [n for n in modules if n]
    last = key.rpartition(".")[2].replace("*", "")
    # A path missing its parent ("embedding_bag_collection") is the usual slip: match the last name.
    close = [n for n in names if last and n.rpartition(".")[2] == last]
    close = close or difflib.get_close_matches(key, names, n=3, cutoff=0.6)
    if close:
        return "; did you mean " + " or ".join(repr(n) for n in close[:3]) + "?"
    top = [n for n in names if "." not in n]
    return f"; top-level modules: {', '.join(top)} (`hybrid plan show` lists them all)"


def _suggest_embedding(module: nn.Module, fqn: str, accepted: tuple[type, ...]) -> str:
    found = [join_key(fqn, n) for n, m in module.named_modules() if isinstance(m, accepted)]
    return f"; did you mean {found[0]!r}?" if found else ""


def _no_params_text(key: str, modules: dict[str, nn.Module]) -> str:
    return (
        f"module {key!r} ({type(modules[key]).__name__}) has no parameters, so no strategy "
        "applies to it; remove the rule"
    )


def _glob_regex(pattern: str) -> re.Pattern[str]:
    """fnmatch with ``*``/``?`` inside one path component and ``**`` across components."""
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**.", i):
            out, i = out + r"(?:.*\.)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + r"[^.]*", i + 1
        elif pattern[i] == "?":
            out, i = out + r"[^.]", i + 1
        elif pattern[i] == "[" and "]" in pattern[i + 1 :]:
            end = pattern.index("]", i + 1)
            out, i = out + fnmatch.translate(pattern[i : end + 1])[4:-3], end + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out)


def _is_glob(key: str) -> bool:
    return any(c in key for c in "*?[")


def _is_ancestor(anc: str, fqn: str) -> bool:
    """``anc`` is ``fqn`` or contains it."""
    return anc == fqn or anc == "" or fqn.startswith(anc + ".")


def _proper_ancestors(fqn: str) -> list[str]:
    if not fqn:
        return []
    parts = fqn.split(".")
    return [".".join(parts[:i]) for i in range(len(parts))]


def _ancestors_of(fqns: dict[str, Rule]) -> set[str]:
    """Every module path that is one of ``fqns`` or contains one."""
    return {a for f in fqns for a in [*_proper_ancestors(f), f]}


def _has_params(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def _count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())
