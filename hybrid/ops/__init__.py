"""Native operators of the sparse path: the trainer's routing of a batch and the server's row
reads and updates, as typed torch operators (``torch.ops.hybrid.*``, built from ``csrc/`` into
``hybrid._C`` at install time; see docs/native.md).

Every function here has the signature and the results of its plain-torch twin in
:mod:`hybrid.ops.reference` -- bit for bit, tested in tests/unit/test_ops.py. Where the
extension is not built (``AVAILABLE`` false) the twins run instead, after one warning at import.

Ids must be int64 (int32 is widened); floating tensors float32, bfloat16 or float16 where the
reference takes them. A wrong dtype, shape, layout or device raises (``TypeError`` or
``ValueError`` naming the argument); an id outside its table raises :class:`RowOutOfRange`, a
non-finite gradient or new weight :class:`NonFinite`, and then nothing was written.
"""

from __future__ import annotations

import warnings

import torch

from hybrid.ops.reference import DynamicPlan, ForeignPart, NonFinite, PartFull, Route, RowOutOfRange, _table_views

__all__ = ["AVAILABLE", "DynamicPlan", "ForeignPart", "NonFinite", "PartFull", "Route", "RowOutOfRange",
           "bag_rows", "criteo_parse", "csv_records_end", "die_with_parent", "dynamic_commit_", "dynamic_plan", "dynamic_rows", "gather_rows", "merge_ids", "initial_rows_", "optimizer_rows",
           "optimizer_step_", "populate_", "route", "route_hashed", "scatter_rows_", "sgd_bags_", "sgd_rows_", "sum_rows", "sum_runs"]

OPS = ("route", "route_hashed", "gather_rows", "sgd_rows_", "sgd_bags_", "sum_rows", "optimizer_rows",
       "optimizer_step_", "scatter_rows_", "initial_rows_", "merge_ids", "sum_runs", "dynamic_plan", "dynamic_commit_",
       "dynamic_rows", "populate_", "bag_rows", "die_with_parent", "criteo_parse", "csv_records_end")
"""The operators ``hybrid._C`` registers under ``torch.ops.hybrid``."""

STATE_KEYS = {"sgd": (), "adagrad": ("sum",), "rowwise_adagrad": ("sum",),
              "adam": ("exp_avg", "exp_avg_sq", "step")}
"""Each optimizer's state, in the order ``optimizer_rows`` takes and returns it."""

_OK, _BAD_ROW, _NON_FINITE = 0, 1, 2  # status codes of the operators (csrc/kernels.h)


def _load() -> bool:
    """Whether the extension loads and registers every operator; warns once when it does not."""
    try:
        import hybrid._C  # noqa: F401  (registers torch.ops.hybrid.*)
    except ImportError as e:
        why = f"hybrid._C does not load ({e})"
    else:
        missing = [name for name in OPS if not hasattr(torch.ops.hybrid, name)]
        if not missing:
            return True
        why = f"hybrid._C lacks {', '.join(missing)} (a stale build)"
    warnings.warn(f"hybrid.ops: {why}; using the plain-torch operators of hybrid.ops.reference, which are "
                  f"slower. Build the extension with `make env` (pip install --no-build-isolation -e .).",
                  RuntimeWarning, stacklevel=3)
    return False


AVAILABLE: bool = _load()
"""Whether the native operators run (else the plain-torch reference does)."""


def _index(t: torch.Tensor) -> torch.Tensor:
    """Ids as the operators take them: int64 (int32 widened), contiguous."""
    return (t.to(torch.int64) if t.dtype == torch.int32 else t).contiguous()


def _out_of_range(status, ids: torch.Tensor, rows_of) -> RowOutOfRange:
    """The :class:`RowOutOfRange` of a status ``(code, table, position, count)``;
    ``rows_of(table)`` is that table's number of rows."""
    _, table, position, _ = status
    return RowOutOfRange(table, position, int(ids[position]), rows_of(table))


