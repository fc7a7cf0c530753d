// The server's operators for dynamic tables (ids: dynamic, docs/dynamic_ids.md), each over every
// table of a collection in one call, so that a step costs one call rather than dozens of small
// tensor operations per table:
//
// - dynamic_plan: the admission of one update's distinct ids (found in the id map by the caller):
//   which ids get a row and where, which rows go, the sightings to count; changes nothing but a
//   part's eviction queue, which it makes the first time the part needs one (derived state).
// - merge_ids: the distinct ids of an update from the trainers' ascending runs.
// - sum_runs: each distinct id's gradient rows summed, from the runs and merge_ids's inverse.
// - dynamic_commit_: what dynamic_plan decided, written into the slot state, new rows' initial
//   values into the tables.
// - dynamic_rows: the rows of looked-up ids (the row, the initial value of an id this step admits,
//   or zeros).
//
// The id maps stay with the caller (id_map.cpp's operators). hybrid/ops/reference.py computes the
// same results in plain torch; hybrid/ps/server/dynamic.py holds the state and the rules' prose.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "convert.h"
#include "dtype.h"
#include "hash.h"

namespace {

using at::IntArrayRef;
using at::Tensor;
using at::TensorList;
namespace k = hybrid::kernels;

constexpr int64_t kOk = 0, kFull = 1, kForeignPart = 2;

void check_1d(const Tensor& t, at::ScalarType dtype, const std::string& what, int64_t numel) {
  TORCH_CHECK_TYPE(t.scalar_type() == dtype, what, " must be ", dtype, ", got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.device().is_cpu() && t.is_contiguous() && t.dim() == 1, what,
                    " must be a contiguous 1-D CPU tensor, got shape ", t.sizes());
  TORCH_CHECK_VALUE(numel < 0 || t.numel() == numel, what, " must hold ", numel, " entries, got ", t.numel());
}

int64_t check_counts(IntArrayRef counts, int64_t n, const char* what) {
  int64_t total = 0;
  for (size_t t = 0; t < counts.size(); t++) {
    TORCH_CHECK_VALUE(counts[t] >= 0, "counts[", t, "] is negative: ", counts[t]);
    total += counts[t];
  }
  TORCH_CHECK_VALUE(total == n, "counts sum to ", total, " but ", what, " holds ", n);
  return total;
}

// One table's slot state (hybrid.ps.server.dynamic.DynamicSlots), checked. A part that has had to
// evict or expire rows also keeps them in eviction order -- by (last step, id), least recent
// first -- as a queue, so that choosing the rows to evict or expire walks from its head instead
// of sorting every slot of the part: a step costs the same at any capacity. The queue of part p
// lives in lru_queue[2 * part_base[p], 2 * (part_base[p] + part_cap[p])), its live window
// [lru_head[p], lru_tail[p]) (lru_head[p] = -1: no queue yet); lru_pos[j] is where slot j's
// entry is, and an entry k holding j with lru_pos[j] != k is stale (its row was touched again or
// left) and skipped. The plan sorts a part's rows into its queue the first time it needs them;
// from then on dynamic_commit_ appends every slot a step touches, in ascending id order (the
// order of a table's distinct ids), and compacts the queue in place when its region is full
// (after at least part_cap appends). A part that never fills costs nothing for it.
struct Slots {
  int64_t* slot_id;
  bool* occupied;
  int64_t* last;
  int64_t* count;
  int64_t* fill;
  const int64_t* part_base;
  const int64_t* part_cap;
  const int64_t* slot_part;
  const int64_t* slot_index;
  int32_t* pos;
  int32_t* queue;
  int64_t* head;
  int64_t* tail;
  int64_t capacity;

