"""The row slots of one dynamic table shard (``ids: dynamic``): raw id -> slot, admission, eviction.

A shard holds whole parts of the table (see :class:`hybrid.ps.config.DynamicIds`); each part
owns a fixed block of slots. Everything that changes the map happens in :meth:`DynamicSlots.plan`
/ :meth:`DynamicSlots.commit`, once per applied update (sync: once per step, after every
trainer's push is in), on the step's distinct ids in ascending order, so admissions and
evictions are a function of the step's ids alone:

- an id in the map: its slot, last touched = this step;
- an id not in the map: one more sighting; at ``admit_after`` sightings it is admitted into its
  part: a free slot (lowest first), else under ``lru`` the slot touched longest ago (ties: the
  smaller id; never one touched this step), under ``ttl:N`` an expired one; none left: a
  :class:`CapacityError` before anything changed.

With ``admit_window`` W the sightings are forgotten at the end of every W-th step
(``CollectionShard._end_of_step``), so sightings count within windows of W steps.

Lookups (:meth:`DynamicSlots.find`, :func:`read_rows`) change nothing but the hit counters. The
maps probe in C++ (:mod:`hybrid.ops.id_map`); the decisions and the reads of every table of a
collection are one operator call each (``hybrid.ops.dynamic_plan``, ``dynamic_commit_``,
``dynamic_rows``), so a step's cost does not grow with Python work per table.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybrid import ops
from hybrid.errors import InputError
from hybrid.ops.id_map import IdMap, find_many, update_many
from hybrid.ps.config import DynamicIds, part_of  # noqa: F401 - part_of: the parts, for callers
from hybrid.ps.server.memory import table_tensor


class CapacityError(InputError):
    """A dynamic table's part is full and its ``evict`` policy frees no row; nothing changed."""


@dataclass
class Admission:
    """What :func:`plan_updates` decided for one table's update (views into ``plan``, the update
    of every table planned with it); :func:`commit_updates` does it."""

    plan: ops.DynamicPlan
    step: int
    ids: torch.Tensor
    """The update's distinct ids, ascending."""
    slots: torch.Tensor
    """Each id's slot after the update; -1: not admitted (its gradient is dropped)."""
    new_ids: torch.Tensor
    new_slots: torch.Tensor
    """Rows to create (initial value, fresh optimizer state)."""
    evicted: torch.Tensor
    """Slots whose row goes (the expired under ttl, and those taken for new ids), ascending."""
    seen_ids: torch.Tensor
    seen_counts: torch.Tensor
    """Sightings of the ids not yet admitted (admit_after > 1)."""
    admitted_seen: torch.Tensor
    """Ids leaving the sightings map (admitted now)."""


@dataclass
class DynamicCounters:
    admitted: int = 0
    evicted: int = 0
    hits: int = 0
    """Looked-up ids that had a row."""
    looked_up: int = 0

    def as_dict(self, rows: int, sightings: int) -> dict:
        """``sightings``: ids counted but without a row now (their map's size)."""
        return {"rows": rows, "sightings": sightings, "admitted": self.admitted, "evicted": self.evicted,
                "hits": self.hits, "looked_up": self.looked_up,
                "hit_ratio": self.hits / self.looked_up if self.looked_up else 1.0}