def route(ids, lengths, feature_table, row_base, shards, server_rank, *, num_servers, batch_size,
          weights=None, mean=False, sample_major=True, backward=True) -> Route:
    """How one batch's ids split over servers and how to pool the replies: see
    :class:`hybrid.ops.reference.Route` for every field. ``ids`` and ``lengths`` are
    feature-major; ``feature_table[f]`` is feature ``f``'s table, ``row_base`` each table's first
    row in one row space (tables + 1 entries), ``shards[t]`` table ``t``'s shards and
    ``server_rank[t, s]`` the server of its shard ``s`` (row ``r`` is in shard ``r % shards``).
    ``backward`` false: no backward's index (``grad_*`` None; bags the servers pool, whose index
    they work out themselves). Raises :class:`RowOutOfRange` (nothing routed) when an id is
    outside its table."""
    ids, lengths = _index(ids), _index(lengths)
    w = weights.contiguous() if weights is not None else None
    (*status, requests_ids, per, raw, idx, offsets, out_weights, grad_bags, grad_offsets,
     grad_scale) = torch.ops.hybrid.route(ids, lengths, feature_table, row_base, shards, server_rank,
                                          num_servers, batch_size, w, mean, sample_major, backward)
    if status[0] != _OK:
        raise _out_of_range(status, ids, lambda t: int(row_base[t + 1] - row_base[t]))
    return _route_of(requests_ids, per, raw, idx, offsets, out_weights if weights is not None else None,
                     grad_bags, grad_offsets, grad_scale if mean or weights is not None else None, backward)


def _route_of(requests_ids, per, raw, idx, offsets, weights, grad_bags, grad_offsets, grad_scale,
              backward: bool) -> Route:
    if not backward:
        grad_bags = grad_offsets = grad_scale = None
    return Route(requests_ids=requests_ids, per=per, raw=raw, idx=idx, offsets=offsets, weights=weights,
                 grad_bags=grad_bags, grad_offsets=grad_offsets, grad_scale=grad_scale,
                 num_unique=requests_ids.numel())


def route_hashed(ids, lengths, feature_table, shards, server_rank, *, partitions, num_servers, batch_size,
                 weights=None, mean=False, sample_major=True, backward=True) -> Route:
    """:func:`route` for raw int64 ids (``ids: dynamic``): deduplicated by (table, id), each
    distinct id sent as itself (ascending within its table) to the server of its part
    (``fmix64(id) mod partitions``; part ``p`` on the table's shard ``p % shards[t]``)."""
    ids, lengths = _index(ids), _index(lengths)
    w = weights.contiguous() if weights is not None else None
    (_, _, _, _, requests_ids, per, raw, idx, offsets, out_weights, grad_bags, grad_offsets,
     grad_scale) = torch.ops.hybrid.route_hashed(ids, lengths, feature_table, shards, server_rank, partitions,
                                                 num_servers, batch_size, w, mean, sample_major, backward)
    return _route_of(requests_ids, per, raw, idx, offsets, out_weights if weights is not None else None,
                     grad_bags, grad_offsets, grad_scale if mean or weights is not None else None, backward)


def gather_rows(tables, ids, counts, *, out=None, dtype=torch.float32) -> torch.Tensor:
    """Rows ``ids`` of the tables, flat: the first ``counts[0]`` ids are rows of ``tables[0]``,
    and so on. Into ``out`` (its first elements) where given, else a new tensor of ``dtype``;
    rows are converted to the output's dtype. Raises :class:`RowOutOfRange`."""
    ids = _index(ids)
    numel = sum(n * t.shape[1] for n, t in zip(counts, tables))
    out = torch.empty(numel, dtype=dtype) if out is None else out
    status = torch.ops.hybrid.gather_rows(tables, ids, counts, out)
    if status[0] != _OK:
        raise _out_of_range(status, ids, lambda t: tables[t].shape[0])
    return out[:numel]