  // The row of queue entry k of a part, or -1 where the entry is stale.
  int64_t row_at(int64_t k) const {
    const int64_t j = queue[k];
    TORCH_CHECK_VALUE(j >= 0 && j < capacity, "lru_queue[", k, "] = ", j, " is not a slot");
    return pos[j] == k ? j : -1;
  }
  bool ordered(int64_t p) const { return head[p] >= 0; }
  // Part p's rows sorted into its queue, where it has none yet.
  void order(int64_t p) const {
    if (ordered(p)) return;
    std::vector<int64_t> rows;
    for (int64_t j = part_base[p]; j < part_base[p] + fill[p]; j++)
      if (occupied[j]) rows.push_back(j);
    std::sort(rows.begin(), rows.end(), [&](int64_t a, int64_t b) {
      return last[a] != last[b] ? last[a] < last[b] : slot_id[a] < slot_id[b];
    });
    int64_t k = 2 * part_base[p];
    head[p] = k;
    for (int64_t j : rows) {
      queue[k] = static_cast<int32_t>(j);
      pos[j] = static_cast<int32_t>(k++);
    }
    tail[p] = k;
  }
  void drop(int64_t j) const { pos[j] = -1; }
  // Slot j, touched now, to the end of its part's queue (where the part has one).
  void touch(int64_t j) const {
    const int64_t p = slot_part[j];
    if (!ordered(p)) return;
    if (tail[p] == 2 * (part_base[p] + part_cap[p])) {  // full: the live entries to the front
      int64_t w = 2 * part_base[p];
      for (int64_t k = head[p]; k < tail[p]; k++) {
        const int64_t r = row_at(k);
        if (r < 0) continue;
        queue[w] = static_cast<int32_t>(r);
        pos[r] = static_cast<int32_t>(w++);
      }
      head[p] = 2 * part_base[p];
      tail[p] = w;
    }
    queue[tail[p]] = static_cast<int32_t>(j);
    pos[j] = static_cast<int32_t>(tail[p]++);
  }
  // The head moved past stale entries.
  void trim(int64_t p) const {
    if (!ordered(p)) return;
    while (head[p] < tail[p] && row_at(head[p]) < 0) head[p]++;
  }
};

std::vector<Slots> slot_views(size_t ntab, int64_t partitions, TensorList slot_id, TensorList occupied,
                              TensorList last, TensorList count, TensorList fill, TensorList part_base,
                              TensorList part_cap, TensorList slot_part, TensorList slot_index, TensorList lru_pos,
                              TensorList lru_queue, TensorList lru_head, TensorList lru_tail) {
  for (TensorList l : {slot_id, occupied, last, count, fill, part_base, part_cap, slot_part, slot_index, lru_pos,
                       lru_queue, lru_head, lru_tail})
    TORCH_CHECK_VALUE(l.size() == ntab, "every slot state list must hold one tensor per table (", ntab,
                      "), got ", l.size());
  std::vector<Slots> out;
  for (size_t t = 0; t < ntab; t++) {
    const std::string at = "[" + std::to_string(t) + "]";
    const int64_t cap = slot_id[t].numel();
    TORCH_CHECK_VALUE(cap < (int64_t{1} << 30), "table ", t, " has ", cap, " slots; at most 2**30 - 1 fit");
    check_1d(slot_id[t], at::kLong, "slot_id" + at, cap);
    check_1d(occupied[t], at::kBool, "occupied" + at, cap);
    check_1d(last[t], at::kLong, "last" + at, cap);
    check_1d(slot_part[t], at::kLong, "slot_part" + at, cap);
    check_1d(slot_index[t], at::kLong, "slot_index" + at, cap);
    check_1d(lru_pos[t], at::kInt, "lru_pos" + at, cap);
    check_1d(lru_queue[t], at::kInt, "lru_queue" + at, 2 * cap);
    check_1d(count[t], at::kLong, "count" + at, partitions);
    check_1d(fill[t], at::kLong, "fill" + at, partitions);
    check_1d(part_base[t], at::kLong, "part_base" + at, partitions);
    check_1d(part_cap[t], at::kLong, "part_cap" + at, partitions);
    check_1d(lru_head[t], at::kLong, "lru_head" + at, partitions);
    check_1d(lru_tail[t], at::kLong, "lru_tail" + at, partitions);
    const int64_t *base = part_base[t].data_ptr<int64_t>(), *pc = part_cap[t].data_ptr<int64_t>();
    const int64_t *qh = lru_head[t].data_ptr<int64_t>(), *qt = lru_tail[t].data_ptr<int64_t>();
    for (int64_t p = 0; p < partitions; p++) {
      TORCH_CHECK_VALUE(base[p] < 0 || (pc[p] >= 0 && base[p] + pc[p] <= cap), "part ", p, " of table ", t,
                        " lies outside its ", cap, " slots");
      TORCH_CHECK_VALUE(base[p] < 0 || qh[p] == -1 ||
                            (2 * base[p] <= qh[p] && qh[p] <= qt[p] && qt[p] <= 2 * (base[p] + pc[p])),
                        "the eviction queue of part ", p, " of table ", t, " lies outside its region");
    }
    out.push_back({slot_id[t].data_ptr<int64_t>(), occupied[t].data_ptr<bool>(), last[t].data_ptr<int64_t>(),
                   count[t].data_ptr<int64_t>(), fill[t].data_ptr<int64_t>(), base, pc,
                   slot_part[t].data_ptr<int64_t>(), slot_index[t].data_ptr<int64_t>(),
                   lru_pos[t].data_ptr<int32_t>(), lru_queue[t].data_ptr<int32_t>(), lru_head[t].data_ptr<int64_t>(),
                   lru_tail[t].data_ptr<int64_t>(), cap});
  }
  return out;
}

// What one table's update does (one entry per id of the table, the rest lists).
struct Plan {
  std::vector<int64_t> new_ids, new_slots, evicted, seen_ids, seen_counts, admitted_seen;
};

// Marks on the slots a step touches (its found ids' slots), set and cleared by one plan_table
// call: a per-thread byte per slot that only grows, so a call costs its own ids, not the
// table's capacity.
class Touched {
 public:
  Touched(const int64_t* found, int64_t n, int64_t capacity) : found_(found), n_(n) {
    static thread_local std::vector<uint8_t> buf;
    if (buf.size() < static_cast<size_t>(capacity)) buf.resize(static_cast<size_t>(capacity), 0);
    mark_ = buf.data();
    for (int64_t i = 0; i < n_; i++)
      if (found_[i] >= 0) mark_[found_[i]] = 1;
  }
  ~Touched() {
    for (int64_t i = 0; i < n_; i++)
      if (found_[i] >= 0) mark_[found_[i]] = 0;
  }
  bool operator[](int64_t j) const { return mark_[j] != 0; }

