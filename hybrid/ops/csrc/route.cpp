// The trainer's route of a batch (one radix sort, then linear passes), the checks every row
// kernel's caller runs first, and the choice of row kernels for this CPU. Compiled for the
// baseline instruction set: it only moves integers.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "convert.h"
#include "hash.h"
#include "kernels.h"

namespace hybrid {
namespace kernels {

constexpr int kRadixBits = 11;
constexpr int64_t kRadix = int64_t{1} << kRadixBits;

const RowKernels& dispatch() {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  static const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (avx2) return avx2_kernels;
#endif
  return base_kernels;
}

int bit_length(uint64_t x) {
  int n = 0;
  while (x) {
    n++;
    x >>= 1;
  }
  return n;
}

void radix_sort(uint64_t* a, uint64_t* tmp, int64_t n, int lo, int hi) {
  std::vector<int64_t> count(kRadix);
  uint64_t* src = a;
  uint64_t* dst = tmp;
  for (int shift = lo; shift < hi; shift += kRadixBits) {
    std::fill(count.begin(), count.end(), 0);
    for (int64_t i = 0; i < n; i++) count[(src[i] >> shift) & (kRadix - 1)]++;
    int64_t sum = 0;
    for (int64_t d = 0; d < kRadix; d++) {
      const int64_t c = count[d];
      count[d] = sum;
      sum += c;
    }
    for (int64_t i = 0; i < n; i++) dst[count[(src[i] >> shift) & (kRadix - 1)]++] = src[i];
    std::swap(src, dst);
  }
  if (src != a) std::memcpy(a, src, static_cast<size_t>(n) * sizeof(uint64_t));
}

int sort_by_row(const int64_t* ids, int64_t n, int64_t nrows, uint64_t* keys) {
  const int pos_bits = bit_length(static_cast<uint64_t>(n > 1 ? n - 1 : 1));
  const int key_bits = bit_length(static_cast<uint64_t>(nrows > 0 ? nrows - 1 : 0));
  for (int64_t i = 0; i < n; i++)
    keys[i] = (static_cast<uint64_t>(ids[i]) << pos_bits) | static_cast<uint64_t>(i);
  radix_sort(keys, keys + n, n, pos_bits, pos_bits + key_bits);
  return pos_bits;
}

Status first_bad_id(const Table* tables, int64_t ntab, const int64_t* counts, const int64_t* ids) {
  Status st;
  int64_t p = 0;
  for (int64_t t = 0; t < ntab; t++) {
    const uint64_t rows = static_cast<uint64_t>(tables[t].rows);
    const int64_t n = counts[t];
    uint64_t bad = 0;  // branch-free scan; the rare bad chunk is searched again
    for (int64_t k = 0; k < n; k++) bad |= static_cast<uint64_t>(ids[p + k]) >= rows;
    if (bad) {
      for (int64_t k = 0; k < n; k++) {
        if (static_cast<uint64_t>(ids[p + k]) >= rows) {
          st.code = kBadRow;
          st.table = t;
          st.position = p + k;
          return st;
        }
      }
    }
    p += n;
  }
  return st;
}

// Raw ids (RouteIn::partitions > 0) grouped by (table, id), positions in order within a group:
// sorted_pos[i] the i-th position in that order, utab/uid each distinct pair, rank[p] the
// distinct pair of position p, ustart[u] its first place in the order. packed: n + n scratch.
// Returns the number of distinct pairs.
static int64_t group_raw_ids(const RouteIn& in, const int64_t* tab, uint64_t* packed, uint64_t* sorted_pos,
                             int64_t* rank, int64_t* ustart, int64_t* utab, int64_t* uid) {
  const int64_t n = in.n;
  const int64_t* ids = in.ids;
  if (n == 0) {
    ustart[0] = 0;
    return 0;
  }
  int64_t lo = ids[0], hi = ids[0];
  for (int64_t p = 1; p < n; p++) {
    lo = std::min(lo, ids[p]);
    hi = std::max(hi, ids[p]);
  }
  const int pos_bits = bit_length(static_cast<uint64_t>(n > 1 ? n - 1 : 1));
  const int id_bits = bit_length(static_cast<uint64_t>(hi) - static_cast<uint64_t>(lo));
  const int tab_bits = bit_length(static_cast<uint64_t>(in.ntab > 1 ? in.ntab - 1 : 0));
  if (pos_bits + id_bits + tab_bits <= 64) {
    // One radix sort of (table, id - lowest id, position).
    for (int64_t p = 0; p < n; p++) {
      const uint64_t key = (static_cast<uint64_t>(tab[p]) << id_bits) |
                           (static_cast<uint64_t>(ids[p]) - static_cast<uint64_t>(lo));
      packed[p] = (key << pos_bits) | static_cast<uint64_t>(p);
    }
    radix_sort(packed, sorted_pos, n, pos_bits, pos_bits + id_bits + tab_bits);
    const uint64_t pos_mask = (uint64_t{1} << pos_bits) - 1;
    for (int64_t i = 0; i < n; i++) sorted_pos[i] = packed[i] & pos_mask;
  } else {
    // Ids spread over most of the int64 range: a comparison sort, ties by position.
    int64_t* order = reinterpret_cast<int64_t*>(packed);
    for (int64_t p = 0; p < n; p++) order[p] = p;
    std::sort(order, order + n, [&](int64_t a, int64_t b) {
      if (tab[a] != tab[b]) return tab[a] < tab[b];
      if (ids[a] != ids[b]) return ids[a] < ids[b];
      return a < b;
    });
    for (int64_t i = 0; i < n; i++) sorted_pos[i] = static_cast<uint64_t>(order[i]);
  }
  int64_t nu = 0;
  for (int64_t i = 0; i < n; i++) {
    const int64_t q = static_cast<int64_t>(sorted_pos[i]);
    if (nu == 0 || tab[q] != utab[nu - 1] || ids[q] != uid[nu - 1]) {
      utab[nu] = tab[q];
      uid[nu] = ids[q];
      ustart[nu++] = i;
    }
    rank[q] = nu - 1;
  }
  ustart[nu] = n;
  return nu;
}

// See kernels.h (RouteIn/RouteOut) and hybrid/ops/reference.py (Route) for each output's meaning.
int64_t route(const RouteIn& in, const RouteOut& out, Status* status) {
  const int64_t n = in.n, nf = in.nf, b = in.b, ntab = in.ntab, nsrv = in.nsrv;
  const int64_t nbags = nf * b;
  const bool hashed = in.partitions > 0;
  const bool backward = in.backward;
  const int pos_bits = bit_length(static_cast<uint64_t>(n > 1 ? n - 1 : 1));
  const int64_t total_rows = hashed ? 0 : in.row_base[ntab];
  const int key_bits = bit_length(static_cast<uint64_t>(total_rows > 0 ? total_rows - 1 : 0));

  // Scratch, uninitialized (every entry is written before it is read): one block of 11n + nbags + 1.
  std::unique_ptr<int64_t[]> block(new int64_t[11 * n + nbags + 1]);
  uint64_t* packed = reinterpret_cast<uint64_t*>(block.get());  // (global row << pos_bits) | position
  uint64_t* sorted_pos = packed + n;  // radix scratch, then the positions in sorted order
  int64_t* bag = block.get() + 2 * n;
  int64_t* rank = bag + n;       // distinct row of each position
  int64_t* ustart = rank + n;    // first sorted position of each distinct row (nu + 1)
  int64_t* ulocal = ustart + n + 1;
  int64_t* ukey = ulocal + n;    // server * ntab + table of each distinct row
  int64_t* place = ukey + n;     // distinct row -> its row in the request
  int64_t* uop = place + n;      // row in the request -> distinct row
  int64_t* bag_start = uop + n;  // first position of each (feature-major) bag
  int64_t* tab = bag_start + nbags;  // table of each position (raw ids)

  // Positions in, with their bags; every id checked against its table (rows, not raw ids).
  int64_t p = 0;
  for (int64_t f = 0; f < nf; f++) {
    const int64_t t = in.feat_table[f];
    const int64_t base = hashed ? 0 : in.row_base[t], rows = hashed ? 0 : in.row_base[t + 1] - base;
    for (int64_t s = 0; s < b; s++) {
      const int64_t len = in.lengths[f * b + s];
      const int64_t bg = in.sample_major ? s * nf + f : f * b + s;
      bag_start[f * b + s] = p;
      for (int64_t k = 0; k < len; k++, p++) {
        const int64_t id = in.ids[p];
        if (backward) bag[p] = bg;
        if (hashed) {
          tab[p] = t;
          continue;
        }
        if (static_cast<uint64_t>(id) >= static_cast<uint64_t>(rows)) {
          status->code = kBadRow;
          status->table = t;
          status->position = p;
          return -1;
        }
        packed[p] = (static_cast<uint64_t>(id + base) << pos_bits) | static_cast<uint64_t>(p);
      }
    }
  }

  // Distinct rows, and each position's; owner server and local row of each distinct row.
  int64_t nu = 0;
  std::fill(out.per, out.per + nsrv * ntab, 0);
  std::fill(out.raw, out.raw + nsrv, 0);
  if (hashed) {
    // ukey holds each pair's table until its server is known.
    nu = group_raw_ids(in, tab, packed, sorted_pos, rank, ustart, ukey, ulocal);
    for (int64_t u = 0; u < nu; u++) {
      const int64_t t = ukey[u];
      const int64_t sh = in.shards[t];
      const int64_t sp = sh > 1 ? hash::part_of(ulocal[u], in.partitions) % sh : 0;
      const int64_t srv = in.server_rank[t * in.width + sp];
      ukey[u] = srv * ntab + t;
      out.per[ukey[u]]++;
      out.raw[srv] += ustart[u + 1] - ustart[u];
    }
  } else {
    radix_sort(packed, sorted_pos, n, pos_bits, pos_bits + key_bits);
    const uint64_t pos_mask = (uint64_t{1} << pos_bits) - 1;
    uint64_t prev = 0;
    for (int64_t i = 0; i < n; i++) {
      const uint64_t g = packed[i] >> pos_bits;
      const int64_t q = static_cast<int64_t>(packed[i] & pos_mask);
      if (i == 0 || g != prev) {
        ulocal[nu] = static_cast<int64_t>(g);  // the global row until placed below
        ustart[nu++] = i;
        prev = g;
      }
      rank[q] = nu - 1;
      sorted_pos[i] = static_cast<uint64_t>(q);
    }
    ustart[nu] = n;
    int64_t t = 0;
    for (int64_t u = 0; u < nu; u++) {
      const int64_t g = ulocal[u];
      while (g >= in.row_base[t + 1]) t++;  // rows ascend, so tables do
      int64_t local = g - in.row_base[t];
      const int64_t sh = in.shards[t];
      int64_t sp = 0;
      if (sh > 1) {
        sp = local % sh;
        local /= sh;
      }
      const int64_t srv = in.server_rank[t * in.width + sp];
      ukey[u] = srv * ntab + t;
      ulocal[u] = local;
      out.per[ukey[u]]++;
      out.raw[srv] += ustart[u + 1] - ustart[u];
    }
  }

  // Distinct rows to their place in the request: server-major, table-minor, ascending (stable).
  std::vector<int64_t> start(nsrv * ntab);
  int64_t sum = 0;
  for (int64_t k = 0; k < nsrv * ntab; k++) {
    start[k] = sum;
    sum += out.per[k];
  }
  for (int64_t u = 0; u < nu; u++) {
    const int64_t j = start[ukey[u]]++;
    place[u] = j;
    uop[j] = u;
    out.req[j] = ulocal[u];
  }

  // Forward: every id's row in the replies; bags sample-major or as given.
  int64_t q = 0;
  out.offsets[0] = 0;
  if (in.sample_major) {
    for (int64_t s = 0; s < b; s++) {
      for (int64_t f = 0; f < nf; f++) {
        const int64_t st = bag_start[f * b + s], len = in.lengths[f * b + s];
        for (int64_t k = 0; k < len; k++, q++) {
          out.idx[q] = place[rank[st + k]];
          if (out.weights) out.weights[q] = in.weights[st + k];
        }
        out.offsets[s * nf + f + 1] = q;
      }
    }
  } else {
    for (int64_t bg = 0; bg < nbags; bg++) {
      const int64_t len = in.lengths[bg];
      for (int64_t k = 0; k < len; k++, q++) {
        out.idx[q] = place[rank[q]];
        if (out.weights) out.weights[q] = in.weights[q];
      }
      out.offsets[bg + 1] = q;
    }
  }

  if (!backward) return nu;  // no backward's index asked for (the bags pool on the servers)

  // Backward groups in the request's row order: each row's ids (arrival order), their bags
  // and scales.
  int64_t go = 0;
  for (int64_t j = 0; j < nu; j++) {
    const int64_t u = uop[j];
    out.grad_offsets[j] = go;
    for (int64_t i = ustart[u]; i < ustart[u + 1]; i++, go++) {
      const int64_t pos = static_cast<int64_t>(sorted_pos[i]);
      out.grad_bags[go] = bag[pos];
      if (in.mean) {  // the id's bag holds len >= 1 ids
        const int64_t bg = bag[pos];
        const int64_t fm = in.sample_major ? (bg % nf) * b + bg / nf : bg;
        out.grad_scale[go] = 1.0f / static_cast<float>(in.lengths[fm]);
      } else if (in.weights) {
        out.grad_scale[go] = in.weights[pos];
      }
    }
  }
  out.grad_offsets[nu] = go;
  return nu;
}

}  // namespace kernels
}  // namespace hybrid