def pool_rows(tables, ids, counts, idx, offsets, *, weights=None, mean=False, out) -> torch.Tensor:
    """Bags pooled straight from the tables (``pool_on: server``): the rows ``ids`` of the tables
    (split by ``counts`` as in :func:`gather_rows`, every table of one dim and dtype) numbered in
    that order, bag ``b`` pooling rows ``idx[offsets[b]:offsets[b + 1]]`` (int32) -- summed, each
    times its per-sample weight where ``weights`` is given, or their mean -- into row ``b`` of
    ``out`` (``bags x dim`` elements, converted to its dtype). Equal bit for bit to
    ``embedding_bag`` over :func:`gather_rows`' rows, without gathering them first. Raises
    :class:`RowOutOfRange`."""
    ids = _index(ids)
    status = torch.ops.hybrid.pool_rows(tables, ids, counts, idx.contiguous(), offsets.contiguous(),
                                        None if weights is None else weights.contiguous(), bool(mean), out)
    if status[0] != _OK:
        raise _out_of_range(status, ids, lambda t: tables[t].shape[0])
    return out


def _raise_gradient_status(status, ids: torch.Tensor, tables) -> None:
    """The status of a plain-SGD update (``sgd_rows_``, ``sgd_bags_``) as its exception, if any."""
    if status[0] == _BAD_ROW:
        raise _out_of_range(status, ids, lambda t: tables[t].shape[0])
    if status[0] == _NON_FINITE:
        raise NonFinite(f"non-finite gradient in {status[3]} rows (the first: position {status[2]}, "
                        f"table {status[1]}); nothing was applied")


def sgd_rows_(tables, ids, counts, grad, *, alpha) -> None:
    """``tables[t][id] += alpha * grad_row`` for each id in order (``ids`` and the flat ``grad``
    split by ``counts`` as in :func:`gather_rows`); a repeated id adds each of its rows, and a
    table listed more than once (say once per contribution) is updated in the order listed.
    ``grad`` may be a list of flat tensors that together hold the rows in order, each whole
    tables' (one per contribution: no copy to join them). Raises :class:`RowOutOfRange` or
    :class:`NonFinite` (a gradient not finite) before writing anything."""
    ids = _index(ids)
    grads = [g.contiguous() for g in grad] if isinstance(grad, (list, tuple)) else [grad.contiguous()]
    status = torch.ops.hybrid.sgd_rows_(tables, ids, counts, grads, alpha)
    _raise_gradient_status(status, ids, tables)


def sgd_bags_(tables, ids, counts, grad, groups, *, alpha) -> None:
    """:func:`sgd_rows_` with the row gradients of a lookup pooled on the server summed from its
    bags' gradients as it goes (bit for bit what ``embedding_bag`` over the bags' gradients and
    then :func:`sgd_rows_` give, without the row gradients in memory). ``grad``: the bags'
    gradients, float32, group after group (``bags x dim`` each); ``groups``: per group ``(bags,
    dim, grad_bags, grad_offsets, grad_scale)`` (the last three from :func:`bag_rows`), whose
    rows are the next tables' ids in order, each id once. Raises :class:`RowOutOfRange` or
    :class:`NonFinite` before writing anything."""
    ids = _index(ids)
    status = torch.ops.hybrid.sgd_bags_(tables, ids, counts, grad.contiguous(), [g[2] for g in groups],
                                        [g[3] for g in groups], [g[4] for g in groups], [int(g[0]) for g in groups],
                                        [int(g[1]) for g in groups], alpha)
    _raise_gradient_status(status, ids, tables)


def sum_rows(ids, grads, *, scale, num_rows):
    """The distinct ``ids`` (ascending) and, for each, the sum of its ``grads`` rows (float32, in
    arrival order) times ``scale``. Raises :class:`RowOutOfRange` (an id outside
    ``[0, num_rows)``)."""
    ids = _index(ids)
    *status, rows, summed = torch.ops.hybrid.sum_rows(ids, grads.contiguous(), scale, num_rows)
    if status[0] != _OK:
        raise _out_of_range(status, ids, lambda t: num_rows)
    return rows, summed