 private:
  const int64_t* found_;
  int64_t n_;
  uint8_t* mark_;
};

// Plans table t's update of its distinct ascending ids (slots: their slots, updated in place
// for the admitted ones). Returns a status tuple's (code, part or position, need).
//
// A part that needs room takes its slots in this order (hybrid/ops/reference.py sorts every slot
// of the part by the same key): free slots and rows expired now, lowest place first; then (lru)
// rows not touched in this step, by (last step, id) -- its queue's order. A row touched in this
// step never goes; a part with too few slots for its new ids, or (lru) too few rows to give up,
// or (none, ttl) no free slot left, fails the step.
std::tuple<int64_t, int64_t, int64_t> plan_table(const Slots& s, const int64_t* ids, const int64_t* found,
                                                 const int64_t* seen, int64_t n, int64_t* slots, int64_t step,
                                                 int64_t partitions, int64_t admit_after, bool lru,
                                                 int64_t ttl, Plan& plan) {
  std::optional<Touched> marks;  // made where needed: expiry, or a part without room
  auto touched = [&](int64_t j) {
    if (!marks) marks.emplace(found, n, s.capacity);
    return (*marks)[j];
  };
  // Expired rows (ttl): per part, the untouched rows at the head of its list older than ttl.
  std::vector<std::vector<int64_t>> expired_in(ttl >= 0 ? static_cast<size_t>(partitions) : 0);
  std::vector<int64_t> expired;
  if (ttl >= 0) {
    for (int64_t p = 0; p < partitions; p++) {
      if (s.part_base[p] < 0) continue;
      s.order(p);
      for (int64_t k = s.head[p]; k < s.tail[p]; k++) {
        const int64_t j = s.row_at(k);
        if (j < 0 || touched(j)) continue;
        if (s.last[j] >= step - ttl) break;
        expired_in[static_cast<size_t>(p)].push_back(j);
        expired.push_back(j);
      }
    }
  }
  std::vector<int64_t> fresh;  // positions of the ids admitted now, ascending
  for (int64_t i = 0; i < n; i++) {
    slots[i] = found[i];
    if (found[i] >= 0) continue;
    if (admit_after > 1) {
      const int64_t c = std::max<int64_t>(seen[i], 0) + 1;
      if (c < admit_after) {
        plan.seen_ids.push_back(ids[i]);
        plan.seen_counts.push_back(c);
        continue;
      }
      plan.admitted_seen.push_back(ids[i]);
    }
    fresh.push_back(i);
  }
  std::vector<int64_t> taken;
  if (!fresh.empty()) {
    std::vector<int64_t> part(fresh.size()), need(static_cast<size_t>(partitions), 0);
    for (size_t k = 0; k < fresh.size(); k++) {
      part[k] = hybrid::hash::part_of(ids[fresh[k]], partitions);
      if (s.part_base[part[k]] < 0) return {kForeignPart, fresh[k], 0};
      need[static_cast<size_t>(part[k])]++;
    }
    bool direct = expired.empty();
    for (int64_t p = 0; p < partitions && direct; p++)
      if (need[p] > 0) direct = s.count[p] == s.fill[p] && need[p] <= s.part_cap[p] - s.fill[p];
    if (direct) {
      // No holes, room enough: the lowest free places are the next unused ones, taken by the
      // part's new ids in ascending order.
      std::vector<int64_t> next(s.fill, s.fill + partitions);
      for (size_t k = 0; k < fresh.size(); k++) {
        const int64_t p = part[k], slot = s.part_base[p] + next[p]++;
        plan.new_ids.push_back(ids[fresh[k]]);
        plan.new_slots.push_back(slot);
        slots[fresh[k]] = slot;
      }
    } else {
      std::vector<std::vector<int64_t>> by_part(static_cast<size_t>(partitions));
      for (size_t k = 0; k < fresh.size(); k++) by_part[static_cast<size_t>(part[k])].push_back(fresh[k]);
      int64_t short_part = -1, blocked_part = -1;
      std::vector<int64_t> chosen;
      for (int64_t p = 0; p < partitions; p++) {
        const int64_t want = need[p];
        if (want == 0) continue;
        if (want > s.part_cap[p]) {
          if (short_part < 0) short_part = p;
          continue;
        }
        chosen.clear();
        const int64_t base = s.part_base[p], fill = s.fill[p], cap = s.part_cap[p];
        // Free places and expired rows, lowest place first: three ascending runs merged -- the
        // holes below fill (only where rows left), the expired rows, the places from fill on.
        std::vector<int64_t> expired_p = ttl >= 0 ? expired_in[static_cast<size_t>(p)] : std::vector<int64_t>();
        std::sort(expired_p.begin(), expired_p.end());
        const bool holes = s.count[p] < fill;
        int64_t h = base, e = 0, u = base + fill;
        auto next_hole = [&](int64_t from) -> int64_t {
          if (!holes || from >= base + fill) return base + fill;
          const void* z = std::memchr(s.occupied + from, 0, static_cast<size_t>(base + fill - from));
          return z ? static_cast<const bool*>(z) - s.occupied : base + fill;
        };
        h = next_hole(h);
        while (static_cast<int64_t>(chosen.size()) < want) {
          const int64_t hv = h < base + fill ? h : INT64_MAX;
          const int64_t ev = e < static_cast<int64_t>(expired_p.size()) ? expired_p[e] : INT64_MAX;
          const int64_t uv = u < base + cap ? u : INT64_MAX;
          const int64_t m = std::min({hv, ev, uv});
          if (m == INT64_MAX) break;
          chosen.push_back(m);
          if (m == hv) h = next_hole(h + 1);
          else if (m == ev) e++;
          else u++;
        }
        // Then (lru) rows, least recent first (their queue), skipping those touched now.
        if (static_cast<int64_t>(chosen.size()) < want) {
          if (!lru) {
            if (blocked_part < 0) blocked_part = p;
            continue;
          }
          s.order(p);
          for (int64_t k = s.head[p]; k < s.tail[p] && static_cast<int64_t>(chosen.size()) < want; k++) {
            const int64_t j = s.row_at(k);
            if (j >= 0 && !touched(j)) chosen.push_back(j);
          }
          if (static_cast<int64_t>(chosen.size()) < want) {  // the rest would be rows touched now
            if (blocked_part < 0) blocked_part = p;
            continue;
          }
        }
        for (int64_t r = 0; r < want; r++) {
          const int64_t pos = by_part[p][static_cast<size_t>(r)], slot = chosen[static_cast<size_t>(r)];
          plan.new_ids.push_back(ids[pos]);
          plan.new_slots.push_back(slot);
          slots[pos] = slot;
          if (s.occupied[slot]) taken.push_back(slot);
        }
      }
      const int64_t p = short_part >= 0 ? short_part : blocked_part;
      if (p >= 0) return {kFull, p, need[p]};
    }
  }
  plan.evicted = expired;
  plan.evicted.insert(plan.evicted.end(), taken.begin(), taken.end());
  std::sort(plan.evicted.begin(), plan.evicted.end());
  plan.evicted.erase(std::unique(plan.evicted.begin(), plan.evicted.end()), plan.evicted.end());
  return {kOk, 0, 0};
}

Tensor flat(const std::vector<Plan>& plans, std::vector<int64_t> Plan::*field) {
  size_t n = 0;
  for (const Plan& p : plans) n += (p.*field).size();
  Tensor out = at::empty({static_cast<int64_t>(n)}, at::TensorOptions().dtype(at::kLong));
  int64_t* o = out.data_ptr<int64_t>();
  for (const Plan& p : plans) o = std::copy((p.*field).begin(), (p.*field).end(), o);
  return out;
}

std::tuple<int64_t, int64_t, int64_t, int64_t, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor>
dynamic_plan(const Tensor& ids, const Tensor& found, const Tensor& seen, IntArrayRef counts, TensorList slot_id,
             TensorList occupied, TensorList last, TensorList count, TensorList fill, TensorList part_base,
             TensorList part_cap, TensorList slot_part, TensorList slot_index, TensorList lru_pos,
             TensorList lru_queue, TensorList lru_head, TensorList lru_tail, int64_t step, int64_t partitions,
             int64_t admit_after, const std::string& evict, int64_t ttl) {
  TORCH_CHECK_VALUE(partitions >= 1, "partitions must be >= 1, got ", partitions);
  TORCH_CHECK_VALUE(evict == "none" || evict == "lru" || evict == "ttl", "evict must be none, lru or ttl, got ",
                    evict);
  TORCH_CHECK_VALUE(evict != "ttl" || ttl >= 0, "evict ttl needs ttl >= 0, got ", ttl);
  const int64_t n = ids.numel();
  check_1d(ids, at::kLong, "ids", -1);
  check_1d(found, at::kLong, "found", n);
  check_1d(seen, at::kLong, "seen", admit_after > 1 ? n : 0);
  check_counts(counts, n, "ids");
  const size_t ntab = counts.size();
  const auto views = slot_views(ntab, partitions, slot_id, occupied, last, count, fill, part_base, part_cap,
                                slot_part, slot_index, lru_pos, lru_queue, lru_head, lru_tail);
  const int64_t *ip = ids.data_ptr<int64_t>(), *fp = found.data_ptr<int64_t>();
  const int64_t* sp = admit_after > 1 ? seen.data_ptr<int64_t>() : nullptr;
  int64_t off = 0;
  for (size_t t = 0; t < ntab; t++) {
    for (int64_t i = off; i < off + counts[t]; i++) {
      TORCH_CHECK_VALUE(i == off || ip[i - 1] < ip[i], "the ids of table ", t, " must be distinct and ascending");
      TORCH_CHECK_VALUE(fp[i] < views[t].capacity, "found[", i, "] = ", fp[i], " is not a slot of table ", t);
    }
    off += counts[t];
  }
  Tensor slots = at::empty({n}, ids.options());
  int64_t* so = slots.data_ptr<int64_t>();
  std::vector<Plan> plans(ntab);
  auto i64 = at::TensorOptions().dtype(at::kLong);
  Tensor sizes = at::zeros({static_cast<int64_t>(ntab), 4}, i64);
  off = 0;
  for (size_t t = 0; t < ntab; t++) {
    const auto [code, where, need] =
        plan_table(views[t], ip + off, fp + off, sp ? sp + off : nullptr, counts[t], so + off, step, partitions,
                   admit_after, evict == "lru", evict == "ttl" ? ttl : -1, plans[t]);
    if (code != kOk) {
      Tensor none = at::empty({0}, i64);
      return {code, static_cast<int64_t>(t), code == kForeignPart ? off + where : where, need, none, none, none,
              none, none, none, none, none};
    }
    int64_t* z = sizes.data_ptr<int64_t>() + 4 * t;
    z[0] = static_cast<int64_t>(plans[t].new_ids.size());
    z[1] = static_cast<int64_t>(plans[t].evicted.size());
    z[2] = static_cast<int64_t>(plans[t].seen_ids.size());
    z[3] = static_cast<int64_t>(plans[t].admitted_seen.size());
    off += counts[t];
  }
  return {kOk,
          0,
          0,
          0,
          slots,
          sizes,
          flat(plans, &Plan::new_ids),
          flat(plans, &Plan::new_slots),
          flat(plans, &Plan::evicted),
          flat(plans, &Plan::seen_ids),
          flat(plans, &Plan::seen_counts),
          flat(plans, &Plan::admitted_seen)};
}

// Slots ahead of the one being written whose state dynamic_commit_ requests early: the slots
// are scattered over memory far larger than the caches, so overlapping the misses matters more
// than anything else in its loops (a lookup's rows: kernels::rows_ahead).
constexpr int64_t kAhead = 8;

k::DType row_dtype(const Tensor& w, const std::string& what) {
  TORCH_CHECK_VALUE(w.device().is_cpu() && w.is_contiguous() && w.dim() == 2, what,
                    " must be a contiguous 2-D CPU tensor, got shape ", w.sizes());
  return hybrid::float_dtype(w, what);
}

Tensor dynamic_commit_(const Tensor& slots, IntArrayRef counts, const Tensor& new_ids, const Tensor& new_slots,
                       IntArrayRef new_counts, const Tensor& evicted, IntArrayRef evicted_counts,
                       TensorList slot_id, TensorList occupied, TensorList last, TensorList count, TensorList fill,
                       TensorList part_base, TensorList part_cap, TensorList slot_part, TensorList slot_index,
                       TensorList lru_pos, TensorList lru_queue, TensorList lru_head, TensorList lru_tail,
                       int64_t step, TensorList weights, IntArrayRef keys, at::ArrayRef<double> bounds) {
  const size_t ntab = counts.size();
  TORCH_CHECK_VALUE(weights.empty() || (weights.size() == ntab && keys.size() == ntab && bounds.size() == ntab),
                    "weights, keys and bounds must be empty or have one entry per table");
  std::vector<k::DType> dtypes;
  for (size_t t = 0; t < weights.size(); t++) {
    dtypes.push_back(row_dtype(weights[t], "weights[" + std::to_string(t) + "]"));
    TORCH_CHECK_VALUE(weights[t].size(0) == slot_id[t].numel(), "weights[", t, "] must have one row per slot (",
                      slot_id[t].numel(), "), got shape ", weights[t].sizes());
    TORCH_CHECK_VALUE(0 <= keys[t] && keys[t] <= 0xFFFFFFFFll, "keys[", t, "] must be a 32-bit value");
  }
  TORCH_CHECK_VALUE(new_counts.size() == ntab && evicted_counts.size() == ntab,
                    "counts, new_counts and evicted_counts must have one entry per table");
  TORCH_CHECK_VALUE(count.size() == ntab, "count must hold one tensor per table");
  const int64_t partitions = ntab ? count[0].numel() : 0;
  const auto views = slot_views(ntab, partitions, slot_id, occupied, last, count, fill, part_base, part_cap,
                                slot_part, slot_index, lru_pos, lru_queue, lru_head, lru_tail);
  check_1d(slots, at::kLong, "slots", -1);
  check_1d(new_ids, at::kLong, "new_ids", -1);
  check_1d(new_slots, at::kLong, "new_slots", new_ids.numel());
  check_1d(evicted, at::kLong, "evicted", -1);
  check_counts(counts, slots.numel(), "slots");
  check_counts(new_counts, new_ids.numel(), "new_ids");
  check_counts(evicted_counts, evicted.numel(), "evicted");
  const int64_t *sp = slots.data_ptr<int64_t>(), *ni = new_ids.data_ptr<int64_t>();
  const int64_t *ns = new_slots.data_ptr<int64_t>(), *ev = evicted.data_ptr<int64_t>();
  // Each table's runs of slots, new ids and evictions start after the earlier tables'.
  std::vector<int64_t> first_slot(ntab), first_new(ntab), first_evicted(ntab);
  int64_t o1 = 0, o2 = 0, o3 = 0;
  for (size_t t = 0; t < ntab; t++) {  // every slot checked before anything is written
    first_slot[t] = o1;
    first_new[t] = o2;
    first_evicted[t] = o3;
    const int64_t cap = views[t].capacity;
    for (int64_t i = o1; i < o1 + counts[t]; i++)
      TORCH_CHECK_VALUE(sp[i] < cap, "slots[", i, "] = ", sp[i], " is not a slot of table ", t);
    for (int64_t i = o2; i < o2 + new_counts[t]; i++)
      TORCH_CHECK_VALUE(ns[i] >= 0 && ns[i] < cap, "new_slots[", i, "] = ", ns[i], " is not a slot of table ", t);
    for (int64_t i = o3; i < o3 + evicted_counts[t]; i++)
      TORCH_CHECK_VALUE(ev[i] >= 0 && ev[i] < cap, "evicted[", i, "] = ", ev[i], " is not a slot of table ", t);
    o1 += counts[t];
    o2 += new_counts[t];
    o3 += evicted_counts[t];
  }
  Tensor evicted_ids = at::empty({evicted.numel()}, evicted.options());
  int64_t* eo = evicted_ids.data_ptr<int64_t>();
  // The tables share nothing: each is committed on a thread of its own.
  at::parallel_for(0, static_cast<int64_t>(ntab), 1, [&](int64_t lo, int64_t hi) {
    for (size_t t = static_cast<size_t>(lo); t < static_cast<size_t>(hi); t++) {
      const Slots& s = views[t];
      const int64_t s1 = first_slot[t], s2 = first_new[t], s3 = first_evicted[t];
      for (int64_t i = s3; i < s3 + evicted_counts[t]; i++) {
        const int64_t j = ev[i];
        s.count[s.slot_part[j]]--;
        eo[i] = s.slot_id[j];
        s.occupied[j] = false;
        s.last[j] = -1;
        s.drop(j);
      }
      for (int64_t i = s2; i < s2 + new_counts[t]; i++) {
        if (i + kAhead < s2 + new_counts[t]) {  // the slot state of the new rows ahead
          const int64_t a = ns[i + kAhead];
          __builtin_prefetch(s.slot_part + a);
          __builtin_prefetch(s.slot_index + a);
          __builtin_prefetch(s.slot_id + a, 1);
          __builtin_prefetch(s.occupied + a, 1);
        }
        const int64_t j = ns[i], p = s.slot_part[j];
        s.slot_id[j] = ni[i];
        s.occupied[j] = true;
        s.count[p]++;
        s.fill[p] = std::max(s.fill[p], s.slot_index[j] + 1);
      }
      if (!weights.empty()) {
        const uint32_t key = static_cast<uint32_t>(keys[t]);
        const float bound = static_cast<float>(bounds[t]);  // as torch converts a Python float for float32 math
        k::dispatch().initial_rows(weights[t].data_ptr(), dtypes[t], weights[t].size(1), ni + s2, ns + s2,
                                   new_counts[t], key, bound);
      }
      // Every touched row stamped and appended to its part's queue (where it has one), ascending
      // ids (sp's order); a table none of whose parts has a queue only stamps.
      bool queues = false;
      for (int64_t p = 0; p < partitions && !queues; p++) queues = s.part_base[p] >= 0 && s.ordered(p);
      const int64_t end = s1 + counts[t];
      for (int64_t i = s1; i < end; i++) {
        if (i + 2 * kAhead < end && sp[i + 2 * kAhead] >= 0) {
          const int64_t a = sp[i + 2 * kAhead];
          __builtin_prefetch(s.last + a, 1);
          if (queues) {
            __builtin_prefetch(s.pos + a, 1);
            __builtin_prefetch(s.slot_part + a);
          }
        }
        const int64_t j = sp[i];
        if (j < 0) continue;
        s.last[j] = step;
        if (queues) s.touch(j);
      }
      if (queues)
        for (int64_t p = 0; p < partitions; p++)
          if (s.part_base[p] >= 0) s.trim(p);
    }
  });
  return evicted_ids;
}

// Rows [lo, hi) of a lookup of one table (its row, the initial value of an id admitted by this
// step's update, or zeros) into o, dim floats each; returns the ids that had a row.
template <typename S>
int64_t lookup_rows(const void* table, int64_t dim, const int64_t* ip, const int64_t* sp, const int64_t* seen_p,
                    int64_t admit_after, int64_t lo, int64_t hi, uint32_t key, float bound, float* o) {
  const auto* w = static_cast<const typename S::T*>(table);
  const int64_t bytes = dim * static_cast<int64_t>(sizeof(typename S::T));
  const int64_t ahead = k::rows_ahead(bytes);
  int64_t hits = 0;
  const auto init = k::dispatch().initial_rows;
  // A 16-bit table's new row holds its initial value rounded into the table's dtype
  // (dynamic_commit_), so the lookup that admits it reads that rounded value too.
  std::vector<typename S::T> rounded(std::is_same_v<S, k::F32> ? 0 : static_cast<size_t>(dim));
  for (int64_t i = lo; i < hi; i++, o += dim) {
    if (i + ahead < hi && sp[i + ahead] >= 0) k::prefetch_row(w + sp[i + ahead] * dim, bytes);
    if (sp[i] >= 0) {
      hits++;
      const auto* row = w + sp[i] * dim;
      if constexpr (std::is_same_v<S, k::F32>) {
        k::copy_row(o, row, bytes);
      } else {
        for (int64_t c = 0; c < dim; c++) o[c] = S::load(row[c]);
      }
    } else if (!seen_p || std::max<int64_t>(seen_p[i], 0) + 1 >= admit_after) {
      if constexpr (std::is_same_v<S, k::F32>) {
        init(o, k::DType::f32, dim, ip + i, nullptr, 1, key, bound);
      } else {
        init(rounded.data(), S::dtype, dim, ip + i, nullptr, 1, key, bound);
        for (int64_t c = 0; c < dim; c++) o[c] = S::load(rounded[c]);
      }
    } else {
      std::fill(o, o + dim, 0.0f);
    }
  }
  return hits;
}

Tensor dynamic_rows(TensorList weights, const Tensor& ids, const Tensor& slots, const Tensor& seen,
                    IntArrayRef counts, int64_t admit_after, IntArrayRef keys, at::ArrayRef<double> bounds,
                    const Tensor& out) {
  const size_t ntab = counts.size();
  TORCH_CHECK_VALUE(weights.size() == ntab && keys.size() == ntab && bounds.size() == ntab,
                    "weights, counts, keys and bounds must have one entry per table");
  const int64_t n = ids.numel();
  check_1d(ids, at::kLong, "ids", -1);
  check_1d(slots, at::kLong, "slots", n);
  check_1d(seen, at::kLong, "seen", admit_after > 1 ? n : 0);
  check_counts(counts, n, "ids");
  TORCH_CHECK_TYPE(out.scalar_type() == at::kFloat, "out must be float32, got ", out.scalar_type());
  TORCH_CHECK_VALUE(out.device().is_cpu() && out.is_contiguous(), "out must be a contiguous CPU tensor");
  std::vector<k::DType> dtypes;
  std::vector<int64_t> first_id(ntab), first_out(ntab);  // where each table's ids and rows start
  int64_t numel = 0;
  for (size_t t = 0, i = 0; t < ntab; i += counts[t], t++) {
    const Tensor& w = weights[t];
    dtypes.push_back(row_dtype(w, "weights[" + std::to_string(t) + "]"));
    TORCH_CHECK_VALUE(0 <= keys[t] && keys[t] <= 0xFFFFFFFFll, "keys[", t, "] must be a 32-bit value");
    first_id[t] = static_cast<int64_t>(i);
    first_out[t] = numel;
    numel += counts[t] * w.size(1);
  }
  TORCH_CHECK_VALUE(out.numel() >= numel, "out holds ", out.numel(), " elements; the rows need ", numel);
  const int64_t *ip = ids.data_ptr<int64_t>(), *sp = slots.data_ptr<int64_t>();
  const int64_t* seen_p = admit_after > 1 ? seen.data_ptr<int64_t>() : nullptr;
  for (size_t t = 0; t < ntab; t++)
    for (int64_t i = first_id[t]; i < first_id[t] + counts[t]; i++)
      TORCH_CHECK_VALUE(sp[i] < weights[t].size(0), "slots[", i, "] = ", sp[i], " is not a row of table ", t);
  Tensor hits = at::zeros({static_cast<int64_t>(ntab)}, ids.options());
  int64_t* hp = hits.data_ptr<int64_t>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, static_cast<int64_t>(ntab), 1, [&](int64_t lo, int64_t hi) {  // a thread per table
    for (size_t t = static_cast<size_t>(lo); t < static_cast<size_t>(hi); t++) {
      const int64_t dim = weights[t].size(1), first = first_id[t];
      const uint32_t key = static_cast<uint32_t>(keys[t]);
      const float bound = static_cast<float>(bounds[t]);  // as torch converts a Python float for float32 math
      hp[t] = k::with_dtype(dtypes[t], [&](auto s) {
        return lookup_rows<decltype(s)>(weights[t].data_ptr(), dim, ip, sp, seen_p, admit_after, first,
                                        first + counts[t], key, bound, o + first_out[t]);
      });
    }
  });
  return hits;
}

