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

Lookups (:meth:`DynamicSlots.find`) change nothing but the hit counters. Everything is tensor
operations over the step's ids (the map probes in C++, :mod:`hybrid.ops.id_map`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybrid.errors import InputError
from hybrid.ops.id_map import IdMap, id_hash
from hybrid.ps.config import DynamicIds


class CapacityError(InputError):
    """A dynamic table's part is full and its ``evict`` policy frees no row; nothing changed."""


def part_of(ids: torch.Tensor, partitions: int) -> torch.Tensor:
    """The part of each raw id: fmix64(id) mod ``partitions`` (also the trainers' routing)."""
    return torch.remainder(id_hash(ids), partitions)


@dataclass
class Admission:
    """What :meth:`DynamicSlots.plan` decided for one update; :meth:`DynamicSlots.commit` does it."""

    step: int
    ids: torch.Tensor
    """The update's distinct ids, ascending."""
    slots: torch.Tensor
    """Each id's slot after the update; -1: not admitted (its gradient is dropped)."""
    new_ids: torch.Tensor
    new_slots: torch.Tensor
    """Rows to create (initial value, fresh optimizer state)."""
    evicted: torch.Tensor
    """Slots whose row goes (the expired under ttl, and those taken for new ids)."""
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

    def as_dict(self, rows: int) -> dict:
        return {"rows": rows, "admitted": self.admitted, "evicted": self.evicted, "hits": self.hits,
                "looked_up": self.looked_up, "hit_ratio": self.hits / self.looked_up if self.looked_up else 1.0}


class DynamicSlots:
    """Slots of the parts ``parts`` of one dynamic table (``spec``)."""

    def __init__(self, spec: DynamicIds, parts: list[int], *, table: str, where: str) -> None:
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
        self.map = IdMap(base)
        self.seen = IdMap(16)  # id -> sightings, admit_after > 1
        self.counters = DynamicCounters()

    @property
    def rows(self) -> int:
        return len(self.map)

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
        spec = self.spec
        slots = self.map.find(ids)
        present = slots >= 0
        last = self.last.clone()
        last[slots[present]] = step
        ttl = spec.ttl
        expired = torch.empty(0, dtype=torch.int64)
        if ttl is not None:
            expired = (self.occupied & (last < step - ttl)).nonzero().squeeze(1)
        new = ids[~present]
        seen_ids = seen_counts = admitted_seen = torch.empty(0, dtype=torch.int64)
        if spec.admit_after > 1 and new.numel():
            counts = self.seen.find(new).clamp(min=0) + 1
            ok = counts >= spec.admit_after
            seen_ids, seen_counts = new[~ok], counts[~ok]
            admitted_seen = new[ok]
            new = new[ok]
        new_slots = torch.empty(0, dtype=torch.int64)
        taken = torch.empty(0, dtype=torch.int64)
        if new.numel():
            part = part_of(new, spec.partitions)
            if bool((self.part_base[part] < 0).any()):
                raise RuntimeError(f"{self.where}: id {int(new[self.part_base[part] < 0][0])} of table {self.table!r} "
                                   f"belongs to a part this server does not hold (routing disagrees)")
            order = torch.argsort(part, stable=True)  # ids ascending within each part
            new, part = new[order], part[order]
            need = torch.bincount(part, minlength=spec.partitions)
            cand = (need[self.slot_part] > 0).nonzero().squeeze(1)
            occ = self.occupied[cand].clone()
            if expired.numel():
                occ &= ~torch.isin(cand, expired)  # expired rows count as free
            c_last = torch.where(occ, last[cand], -1)
            tie = torch.where(occ, self.slot_id[cand], self.slot_index[cand])
            o = torch.argsort(tie, stable=True)
            o = o[torch.argsort(c_last[o], stable=True)]
            o = o[torch.argsort(self.slot_part[cand[o]], stable=True)]
            cand, occ, c_last = cand[o], occ[o], c_last[o]
            c_part = self.slot_part[cand]
            # Candidates come part by part, each part's slots all there: rank inside the part.
            rank = torch.arange(cand.numel()) - (torch.cumsum(self.part_cap * (need > 0), 0)
                                                 - self.part_cap * (need > 0))[c_part]
            pick = rank < need[c_part]
            got = torch.bincount(c_part[pick], minlength=spec.partitions)
            usable = ~occ[pick] | ((c_last[pick] < step) if spec.evict == "lru" else torch.zeros_like(occ[pick]))
            if bool((got < need).any()) or not bool(usable.all()):
                self._full(need, got, cand[pick][~usable] if not bool(usable.all()) else None, step, new.numel())
            new_slots = cand[pick]
            taken = new_slots[self.occupied[new_slots]]
        evicted = torch.unique(torch.cat([expired, taken]))
        slots = slots.clone()
        if new.numel():
            pos = torch.searchsorted(ids, new)
            slots[pos] = new_slots
        return Admission(step=step, ids=ids, slots=slots, new_ids=new, new_slots=new_slots, evicted=evicted,
                         seen_ids=seen_ids, seen_counts=seen_counts, admitted_seen=admitted_seen)

    def _full(self, need, got, blocked, step: int, n_new: int) -> None:
        short = (got < need).nonzero()
        p = int(short[0]) if short.numel() else int(self.slot_part[blocked[0]])
        cap = int(self.part_cap[p])
        how = {"none": "evict: none keeps every row", "lru": "every row of it was touched in this step"
               }.get(self.spec.evict, f"no row of it is older than {self.spec.ttl} steps ({self.spec.evict})")
        raise CapacityError(
            f"{self.where}: dynamic table {self.table!r} is full: part {p} of {self.spec.partitions} holds "
            f"{cap} of the table's capacity {self.spec.capacity} rows, step {step} needs {int(need[p])} new row(s) "
            f"there and {how}; nothing was changed. Raise the plan's capacity" +
            ("" if self.spec.evict == "lru" else " or set evict: lru"))

    def commit(self, a: Admission) -> None:
        """Carry out ``a`` (the caller then writes the new rows' initial values and state)."""
        if a.evicted.numel():
            self.map.erase(self.slot_id[a.evicted])
            self.occupied[a.evicted] = False
            self.last[a.evicted] = -1
            self.counters.evicted += a.evicted.numel()
        if a.new_ids.numel():
            self.map.insert(a.new_ids, a.new_slots)
            self.slot_id[a.new_slots] = a.new_ids
            self.occupied[a.new_slots] = True
            self.counters.admitted += a.new_ids.numel()
        if a.admitted_seen.numel():
            self.seen.erase(a.admitted_seen)
        if a.seen_ids.numel():
            self.seen.insert(a.seen_ids, a.seen_counts)
        touched = a.slots[a.slots >= 0]
        self.last[touched] = a.step

    # -- state (checkpoints, exports, tests) ----------------------------------------------------
    def state(self) -> dict[str, torch.Tensor]:
        """The map as tensors: per occupied slot its id, part, place in the part and last step,
        ascending by id; the sightings; the counters."""
        ids, slots = self.map.items()
        seen_ids, seen_counts = self.seen.items()
        c = self.counters
        return {"ids": ids, "slots": slots, "part": self.slot_part[slots], "index": self.slot_index[slots],
                "last": self.last[slots], "seen_ids": seen_ids, "seen_counts": seen_counts,
                "counters": torch.tensor([c.admitted, c.evicted, c.hits, c.looked_up], dtype=torch.int64)}