def optimizer_rows(kind, rows, grads, *, grad_scale, weight, state, lr, eps, weight_decay, beta1, beta2):
    """One ``kind`` step (sgd, adagrad, rowwise_adagrad, adam) of the distinct ``rows`` of
    ``weight`` with gradients ``grads * grad_scale``: the new rows (float32) and the new rows of
    each ``state`` tensor, by name. Writes nothing (:func:`scatter_rows_` does). Raises
    :class:`RowOutOfRange`, or :class:`NonFinite` when a new weight is not finite."""
    if kind not in STATE_KEYS:
        raise ValueError(f"unknown optimizer {kind!r}; expected one of {', '.join(STATE_KEYS)}")
    rows = _index(rows)
    keys = STATE_KEYS[kind]
    missing = [k for k in keys if k not in state]
    if missing:
        raise ValueError(f"{kind} state lacks {', '.join(missing)} (it has {', '.join(state) or 'nothing'})")
    *status, w, new_state = torch.ops.hybrid.optimizer_rows(
        kind, rows, grads.contiguous(), grad_scale, weight, [state[k] for k in keys], lr, eps, weight_decay,
        beta1, beta2)
    if status[0] == _BAD_ROW:
        raise _out_of_range(status, rows, lambda t: weight.shape[0])
    if status[0] == _NON_FINITE:
        raise NonFinite(f"{kind} update produced non-finite weights for {status[3]} rows (the first: row "
                        f"{int(rows[status[2]])}); nothing was applied")
    return w, dict(zip(keys, new_state))


def optimizer_step_(kind, weights, states, rows, grads, grad_scales, *, lr, eps, weight_decay, beta1, beta2) -> None:
    """One ``kind`` step of several tables, in place: table ``t``'s distinct ``rows[t]`` of
    ``weights[t]`` and of its state ``states[t]`` (by name) with gradients ``grads[t] *
    grad_scales[t]`` -- what :func:`optimizer_rows` computes, written as :func:`scatter_rows_`
    would. All or nothing: raises :class:`RowOutOfRange` (``table`` the table's index), or
    :class:`NonFinite` when a new weight is not finite, and then no table has changed."""
    if kind not in STATE_KEYS:
        raise ValueError(f"unknown optimizer {kind!r}; expected one of {', '.join(STATE_KEYS)}")
    keys = STATE_KEYS[kind]
    flat = []
    for state in states:
        missing = [k for k in keys if k not in state]
        if missing:
            raise ValueError(f"{kind} state lacks {', '.join(missing)} (it has {', '.join(state) or 'nothing'})")
        flat += [state[k] for k in keys]
    rows = [_index(r) for r in rows]
    status = torch.ops.hybrid.optimizer_step_(kind, list(weights), flat, rows, [g.contiguous() for g in grads],
                                              [float(x) for x in grad_scales], lr, eps, weight_decay, beta1, beta2)
    if status[0] == _BAD_ROW:
        raise _out_of_range(status, rows[status[1]], lambda t: weights[status[1]].shape[0])
    if status[0] == _NON_FINITE:
        raise NonFinite(f"{kind} update produced non-finite weights for {status[3]} rows (the first: row "
                        f"{int(rows[status[1]][status[2]])}); nothing was applied")


def scatter_rows_(dst, rows, src) -> None:
    """``dst[rows[i]] = src[i]`` (rows of a 2-D ``dst``, elements of a 1-D one), ``src``
    converted to ``dst``'s dtype. Raises :class:`RowOutOfRange` before writing anything."""
    rows = _index(rows)
    status = torch.ops.hybrid.scatter_rows_(dst, rows, src.contiguous())
    if status[0] != _OK:
        raise _out_of_range(status, rows, lambda t: dst.shape[0])


def initial_rows_(out, rows, *, key, bound) -> None:
    """Fill ``out`` ([len(rows), dim], float32, bfloat16 or float16) with the initial values of
    global rows ``rows`` (int64) of the table whose 32-bit hash key is ``key``: element
    ``(i, c)`` is uniform in ``[-bound, bound)``, a pure function of ``(key, rows[i], c)``
    (see :mod:`hybrid.ps.init`), rounded into ``out``'s dtype."""
    rows = _index(rows)
    if out.is_contiguous():
        torch.ops.hybrid.initial_rows_(out, rows, key, bound)
    else:
        filled = torch.empty(out.shape, dtype=out.dtype)
        torch.ops.hybrid.initial_rows_(filled, rows, key, bound)
        out.copy_(filled)