// Three or more runs of one table merged by a tournament (a loser tree): each id out costs
// log2(runs) comparisons, however many runs there are. A run's key is its head id, or past
// every id once the run is done (the high word; ids compare as signed). Equal ids of several
// runs come out one after the other: the first is the next distinct id, the others map to it.
// Writes the distinct ids from u[nu], each id's index into inv; returns the new nu.
int64_t merge_tournament(const int64_t* ip, int64_t* head, const int64_t* end, int64_t runs, int64_t* u,
                         int64_t* inv, int64_t nu) {
  using Key = unsigned __int128;
  int64_t width = 1;
  while (width < runs) width *= 2;
  std::vector<Key> key(static_cast<size_t>(width));
  const auto key_of = [&](int64_t r) -> Key {
    if (r >= runs || head[r] >= end[r]) return Key{1} << 64;
    return static_cast<Key>(static_cast<uint64_t>(ip[head[r]]) ^ (uint64_t{1} << 63));
  };
  for (int64_t r = 0; r < width; r++) key[r] = key_of(r);
  // loser[i] for the inner nodes 1..width-1; winners found bottom-up to build it.
  std::vector<int64_t> loser(static_cast<size_t>(width)), win(static_cast<size_t>(2 * width));
  for (int64_t r = 0; r < width; r++) win[width + r] = r;
  for (int64_t i = width - 1; i >= 1; i--) {
    const int64_t a = win[2 * i], b = win[2 * i + 1];
    const bool b_first = key[b] < key[a];
    win[i] = b_first ? b : a;
    loser[i] = b_first ? a : b;
  }
  const Key done = Key{1} << 64;
  const int64_t first = nu;
  int64_t w = win[1];
  while (key[w] < done) {
    const int64_t id = ip[head[w]];
    const bool fresh = nu == first || u[nu - 1] != id;  // without a branch: ids repeat at random
    u[nu] = id;
    nu += fresh;
    inv[head[w]++] = nu - 1;
    key[w] = key_of(w);
    for (int64_t node = (w + width) / 2; node >= 1; node /= 2) {  // the path to the root, replayed
      const int64_t other = loser[node];
      const bool swap = key[other] < key[w];
      loser[node] = swap ? w : other;
      w = swap ? other : w;
    }
  }
  return nu;
}

