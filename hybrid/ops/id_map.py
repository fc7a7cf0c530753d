"""The id -> row slot map of a dynamic table, and the hash that routes raw ids to servers.

:class:`IdMap` keeps an open-addressing hash table as two int64 tensors (``keys``, ``slots``;
``slots == -1`` marks an empty entry) probed by the native operators of ``csrc/id_map.cpp``
(``torch.ops.hybrid.id_map_find`` / ``id_map_insert_`` / ``id_map_erase_``): a million lookups
are one C++ loop. The table doubles when half full. Without the extension the sorted-array twin
:class:`hybrid.ops.reference.IdMap` runs instead (same methods, same results).
"""

from __future__ import annotations

import torch

from hybrid.ops import reference

_NATIVE_OPS = ("id_map_find", "id_maps_find", "id_map_insert_", "id_map_erase_", "id_maps_update_", "id_hash")
def _native() -> bool:
    try:
        import hybrid._C  # noqa: F401
    except ImportError:
        return False
    return all(hasattr(torch.ops.hybrid, n) for n in _NATIVE_OPS)


NATIVE: bool = _native()
"""Whether the native map operators run."""


def id_hash(ids: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's fmix64 of each int64 id, as int64 (the same on every machine and run)."""
    ids = ids.to(torch.int64).contiguous().reshape(-1)
    return torch.ops.hybrid.id_hash(ids) if NATIVE else reference.id_hash(ids)


class HashIdMap:
    """Raw int64 id -> row slot (an int64 >= 0), an open-addressing table probed in C++."""

    def __init__(self, capacity: int = 16, *, empty=None) -> None:
        """Room for ``capacity`` ids before it grows. ``empty(size, dtype)``: how the table's
        tensors are allocated (``torch.empty`` by default; a server passes one that backs them with
        huge pages, since every probe of a large map lands on a page of its own)."""
        size = 16
        while size < 2 * capacity:
            size *= 2
        self.empty = empty or (lambda n, dtype: torch.empty(n, dtype=dtype))
        self.keys = self.empty(size, torch.int64).zero_()
        self.slots = self.empty(size, torch.int64).fill_(-1)
        self.used = 0
        self.version = 0
        """Counts the calls that may have changed the map (inserts, erases): a slot found at one
        version is still the id's slot while the version stays."""

    def __len__(self) -> int:
        return self.used

    def find(self, ids: torch.Tensor) -> torch.Tensor:
        """Each id's slot, -1 where absent."""
        return torch.ops.hybrid.id_map_find(self.keys, self.slots, ids.to(torch.int64).contiguous().reshape(-1))

    def insert(self, ids: torch.Tensor, slots: torch.Tensor) -> None:
        """Map distinct ``ids`` to ``slots`` (an id already present is remapped)."""
        ids = ids.to(torch.int64).contiguous().reshape(-1)
        self.version += 1
        self._room_for(ids.numel())
        self.used = torch.ops.hybrid.id_map_insert_(self.keys, self.slots, ids,
                                                     slots.to(torch.int64).contiguous().reshape(-1), self.used)

    def erase(self, ids: torch.Tensor) -> None:
        """Remove ``ids`` (absent ones are skipped)."""
        self.version += 1
        self.used = torch.ops.hybrid.id_map_erase_(self.keys, self.slots, ids.to(torch.int64).contiguous().reshape(-1),
                                                    self.used)

    def clear(self) -> None:
        """Remove every id and give the table's memory back (a fresh minimal table)."""
        self.version += 1
        fresh = HashIdMap(0, empty=self.empty)
        self.keys, self.slots, self.used = fresh.keys, fresh.slots, 0

    def items(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids ascending, their slots)."""
        present = self.slots >= 0
        keys, slots = self.keys[present], self.slots[present]
        order = torch.argsort(keys)
        return keys[order], slots[order]

    def _room_for(self, n: int) -> None:
        """Grow so that ``n`` more ids keep the load at most one half."""
        if 2 * (self.used + n) > self.keys.numel():
            self._grow(self.used + n)

    def _grow(self, need: int) -> None:
        keys, slots = self.items()
        fresh = HashIdMap(need * 2, empty=self.empty)
        fresh.used = torch.ops.hybrid.id_map_insert_(fresh.keys, fresh.slots, keys, slots, 0)
        self.keys, self.slots, self.used = fresh.keys, fresh.slots, fresh.used


IdMap = HashIdMap if NATIVE else reference.IdMap
"""The map the servers use: native where the extension is built, else the reference."""


def find_many(maps: list, ids: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """The slot of each id in its map, -1 where absent: ``ids`` holds, map after map,
    ``counts[k]`` ids of ``maps[k]``. One native call probes every map
    (``torch.ops.hybrid.id_maps_find``)."""
    ids = ids.to(torch.int64).contiguous().reshape(-1)
    if NATIVE and all(isinstance(m, HashIdMap) for m in maps):
        return torch.ops.hybrid.id_maps_find([m.keys for m in maps], [m.slots for m in maps], ids, list(counts))
    found = [m.find(i) for m, i in zip(maps, ids.split(list(counts)))]
    return found[0] if len(found) == 1 else torch.cat(found) if found else torch.empty(0, dtype=torch.int64)


def update_many(maps: list, erase: torch.Tensor, erase_counts: list[int], insert: torch.Tensor,
                values: torch.Tensor, insert_counts: list[int]) -> None:
    """Map ``k`` loses its ``erase_counts[k]`` ids of ``erase`` (map after map; absent ones are
    skipped), then maps its ``insert_counts[k]`` distinct ids of ``insert`` to those of
    ``values``: every map in one native call (``torch.ops.hybrid.id_maps_update_``). A map that
    changes counts one more version."""
    erase = erase.to(torch.int64).contiguous().reshape(-1)
    insert = insert.to(torch.int64).contiguous().reshape(-1)
    values = values.to(torch.int64).contiguous().reshape(-1)
    if not (NATIVE and all(isinstance(m, HashIdMap) for m in maps)):
        for m, e, i, v in zip(maps, erase.split(list(erase_counts)), insert.split(list(insert_counts)),
                              values.split(list(insert_counts))):
            if e.numel():
                m.erase(e)
            if i.numel():
                m.insert(i, v)
        return
    for m, n in zip(maps, insert_counts):
        m._room_for(n)
    used = torch.ops.hybrid.id_maps_update_([m.keys for m in maps], [m.slots for m in maps], erase,
                                            list(erase_counts), insert, values, list(insert_counts),
                                            [m.used for m in maps])
    for m, u, ne, ni in zip(maps, used, erase_counts, insert_counts):
        m.used = u
        m.version += int(ne > 0) + int(ni > 0)
