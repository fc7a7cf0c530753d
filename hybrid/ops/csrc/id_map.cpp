// The id -> row slot map of a dynamic table (hybrid/ps/server/dynamic.py), the hash that routes
// raw ids to servers, and the find of a trainer's hot-row cache over such a map. The map is two
// int64 tensors of one power-of-two size: keys (raw ids) and slots (-1: empty), open addressing
// with linear probing from fmix64(id); erasing shifts the following entries back (no
// tombstones), so a probe never runs past the first empty entry. The tensors belong to the
// caller, which grows them (and checkpoints them as tensors).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

#include "hash.h"

namespace {

using at::Tensor;

using hybrid::hash::fmix64;

void check_map(const Tensor& keys, const Tensor& slots) {
  TORCH_CHECK_TYPE(keys.scalar_type() == at::kLong && slots.scalar_type() == at::kLong,
                   "keys and slots must be int64");
  TORCH_CHECK_VALUE(keys.device().is_cpu() && slots.device().is_cpu() && keys.is_contiguous() &&
                        slots.is_contiguous() && keys.dim() == 1 && slots.dim() == 1,
                    "keys and slots must be contiguous 1-D CPU tensors");
  const int64_t n = keys.numel();
  TORCH_CHECK_VALUE(n == slots.numel() && n > 0 && (n & (n - 1)) == 0,
                    "keys and slots must have one power-of-two size, got ", n, " and ", slots.numel());
}

void check_ids(const Tensor& ids, const char* what) {
  TORCH_CHECK_TYPE(ids.scalar_type() == at::kLong, what, " must be int64, got ", ids.scalar_type());
  TORCH_CHECK_VALUE(ids.device().is_cpu() && ids.is_contiguous() && ids.dim() == 1, what,
                    " must be a contiguous 1-D CPU tensor");
}

// Position of id in the map, or of the empty entry where it would go.
inline int64_t probe(const int64_t* k, const int64_t* s, uint64_t mask, int64_t id) {
  uint64_t p = fmix64(static_cast<uint64_t>(id)) & mask;
  while (s[p] >= 0 && k[p] != id) p = (p + 1) & mask;
  return static_cast<int64_t>(p);
}

// o[i] = the slot of q[i] in the map (k, s, mask), -1 where absent, for i in [0, n).
void find_into(const int64_t* k, const int64_t* s, uint64_t mask, const int64_t* q, int64_t n, int64_t* o) {
  // The map is much larger than the caches: the entries kPrefetch ids ahead are requested
  // early, so several misses overlap instead of one probe waiting for memory at a time.
  constexpr int64_t kPrefetch = 16;
  for (int64_t i = 0; i < n; i++) {
    if (i + kPrefetch < n) {
      const uint64_t h = fmix64(static_cast<uint64_t>(q[i + kPrefetch])) & mask;
      __builtin_prefetch(s + h);
      __builtin_prefetch(k + h);
    }
    o[i] = s[probe(k, s, mask, q[i])];  // -1 where absent
  }
}

Tensor id_map_find(const Tensor& keys, const Tensor& slots, const Tensor& ids) {
  check_map(keys, slots);
  check_ids(ids, "ids");
  Tensor out = at::empty({ids.numel()}, ids.options());
  find_into(keys.data_ptr<int64_t>(), slots.data_ptr<int64_t>(), static_cast<uint64_t>(keys.numel() - 1),
            ids.data_ptr<int64_t>(), ids.numel(), out.data_ptr<int64_t>());
  return out;
}

// id_map_find over several maps in one call: ids holds, map after map, counts[t] ids to find
// in map t (keys[t], slots[t]); the slots come back in the same order.
Tensor id_maps_find(at::TensorList keys, at::TensorList slots, const Tensor& ids, at::IntArrayRef counts) {
  TORCH_CHECK_VALUE(keys.size() == counts.size() && slots.size() == counts.size(),
                    "keys, slots and counts must have one entry per map, got ", keys.size(), ", ", slots.size(),
                    " and ", counts.size());
  check_ids(ids, "ids");
  int64_t total = 0;
  for (size_t t = 0; t < counts.size(); t++) {
    check_map(keys[t], slots[t]);
    TORCH_CHECK_VALUE(counts[t] >= 0, "counts[", t, "] is negative: ", counts[t]);
    total += counts[t];
  }
  TORCH_CHECK_VALUE(total == ids.numel(), "counts sum to ", total, " but ids holds ", ids.numel());
  Tensor out = at::empty({ids.numel()}, ids.options());
  const int64_t* q = ids.data_ptr<int64_t>();
  int64_t* o = out.data_ptr<int64_t>();
  for (size_t t = 0; t < counts.size(); t++) {
    find_into(keys[t].data_ptr<int64_t>(), slots[t].data_ptr<int64_t>(),
              static_cast<uint64_t>(keys[t].numel() - 1), q, counts[t], o);
    q += counts[t];
    o += counts[t];
  }
  return out;
}

// Inserts (or overwrites) q[i] -> v[i] for i in [0, n) into the map (k, s, mask); returns the
// entries in use afterwards. The caller keeps the load at most one half.
int64_t insert_into(int64_t* k, int64_t* s, uint64_t mask, const int64_t* q, const int64_t* v, int64_t n,
                    int64_t used) {
  constexpr int64_t kPrefetch = 16;  // as in find_into: overlap the misses of the probes ahead
  for (int64_t i = 0; i < n; i++) {
    if (i + kPrefetch < n) {
      const uint64_t h = fmix64(static_cast<uint64_t>(q[i + kPrefetch])) & mask;
      __builtin_prefetch(s + h, 1);
      __builtin_prefetch(k + h, 1);
    }
    const int64_t p = probe(k, s, mask, q[i]);
    if (s[p] < 0) used++;
    k[p] = q[i];
    s[p] = v[i];
  }
  return used;
}

// Removes q[i], i in [0, n), from the map (absent ones are skipped); returns the entries in use
// afterwards.
int64_t erase_from(int64_t* k, int64_t* s, uint64_t mask, const int64_t* q, int64_t n, int64_t used) {
  for (int64_t i = 0; i < n; i++) {
    uint64_t p = static_cast<uint64_t>(probe(k, s, mask, q[i]));
    if (s[p] < 0) continue;
    used--;
    // Backward shift: move each later entry of the run into the hole when its home position
    // does not lie cyclically in (hole, entry].
    uint64_t hole = p, j = p;
    while (true) {
      j = (j + 1) & mask;
      if (s[j] < 0) break;
      const uint64_t home = fmix64(static_cast<uint64_t>(k[j])) & mask;
      const bool stays = hole <= j ? (hole < home && home <= j) : (hole < home || home <= j);
      if (stays) continue;
      k[hole] = k[j];
      s[hole] = s[j];
      hole = j;
    }
    s[hole] = -1;
  }
  return used;
}

// A map of cap entries, used of them in use, takes n more (the caller grows it first).
void check_room(int64_t cap, int64_t used, int64_t n, const std::string& what) {
  TORCH_CHECK_VALUE(used + n < cap, what, " of ", cap, " entries cannot take ", n, " more after ", used,
                    " (the caller grows it first)");
}

void check_values(const int64_t* v, int64_t n) {
  for (int64_t i = 0; i < n; i++) TORCH_CHECK_VALUE(v[i] >= 0, "slot values must be >= 0, got ", v[i]);
}

// Inserts (or overwrites) ids[i] -> values[i]; returns the entries in use afterwards. The caller
// keeps the load at most one half, so there is always an empty entry.
int64_t id_map_insert_(const Tensor& keys, const Tensor& slots, const Tensor& ids, const Tensor& values,
                       int64_t used) {
  check_map(keys, slots);
  check_ids(ids, "ids");
  check_ids(values, "values");
  TORCH_CHECK_VALUE(ids.numel() == values.numel(), "ids and values must have one size");
  const int64_t n = ids.numel(), cap = keys.numel();
  check_room(cap, used, n, "id map");
  check_values(values.data_ptr<int64_t>(), n);
  return insert_into(keys.data_ptr<int64_t>(), slots.data_ptr<int64_t>(), static_cast<uint64_t>(cap - 1),
                     ids.data_ptr<int64_t>(), values.data_ptr<int64_t>(), n, used);
}

// Removes ids (absent ones are skipped); returns the entries in use afterwards.
int64_t id_map_erase_(const Tensor& keys, const Tensor& slots, const Tensor& ids, int64_t used) {
  check_map(keys, slots);
  check_ids(ids, "ids");
  return erase_from(keys.data_ptr<int64_t>(), slots.data_ptr<int64_t>(), static_cast<uint64_t>(keys.numel() - 1),
                    ids.data_ptr<int64_t>(), ids.numel(), used);
}

// Several maps' erases, then inserts, in one call (the per-step update of a collection's
// tables): map t loses its erase_counts[t] ids of `erase` (map after map) and takes its
// insert_counts[t] pairs of `insert` / `values`; used[t] is its entries in use before. Every
// argument is checked before any map changes. Returns each map's entries in use afterwards.
std::vector<int64_t> id_maps_update_(at::TensorList keys, at::TensorList slots, const Tensor& erase,
                                     at::IntArrayRef erase_counts, const Tensor& insert, const Tensor& values,
                                     at::IntArrayRef insert_counts, at::IntArrayRef used) {
  const size_t nmap = keys.size();
  TORCH_CHECK_VALUE(slots.size() == nmap && erase_counts.size() == nmap && insert_counts.size() == nmap &&
                        used.size() == nmap,
                    "keys, slots, erase_counts, insert_counts and used must have one entry per map");
  check_ids(erase, "erase");
  check_ids(insert, "insert");
  check_ids(values, "values");
  TORCH_CHECK_VALUE(insert.numel() == values.numel(), "insert and values must have one size");
  int64_t ne = 0, ni = 0;
  for (size_t t = 0; t < nmap; t++) {
    check_map(keys[t], slots[t]);
    TORCH_CHECK_VALUE(erase_counts[t] >= 0 && insert_counts[t] >= 0 && used[t] >= 0,
                      "counts and used must be >= 0 (map ", t, ")");
    check_room(keys[t].numel(), used[t], insert_counts[t], "id map " + std::to_string(t));
    ne += erase_counts[t];
    ni += insert_counts[t];
  }
  TORCH_CHECK_VALUE(ne == erase.numel(), "erase_counts sum to ", ne, " but erase holds ", erase.numel());
  TORCH_CHECK_VALUE(ni == insert.numel(), "insert_counts sum to ", ni, " but insert holds ", insert.numel());
  check_values(values.data_ptr<int64_t>(), ni);
  const int64_t *e = erase.data_ptr<int64_t>(), *q = insert.data_ptr<int64_t>(), *v = values.data_ptr<int64_t>();
  std::vector<int64_t> out(nmap);
  for (size_t t = 0; t < nmap; t++) {
    int64_t *k = keys[t].data_ptr<int64_t>(), *s = slots[t].data_ptr<int64_t>();
    const uint64_t mask = static_cast<uint64_t>(keys[t].numel() - 1);
    out[t] = erase_from(k, s, mask, e, erase_counts[t], used[t]);
    out[t] = insert_into(k, s, mask, q, v, insert_counts[t], out[t]);
    e += erase_counts[t];
    q += insert_counts[t];
    v += insert_counts[t];
  }
  return out;
}

// fmix64 of each id, as int64 (two's complement of the unsigned hash).
Tensor id_hash(const Tensor& ids) {
  check_ids(ids, "ids");
  Tensor out = at::empty_like(ids);
  const int64_t* q = ids.data_ptr<int64_t>();
  int64_t* o = out.data_ptr<int64_t>();
  for (int64_t i = 0; i < ids.numel(); i++) o[i] = static_cast<int64_t>(fmix64(static_cast<uint64_t>(q[i])));
  return out;
}

void check_same_size(const Tensor& t, int64_t n, const char* what, const char* like) {
  check_ids(t, what);
  TORCH_CHECK_VALUE(t.numel() == n, what, " must hold one entry per entry of ", like, " (", n, "), got ",
                    t.numel());
}

// A trainer's hot-row cache (hybrid/ps/client/cache.py), one pool: each requested (table, id) --
// keys[i] its hash, the key of the pool's map -- found in the pool: its slot where the map has the
// key and the slot holds that very table and id (a hash collision is a miss), else -1. A held row
// counts one more use and is a hit where its version is at least `need`. Every key also counts one
// more request in the two rows of the count-min sketch (each key's counter in each row: its low and
// its high 32 bits, masked), and is to be admitted where, after every key of the call is counted,
// the smaller of its two counters reaches `admit_after`. Returns (slots, hit, admit).
std::tuple<Tensor, Tensor, Tensor> hot_rows_find_(const Tensor& map_keys, const Tensor& map_slots,
                                                  const Tensor& keys, const Tensor& ids, const Tensor& tables,
                                                  const Tensor& pool_ids, const Tensor& pool_tables,
                                                  const Tensor& pool_version, const Tensor& pool_uses,
                                                  const Tensor& sketch, int64_t need, int64_t admit_after) {
  check_map(map_keys, map_slots);
  check_ids(keys, "keys");
  const int64_t n = keys.numel();
  check_same_size(ids, n, "ids", "keys");
  check_same_size(tables, n, "tables", "keys");
  check_ids(pool_ids, "pool_ids");
  const int64_t cap = pool_ids.numel();
  check_same_size(pool_tables, cap, "pool_tables", "pool_ids");
  check_same_size(pool_version, cap, "pool_version", "pool_ids");
  check_same_size(pool_uses, cap, "pool_uses", "pool_ids");
  TORCH_CHECK_TYPE(sketch.scalar_type() == at::kInt, "sketch must be int32, got ", sketch.scalar_type());
  TORCH_CHECK_VALUE(sketch.device().is_cpu() && sketch.is_contiguous() && sketch.dim() == 2 && sketch.size(0) == 2,
                    "sketch must be a contiguous [2, width] CPU tensor, got shape ", sketch.sizes());
  const int64_t width = sketch.size(1);
  TORCH_CHECK_VALUE(width > 0 && (width & (width - 1)) == 0 && width <= (int64_t{1} << 31),
                    "sketch width must be a power of two up to 2^31, got ", width);

  Tensor slots = at::empty({n}, keys.options());
  Tensor hit = at::empty({n}, keys.options().dtype(at::kBool));
  Tensor admit = at::empty({n}, keys.options().dtype(at::kBool));
  const int64_t *k = keys.data_ptr<int64_t>(), *q = ids.data_ptr<int64_t>(), *tb = tables.data_ptr<int64_t>();
  const int64_t *pid = pool_ids.data_ptr<int64_t>(), *ptab = pool_tables.data_ptr<int64_t>();
  const int64_t* pver = pool_version.data_ptr<int64_t>();
  int64_t* uses = pool_uses.data_ptr<int64_t>();
  int64_t* o = slots.data_ptr<int64_t>();
  bool* h = hit.data_ptr<bool>();
  bool* a = admit.data_ptr<bool>();
  find_into(map_keys.data_ptr<int64_t>(), map_slots.data_ptr<int64_t>(),
            static_cast<uint64_t>(map_keys.numel() - 1), k, n, o);
  for (int64_t i = 0; i < n; i++)  // before anything is counted: an error changes nothing
    TORCH_CHECK_VALUE(o[i] < cap, "the map holds slot ", o[i], " of a pool of ", cap);
  for (int64_t i = 0; i < n; i++) {
    const int64_t s = o[i];
    if (s >= 0 && pid[s] == q[i] && ptab[s] == tb[i]) {
      uses[s]++;
      h[i] = pver[s] >= need;
    } else {
      o[i] = -1;
      h[i] = false;
    }
  }
  // Counted in two passes (all increments, then the reads), as index_add_ then index_select do:
  // two keys that share a counter both see both requests.
  int32_t* row0 = sketch.data_ptr<int32_t>();
  int32_t* row1 = row0 + width;
  const uint64_t mask = static_cast<uint64_t>(width - 1);
  auto at0 = [&](int64_t key) { return static_cast<uint64_t>(key) & mask; };
  auto at1 = [&](int64_t key) { return (static_cast<uint64_t>(key) >> 32) & mask; };
  auto bump = [](int32_t& c) { c = static_cast<int32_t>(static_cast<uint32_t>(c) + 1u); };
  for (int64_t i = 0; i < n; i++) {
    bump(row0[at0(k[i])]);
    bump(row1[at1(k[i])]);
  }
  for (int64_t i = 0; i < n; i++) a[i] = std::min(row0[at0(k[i])], row1[at1(k[i])]) >= admit_after;
  return {slots, hit, admit};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(hybrid, m) {
  m.def(
      "hot_rows_find_(Tensor map_keys, Tensor map_slots, Tensor keys, Tensor ids, Tensor tables, Tensor pool_ids, "
      "Tensor pool_tables, Tensor pool_version, Tensor(a!) pool_uses, Tensor(b!) sketch, int need, "
      "int admit_after) -> (Tensor, Tensor, Tensor)");
  m.def("id_map_find(Tensor keys, Tensor slots, Tensor ids) -> Tensor");
  m.def("id_maps_find(Tensor[] keys, Tensor[] slots, Tensor ids, int[] counts) -> Tensor");
  m.def("id_map_insert_(Tensor(a!) keys, Tensor(b!) slots, Tensor ids, Tensor values, int used) -> int");
  m.def("id_map_erase_(Tensor(a!) keys, Tensor(b!) slots, Tensor ids, int used) -> int");
  m.def(
      "id_maps_update_(Tensor(a!)[] keys, Tensor(b!)[] slots, Tensor erase, int[] erase_counts, Tensor insert, "
      "Tensor values, int[] insert_counts, int[] used) -> int[]");
  m.def("id_hash(Tensor ids) -> Tensor");
}

TORCH_LIBRARY_IMPL(hybrid, CompositeExplicitAutograd, m) {
  m.impl("id_map_find", id_map_find);
  m.impl("id_maps_find", id_maps_find);
  m.impl("id_map_insert_", id_map_insert_);
  m.impl("id_map_erase_", id_map_erase_);
  m.impl("id_maps_update_", id_maps_update_);
  m.impl("id_hash", id_hash);
  m.impl("hot_rows_find_", hot_rows_find_);
}