def populate_(memory: torch.Tensor, *, huge_pages: bool = False, collapse: bool = False) -> bool:
    """Back the whole pages inside ``memory`` (a contiguous CPU tensor) with memory now, keeping
    their contents: in transparent huge pages where ``huge_pages`` asks (``collapse``: also
    merging small pages already there). Safe while other threads write into the same range.
    Returns whether the kernel populated them (False: the pages come at the first write)."""
    return bool(torch.ops.hybrid.populate_(memory, huge_pages, collapse))


_SLOT_STATE = ("slot_id", "occupied", "last", "count", "fill", "part_base", "part_cap", "slot_part", "slot_index",
               "lru_pos", "lru_queue", "lru_head", "lru_tail")
"""The tensors of a dynamic table's slot state (:class:`hybrid.ps.server.dynamic.DynamicSlots`)."""


def _slot_state(tables) -> list[list[torch.Tensor]]:
    return [[getattr(s, name) for s in tables] for name in _SLOT_STATE]


def dynamic_plan(tables, ids, found, seen, counts, *, step, partitions, admit_after, evict, ttl) -> DynamicPlan:
    """One update of dynamic tables, decided and nothing changed: table ``t``'s distinct
    ascending ids are the ``counts[t]``-long run of ``ids`` after the earlier tables', ``found``
    their slots in its map (-1: none), ``seen`` their sightings (-1: none; empty unless
    ``admit_after > 1``); ``tables[t]`` its slot state (of which it may write only a part's
    eviction queue, made the first time the part needs one). ``evict``: ``none``, ``lru`` or ``ttl``
    (rows untouched for more than ``ttl`` steps go). Raises :class:`PartFull` (the first table,
    then part, that cannot take its new ids) or :class:`ForeignPart`."""
    (code, table, where, need, slots, sizes, new_ids, new_slots, evicted, seen_ids, seen_counts,
     admitted_seen) = torch.ops.hybrid.dynamic_plan(_index(ids), _index(found), _index(seen), list(counts),
                                                     *_slot_state(tables), step, partitions, admit_after, evict,
                                                     ttl)
    if code == 1:
        raise PartFull(table, where, need)
    if code == 2:
        raise ForeignPart(table, where)
    return DynamicPlan(slots, sizes, new_ids, new_slots, evicted, seen_ids, seen_counts, admitted_seen)


def merge_ids(ids, counts, *, runs):
    """The distinct ids of an update whose ids come, table after table, as ``runs`` ascending
    distinct runs each (``counts[t * runs + r]`` long): (the distinct ids, ascending within a
    table; how many each table has; each input id's index in the distinct ids)."""
    return torch.ops.hybrid.merge_ids(_index(ids), list(counts), runs)


def sum_runs(grads, inverse, per, runs, *, scale) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The summed gradient rows of the distinct ids :func:`merge_ids` found: ``grads`` are the
    runs' gradient rows (float32 ``[n, dim]``, table after table, ``runs[t]`` runs of table
    ``t``), ``inverse`` merge_ids's index of each of their ids, ``per`` the distinct ids of each
    table. Each distinct id's rows are added into zeros in run order, then times ``scale`` (what
    :func:`sum_rows` computes, without its sort). Returns them flat, table after table, and as
    each table's ``[per[t], dim]`` view of that."""
    per, runs = [int(x) for x in per], [int(x) for x in runs]
    flat = torch.ops.hybrid.sum_runs([g.contiguous() for g in grads], _index(inverse), per, runs, float(scale))
    dims, j = [], 0
    for r in runs:
        dims.append(grads[j].shape[1] if r else 0)
        j += r
    return flat, _table_views(flat, per, dims)