// The distinct ids of every table of an update whose ids come as ascending distinct runs (one
// per trainer): ids holds, table after table, that table's `runs` runs (counts[t * runs + r]
// long). Returns (the distinct ids, ascending within a table, table after table; how many each
// table has; each input id's index in the distinct ids).
std::tuple<Tensor, Tensor, Tensor> merge_ids(const Tensor& ids, IntArrayRef counts, int64_t runs) {
  TORCH_CHECK_VALUE(runs >= 1, "runs must be >= 1, got ", runs);
  TORCH_CHECK_VALUE(counts.size() % static_cast<size_t>(runs) == 0, "counts must hold tables x runs entries, got ",
                    counts.size(), " for ", runs, " runs");
  const int64_t n = ids.numel(), ntab = static_cast<int64_t>(counts.size()) / runs;
  check_1d(ids, at::kLong, "ids", -1);
  check_counts(counts, n, "ids");
  const int64_t* ip = ids.data_ptr<int64_t>();
  int64_t off = 0;
  for (size_t r = 0; r < counts.size(); r++) {
    for (int64_t i = off + 1; i < off + counts[r]; i++)
      TORCH_CHECK_VALUE(ip[i - 1] < ip[i], "run ", r, " of ids must be distinct and ascending");
    off += counts[r];
  }
  auto i64 = ids.options();
  Tensor uniq = at::empty({n}, i64), per = at::empty({ntab}, i64), inverse = at::empty({n}, i64);
  int64_t *u = uniq.data_ptr<int64_t>(), *pp = per.data_ptr<int64_t>(), *inv = inverse.data_ptr<int64_t>();
  std::vector<int64_t> head(static_cast<size_t>(runs)), end(static_cast<size_t>(runs));
  int64_t nu = 0;
  off = 0;
  for (int64_t t = 0; t < ntab; t++) {
    for (int64_t r = 0; r < runs; r++) {
      head[r] = off;
      end[r] = off += counts[t * runs + r];
    }
    const int64_t first = nu;
    if (runs == 2) {
      // Two trainers' runs (the common case), merged without branches on the ids: the smaller
      // head is the next distinct id and every run holding it moves on. inv[i] and inv[j] are
      // written every round; a run's entry keeps the value of the round it moved on in.
      int64_t i = head[0], j = head[1];
      const int64_t ei = end[0], ej = end[1];
      while (i < ei && j < ej) {
        const int64_t x = ip[i], y = ip[j], m = x < y ? x : y;
        u[nu] = m;
        inv[i] = nu;
        inv[j] = nu;
        i += x == m;
        j += y == m;
        nu++;
      }
      for (; i < ei; i++) {
        inv[i] = nu;
        u[nu++] = ip[i];
      }
      for (; j < ej; j++) {
        inv[j] = nu;
        u[nu++] = ip[j];
      }
      pp[t] = nu - first;
      continue;
    }
    nu = merge_tournament(ip, head.data(), end.data(), runs, u, inv, nu);
    pp[t] = nu - first;
  }
  return {uniq.narrow(0, 0, nu), per, inverse};
}