class DynamicSlots:
    """Slots of the parts ``parts`` of one dynamic table (``spec``)."""

    def __init__(self, spec: DynamicIds, parts: list[int], *, table: str, where: str, huge_pages: bool = False) -> None:
        """``huge_pages``: the id map's tensors in huge pages where available (``table_tensor``)."""
        self.spec, self.parts, self.table, self.where = spec, list(parts), table, where
        caps = [spec.part_capacity(p) for p in self.parts]
        self.capacity = sum(caps)
        self.part_base = torch.full((spec.partitions,), -1, dtype=torch.int64)
        self.part_cap = torch.zeros(spec.partitions, dtype=torch.int64)
        base = 0
        for p, c in zip(self.parts, caps):
            self.part_base[p], self.part_cap[p] = base, c
            base += c
        self.slot_part = torch.repeat_interleave(torch.tensor(self.parts, dtype=torch.int64),
                                                 torch.tensor(caps, dtype=torch.int64), output_size=base)
        self.slot_index = torch.arange(base) - self.part_base[self.slot_part]
        """Each slot's place inside its part (the order free slots are taken in)."""
        self.slot_id = torch.zeros(base, dtype=torch.int64)
        self.occupied = torch.zeros(base, dtype=torch.bool)
        self.last = torch.full((base,), -1, dtype=torch.int64)
        self.count = torch.zeros(spec.partitions, dtype=torch.int64)
        """Rows per part."""
        self.fill = torch.zeros(spec.partitions, dtype=torch.int64)
        """Per part: 1 + the highest place ever used (the places from there on were never used)."""
        if base >= 2**30:
            raise InputError(f"{where}: dynamic table {table!r} would hold {base} rows on one server; at most "
                             f"2**30 - 1 fit: lower its capacity or spread its parts over more servers")
        self.lru_pos = torch.full((base,), -1, dtype=torch.int32)
        self.lru_queue = torch.empty(2 * base, dtype=torch.int32)  # entries written before they are read
        self.lru_head = torch.full((spec.partitions,), -1, dtype=torch.int64)
        self.lru_tail = torch.full((spec.partitions,), -1, dtype=torch.int64)
        """Each part's rows in eviction order, (last step, id) ascending, as a queue in its region of
        ``lru_queue`` (``lru_pos``: each slot's entry; an entry its slot no longer points at is
        stale; ``lru_head[p] = -1``: none yet): the native operators' index for choosing rows to
        evict or expire without sorting a part, made the first time a part needs it and kept by
        ``dynamic_commit_``. Derived from the rows: a restore drops it (:meth:`drop_queues`)."""
        self.map = IdMap(base, empty=lambda n, dtype: table_tensor(n, dtype=dtype, huge_pages=huge_pages))
        self.seen = IdMap(16)  # id -> sightings, admit_after > 1
        self.counters = DynamicCounters()

    @property
    def rows(self) -> int:
        return len(self.map)

    @property
    def version(self) -> int:
        """Grows with every call that may change the id maps (the sum of two counters that never
        decrease): while it stays, the slots and sightings found for an id are still its own."""
        return self.map.version + self.seen.version

    # -- lookups --------------------------------------------------------------------------------
    def find(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(slot of each id or -1, whether an absent id reads its initial value (it is admitted
        by this step's update) rather than zeros). Changes only the hit counters."""
        slots = self.map.find(ids)
        absent = slots < 0
        self.counters.looked_up += ids.numel()
        self.counters.hits += ids.numel() - int(absent.sum())
        if self.spec.admit_after <= 1:
            return slots, absent
        seen = self.seen.find(ids).clamp(min=0)
        return slots, absent & (seen + 1 >= self.spec.admit_after)

    # -- updates --------------------------------------------------------------------------------
    def plan(self, ids: torch.Tensor, step: int) -> Admission:
        """Decide the update of ``step`` for its distinct ascending ``ids``; changes nothing.
        Raises :class:`CapacityError`."""
        return plan_updates([self], [ids], step)[0]

    def commit(self, a: Admission) -> None:
        """Carry out ``a`` (the caller then writes the new rows' initial values and state)."""
        commit_updates([self], [a])

    def _full(self, p: int, need: int, step: int) -> CapacityError:
        cap = int(self.part_cap[p])
        how = {"none": "evict: none keeps every row", "lru": "every row of it was touched in this step"
               }.get(self.spec.evict, f"no row of it is older than {self.spec.ttl} steps ({self.spec.evict})")
        return CapacityError(
            f"{self.where}: dynamic table {self.table!r} is full: part {p} of {self.spec.partitions} holds "
            f"{cap} of the table's capacity {self.spec.capacity} rows, step {step} needs {need} new row(s) "
            f"there and {how}; nothing was changed. Raise the plan's capacity" +
            ("" if self.spec.evict == "lru" else " or set evict: lru"))

    # -- state (checkpoints, exports, tests) ----------------------------------------------------
    def empty(self) -> None:
        """Forget every row and sighting (before a checkpoint's rows are put back: a table that
        has trained keeps none of its own). The counters are the caller's."""
        if len(self.map):
            self.map.clear()
        if len(self.seen):
            self.seen.clear()
        self.slot_id.zero_()
        self.occupied.zero_()
        self.last.fill_(-1)
        self.count.zero_()
        self.fill.zero_()
        self.lru_pos.fill_(-1)
        self.drop_queues()

    def restore(self, ids: torch.Tensor, slots: torch.Tensor, last: torch.Tensor) -> None:
        """Put saved rows' ids back at their slots (loading a checkpoint)."""
        self.map.insert(ids, slots)
        self.slot_id[slots], self.occupied[slots], self.last[slots] = ids, True, last
        parts = self.slot_part[slots]
        self.count += torch.bincount(parts, minlength=self.spec.partitions)
        self.fill.scatter_reduce_(0, parts, self.slot_index[slots] + 1, reduce="amax")
        self.drop_queues()

    def drop_queues(self) -> None:
        """Forget the eviction queues (after the rows changed without the native
        ``dynamic_commit_`` keeping them): a part's queue is sorted again when next needed."""
        self.lru_head.fill_(-1)
        self.lru_tail.fill_(-1)

    def state(self) -> dict[str, torch.Tensor]:
        """The map as tensors: per occupied slot its id, part, place in the part and last step,
        ascending by id; the sightings; the counters."""
        ids, slots = self.map.items()
        seen_ids, seen_counts = self.seen.items()
        c = self.counters
        return {"ids": ids, "slots": slots, "part": self.slot_part[slots], "index": self.slot_index[slots],
                "last": self.last[slots], "seen_ids": seen_ids, "seen_counts": seen_counts,
                "counters": torch.tensor([c.admitted, c.evicted, c.hits, c.looked_up], dtype=torch.int64)}


def _found(tables: list[DynamicSlots], ids: torch.Tensor, counts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The slots of ``ids`` (table ``k``'s the ``counts[k]``-long run after the earlier ones') in
    their tables' maps and, with ``admit_after > 1``, their sightings; one native call each."""
    found = find_many([t.map for t in tables], ids, counts)
    seen = torch.empty(0, dtype=torch.int64)
    if tables and tables[0].spec.admit_after > 1:
        seen = find_many([t.seen for t in tables], ids, counts)
    return found, seen


def plan_updates(tables: list[DynamicSlots], ids: list[torch.Tensor], step: int,
                 found: tuple[torch.Tensor, torch.Tensor] | None = None) -> list[Admission]:
    """Decide the update of ``step`` of every table (``ids[k]``: table ``k``'s distinct ascending
    ids; the tables of one collection, one spec); changes nothing. ``found``: the ids' slots and
    sightings (:func:`_found`, all tables' flat) where the caller knows them at the maps'
    current version; else the maps are probed. Raises :class:`CapacityError` for the first
    table that cannot admit its ids."""
    spec = tables[0].spec
    counts = [i.numel() for i in ids]
    flat = ids[0] if len(ids) == 1 else torch.cat(ids)
    found, seen = _found(tables, flat, counts) if found is None else found
    try:
        plan = ops.dynamic_plan(tables, flat, found, seen, counts, step=step, partitions=spec.partitions,
                                admit_after=spec.admit_after, evict=spec.evict.split(":")[0],
                                ttl=spec.ttl if spec.ttl is not None else -1)
    except ops.PartFull as e:
        raise tables[e.table]._full(e.part, e.need, step) from None
    except ops.ForeignPart as e:
        t = tables[e.table]
        raise RuntimeError(f"{t.where}: id {int(flat[e.position])} of table {t.table!r} belongs to a part this "
                           f"server does not hold (routing disagrees)") from None
    sizes = plan.sizes.tolist()
    cols = list(zip(*sizes)) if sizes else [(), (), (), ()]
    new_ids, new_slots = plan.new_ids.split(cols[0]), plan.new_slots.split(cols[0])
    evicted = plan.evicted.split(cols[1])
    seen_ids, seen_counts = plan.seen_ids.split(cols[2]), plan.seen_counts.split(cols[2])
    admitted_seen = plan.admitted_seen.split(cols[3])
    slots = plan.slots.split(counts)
    return [Admission(plan=plan, step=step, ids=i, slots=slots[k], new_ids=new_ids[k], new_slots=new_slots[k],
                      evicted=evicted[k], seen_ids=seen_ids[k], seen_counts=seen_counts[k],
                      admitted_seen=admitted_seen[k]) for k, i in enumerate(ids)]


def commit_updates(tables: list[DynamicSlots], admissions: list[Admission], *, weights=(), keys=(), bounds=()
                   ) -> None:
    """Carry out what one :func:`plan_updates` call decided for these tables; with ``weights``
    (each table's rows), write the new rows' initial values (``keys``, ``bounds``: each table's
    init key and bound). The caller then resets the new rows' optimizer state."""
    plan = admissions[0].plan
    assert all(a.plan is plan for a in admissions), "admissions of one plan_updates call"
    evicted_ids = ops.dynamic_commit_(tables, plan, [a.ids.numel() for a in admissions], step=admissions[0].step,
                                      weights=weights, keys=keys, bounds=bounds)
    gone = [a.evicted.numel() for a in admissions]
    update_many([t.map for t in tables], evicted_ids, gone, plan.new_ids, plan.new_slots,
                [a.new_ids.numel() for a in admissions])
    if tables[0].spec.admit_after > 1:
        update_many([t.seen for t in tables], plan.admitted_seen, [a.admitted_seen.numel() for a in admissions],
                    plan.seen_ids, plan.seen_counts, [a.seen_ids.numel() for a in admissions])
    for t, a, n in zip(tables, admissions, gone):
        t.counters.evicted += n
        t.counters.admitted += a.new_ids.numel()


NEVER = 1 << 62
"""An ``admit_after`` no sighting count reaches: a lookup that no update follows admits nothing."""


def read_rows(tables: list[DynamicSlots], weights: list[torch.Tensor], ids: torch.Tensor, counts: list[int], *,
              keys: list[int], bounds: list[float], out: torch.Tensor,
              update: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of raw ``ids`` (table ``k``'s the ``counts[k]``-long run after the earlier ones') into
    the flat float32 ``out``: the row where the id has one, its initial value (``keys[k]``,
    ``bounds[k]``) where this step's update admits it, zeros otherwise. Counts the hits.
    ``update`` false: a lookup outside training (evaluation, inference), which no update
    follows, so an id without a row reads zeros (an export has no row for it either) and the
    hit counters stay as they are. Returns the ids' slots and sightings (:func:`_found`; no
    sightings for ``update`` false), valid while the tables' ``version`` stays."""
    if not tables:
        return torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int64)
    if not update:  # the sightings do not matter: nothing is admitted
        found = find_many([t.map for t in tables], ids, counts)
        ops.dynamic_rows(weights, ids, found, torch.full_like(found, -1), counts, admit_after=NEVER, keys=keys,
                         bounds=bounds, out=out)
        return found, torch.empty(0, dtype=torch.int64)
    found, seen = _found(tables, ids, counts)
    hits = ops.dynamic_rows(weights, ids, found, seen, counts, admit_after=tables[0].spec.admit_after, keys=keys,
                            bounds=bounds, out=out).tolist()
    for t, n, h in zip(tables, counts, hits):
        t.counters.looked_up += n
        t.counters.hits += h
    return found, seen