def dynamic_commit_(tables, plan: DynamicPlan, counts, *, step, weights=(), keys=(), bounds=()) -> torch.Tensor:
    """Carry out ``plan`` (of :func:`dynamic_plan`, same tables and counts) on the slot state:
    rows evicted, new ids placed, touched slots stamped ``step``; where ``weights`` are given
    (one table per slot state), each new row's initial value (:func:`initial_rows_` with
    ``keys[t]``, ``bounds[t]``, keyed by the raw id) written at its slot. Returns the evicted
    rows' ids (each table's run as in ``plan.evicted``), for the caller's id maps."""
    sizes = plan.sizes.tolist()
    return torch.ops.hybrid.dynamic_commit_(plan.slots, list(counts), plan.new_ids, plan.new_slots,
                                            [z[0] for z in sizes], plan.evicted, [z[1] for z in sizes],
                                            *_slot_state(tables), step, list(weights), [int(k) for k in keys],
                                            [float(b) for b in bounds])


def dynamic_rows(weights, ids, slots, seen, counts, *, admit_after, keys, bounds, out) -> torch.Tensor:
    """The looked-up rows of dynamic tables into the float32 ``out`` (flat, table after table):
    for id ``i`` of table ``t`` (its ``counts[t]``-long run), ``weights[t][slots[i]]`` where it
    has a slot, its initial value (:func:`initial_rows_` with ``keys[t]``, ``bounds[t]``) where
    this step's update admits it (``admit_after <= 1``, or ``seen[i] + 1 >= admit_after``),
    zeros otherwise. Returns each table's ids that had a row."""
    return torch.ops.hybrid.dynamic_rows(list(weights), _index(ids), _index(slots), _index(seen), list(counts),
                                         admit_after, [int(k) for k in keys], [float(b) for b in bounds], out)


def bag_rows(idx, offsets, *, rows, features, weights=None, mean=False):
    """The backward's index of bags pooled on a server (``pool_on: server``): ``idx`` (int32)
    the row of every id bag by bag, ``offsets`` (int32) the bags' bounds, bags numbered sample by
    sample over ``features`` features (bag ``s * features + j``). Returns, grouped row by row
    (``grad_offsets``, ``rows + 1`` bounds), each row's bags (``grad_bags``) and factors
    (``grad_scale``: the weights, ``1 / len(bag)`` for ``mean``, else None) in the order a
    trainer's :func:`route` gives them: feature, then sample, then place in the bag."""
    grad_bags, grad_offsets, grad_scale = torch.ops.hybrid.bag_rows(
        idx.contiguous(), offsets.contiguous(), int(rows), int(features),
        None if weights is None else weights.contiguous(), bool(mean))
    return grad_bags, grad_offsets, grad_scale if weights is not None or mean else None


def die_with_parent(signal: int) -> bool:
    """Have the kernel send ``signal`` to this process when the thread that started it ends
    (Linux's parent-death signal). Returns whether the kernel took the request."""
    return bool(torch.ops.hybrid.die_with_parent(int(signal)))


def criteo_parse(text: torch.Tensor, rows) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The lines of Criteo TSV bytes (uint8; each line ends at ``\\n``, the last may not; trailing
    ``\\r`` ignored): per line a status (int8, 1: malformed), the label (float32), the dense
    values (int64 ``[n, 13]``: blank and negative 0, at most ``2**62``) and the ids (int64
    ``[n, 26]``: the hex value modulo ``rows[f]``, blank 0); a malformed line's values are 0.
    hybrid/data/criteo.py documents the format."""
    return torch.ops.hybrid.criteo_parse(text, [int(r) for r in rows])


def csv_records_end(text: torch.Tensor) -> int:
    """The offset just past the last ``\\n`` of CSV bytes (uint8, starting where a record starts)
    that ends a record as pyarrow's parser reads them (a line break inside a quoted field does
    not), or -1 when no record ends in ``text``."""
    return int(torch.ops.hybrid.csv_records_end(text))


# Without the extension every public name is the reference's own function.
if not AVAILABLE:
    from hybrid.ops.reference import (  # noqa: F811
        bag_rows,
        criteo_parse,
        csv_records_end,
        die_with_parent,
        dynamic_commit_,
        dynamic_plan,
        dynamic_rows,
        gather_rows,
        initial_rows_,
        merge_ids,
        optimizer_rows,
        optimizer_step_,
        populate_,
        pool_rows,
        route,
        route_hashed,
        scatter_rows_,
        sgd_bags_,
        sgd_rows_,
        sum_rows,
        sum_runs,
    )