// The summed gradient rows of every table's distinct ids, flat, table after table ([per[t], dim]
// each): grads[j] is run j's rows ([n_j, dim], float32; runs table after table, runs[t] of them
// for table t), inverse[e] the index of the e-th id of all runs in merge_ids's distinct ids,
// per[t] how many distinct ids table t has. Each distinct id's rows are added into zeros in run
// order, then multiplied by scale: sum_rows's arithmetic, without sorting again what merge_ids
// has merged. One flat tensor, so an optimizer over every table takes it without a copy.
Tensor sum_runs(TensorList grads, const Tensor& inverse, IntArrayRef per, IntArrayRef runs, double scale) {
  TORCH_CHECK_VALUE(per.size() == runs.size(), "per and runs must hold one entry per table, got ", per.size(),
                    " and ", runs.size());
  int64_t nruns = 0, nids = 0;
  for (size_t t = 0; t < runs.size(); t++) {
    TORCH_CHECK_VALUE(runs[t] >= 0 && per[t] >= 0, "runs[", t, "] and per[", t, "] must be >= 0");
    nruns += runs[t];
  }
  TORCH_CHECK_VALUE(nruns == static_cast<int64_t>(grads.size()), "runs sum to ", nruns, " but grads holds ",
                    grads.size(), " tensors");
  for (size_t j = 0; j < grads.size(); j++) {
    const std::string what = "grads[" + std::to_string(j) + "]";
    TORCH_CHECK_TYPE(grads[j].scalar_type() == at::kFloat, what, " must be float32, got ", grads[j].scalar_type());
    TORCH_CHECK_VALUE(grads[j].device().is_cpu() && grads[j].is_contiguous() && grads[j].dim() == 2, what,
                      " must be a contiguous 2-D CPU tensor, got shape ", grads[j].sizes());
    nids += grads[j].size(0);
  }
  check_1d(inverse, at::kLong, "inverse", nids);
  const int64_t* inv = inverse.data_ptr<int64_t>();
  const float fscale = static_cast<float>(scale);
  // Where each table's ids, runs, distinct ids and output rows start (the columns checked).
  const int64_t ntab = static_cast<int64_t>(runs.size());
  std::vector<int64_t> first_e(ntab), first_j(ntab), first_u(ntab), first_out(ntab);
  int64_t total = 0, nu = 0;
  for (int64_t t = 0, e = 0, j = 0; t < ntab; t++) {
    first_e[t] = e, first_j[t] = j, first_u[t] = nu, first_out[t] = total;
    for (int64_t r = 0; r < runs[t]; r++) {
      TORCH_CHECK_VALUE(grads[j + r].size(1) == grads[j].size(1), "grads[", j + r, "] has ", grads[j + r].size(1),
                        " columns; table ", t, "'s first run has ", grads[j].size(1));
      e += grads[j + r].size(0);
    }
    total += runs[t] ? per[t] * grads[j].size(1) : 0;
    nu += per[t];
    j += runs[t];
  }
  // Each distinct id's row count, from the checked inverse: its first row is written (0 + g, as
  // added into zeros) and its last one also scales the sum, so the output is written in one pass
  // rather than zeroed and scaled in passes of their own.
  std::vector<int32_t> rows_of(static_cast<size_t>(nu), 0);
  for (int64_t t = 0; t < ntab; t++) {
    const int64_t base = first_u[t], end = t + 1 < ntab ? first_e[t + 1] : nids;
    for (int64_t e = first_e[t]; e < end; e++) {
      TORCH_CHECK_VALUE(inv[e] >= base && inv[e] < base + per[t], "inverse[", e, "] = ", inv[e],
                        " is not one of table ", t, "'s distinct ids [", base, ", ", base + per[t], ")");
      rows_of[static_cast<size_t>(inv[e])]++;
    }
  }
  Tensor out = at::empty({total}, at::TensorOptions().dtype(at::kFloat));
  std::vector<int32_t> added(static_cast<size_t>(nu), 0);
  // The tables share nothing: each is summed on a thread of its own.
  float* all_out = out.data_ptr<float>();
  at::parallel_for(0, ntab, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; t++) {
      int64_t e = first_e[t], j = first_j[t];
      const int64_t base = first_u[t];
      float* table_out = all_out + first_out[t];
      const int64_t d = runs[t] ? grads[j].size(1) : 0;
      for (int64_t u = 0; u < per[t]; u++)  // an id no run has: zeros
        if (rows_of[static_cast<size_t>(base + u)] == 0) std::fill(table_out + u * d, table_out + (u + 1) * d, 0.0f);
      for (int64_t r = 0; r < runs[t]; r++, j++) {
        const float* g = grads[j].data_ptr<float>();
        for (int64_t i = 0; i < grads[j].size(0); i++, e++) {
          const size_t u = static_cast<size_t>(inv[e]);
          float* __restrict o = table_out + (inv[e] - base) * d;
          const float* __restrict gi = g + i * d;
          if (added[u]++ == 0) {
            for (int64_t c = 0; c < d; c++) o[c] = 0.0f + gi[c];
          } else {
            for (int64_t c = 0; c < d; c++) o[c] += gi[c];
          }
          if (added[u] == rows_of[u] && fscale != 1.0f)
            for (int64_t c = 0; c < d; c++) o[c] *= fscale;
        }
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(hybrid, m) {
  m.def("merge_ids(Tensor ids, int[] counts, int runs) -> (Tensor, Tensor, Tensor)");
  m.def("sum_runs(Tensor[] grads, Tensor inverse, int[] per, int[] runs, float scale) -> Tensor");
  m.def(
      "dynamic_plan(Tensor ids, Tensor found, Tensor seen, int[] counts, Tensor[] slot_id, Tensor[] occupied, "
      "Tensor[] last, Tensor[] count, Tensor[] fill, Tensor[] part_base, Tensor[] part_cap, Tensor[] slot_part, "
      "Tensor[] slot_index, Tensor(a!)[] lru_pos, Tensor(b!)[] lru_queue, Tensor(c!)[] lru_head, "
      "Tensor(d!)[] lru_tail, int step, int partitions, int admit_after, str evict, int ttl) -> "
      "(int, int, int, int, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "dynamic_commit_(Tensor slots, int[] counts, Tensor new_ids, Tensor new_slots, int[] new_counts, "
      "Tensor evicted, int[] evicted_counts, Tensor(a!)[] slot_id, Tensor(b!)[] occupied, Tensor(c!)[] last, "
      "Tensor(d!)[] count, Tensor(e!)[] fill, Tensor[] part_base, Tensor[] part_cap, Tensor[] slot_part, "
      "Tensor[] slot_index, Tensor(f!)[] lru_pos, Tensor(g!)[] lru_queue, Tensor(h!)[] lru_head, "
      "Tensor(i!)[] lru_tail, int step, Tensor(j!)[] weights, int[] keys, float[] bounds) -> Tensor");
  m.def(
      "dynamic_rows(Tensor[] weights, Tensor ids, Tensor slots, Tensor seen, int[] counts, int admit_after, "
      "int[] keys, float[] bounds, Tensor(a!) out) -> Tensor");
}

TORCH_LIBRARY_IMPL(hybrid, CompositeExplicitAutograd, m) {
  m.impl("merge_ids", merge_ids);
  m.impl("sum_runs", sum_runs);
  m.impl("dynamic_plan", dynamic_plan);
  m.impl("dynamic_commit_", dynamic_commit_);
  m.impl("dynamic_rows", dynamic_rows);
}
