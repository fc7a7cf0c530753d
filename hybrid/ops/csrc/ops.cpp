// hybrid's torch operators (namespace `hybrid`): typed schemas, every argument checked, then
// the raw-memory kernels of kernels.h. A wrong dtype, device, layout, shape or length is a
// programming mistake and raises (TypeError for a dtype, ValueError otherwise). A problem in the
// data -- an id outside its table, a non-finite gradient or new weight -- is returned as a
// status (code, table, position, count) for hybrid/ops/__init__.py to raise as RowOutOfRange or
// NonFinite; an operator that reports one has written nothing.
#include <Python.h>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

#include "dtype.h"
#include "kernels.h"

namespace {

using at::IntArrayRef;
using at::Tensor;
using at::TensorList;
namespace k = hybrid::kernels;

using StatusTuple = std::tuple<int64_t, int64_t, int64_t, int64_t>;

StatusTuple as_tuple(const k::Status& s) { return {s.code, s.table, s.position, s.count}; }

// Rows of `dim` elements a thread takes at least when a call is split over threads (about
// 128 KiB of float32): below twice that, one thread does it all.
int64_t row_grain(int64_t dim) { return std::max<int64_t>(64, 32768 / std::max<int64_t>(dim, 1)); }

// -- argument checks ------------------------------------------------------------------------------

void check_cpu_contiguous(const Tensor& t, const char* what) {
  TORCH_CHECK_VALUE(t.defined(), what, " is undefined");
  TORCH_CHECK_VALUE(t.device().is_cpu(), what, " must be on the CPU, got ", t.device());
  TORCH_CHECK_VALUE(t.is_contiguous(), what, " must be contiguous");
}

void check_int64_1d(const Tensor& t, const char* what) {
  check_cpu_contiguous(t, what);
  TORCH_CHECK_TYPE(t.scalar_type() == at::kLong, what, " must be int64, got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.dim() == 1, what, " must be 1-D, got shape ", t.sizes());
}

using hybrid::float_dtype;

void check_float32(const Tensor& t, const std::string& what) {
  check_cpu_contiguous(t, what.c_str());
  TORCH_CHECK_TYPE(t.scalar_type() == at::kFloat, what, " must be float32, got ", t.scalar_type());
}

// A table: 2-D rows x dim, float32/bfloat16/float16, contiguous on the CPU.
k::Table table_view(const Tensor& t, const std::string& what) {
  check_cpu_contiguous(t, what.c_str());
  const k::DType dtype = float_dtype(t, what);
  TORCH_CHECK_VALUE(t.dim() == 2, what, " must be 2-D (rows x dim), got shape ", t.sizes());
  return {t.data_ptr(), dtype, t.size(0), t.size(1)};
}

std::vector<k::Table> table_views(TensorList tables, const char* what) {
  std::vector<k::Table> out;
  out.reserve(tables.size());
  for (size_t i = 0; i < tables.size(); i++)
    out.push_back(table_view(tables[i], std::string(what) + "[" + std::to_string(i) + "]"));
  return out;
}

// counts: one non-negative count per table, summing to the number of ids. Returns the number
// of elements those rows hold (sum of count x dim).
int64_t check_counts(IntArrayRef counts, const std::vector<k::Table>& tables, int64_t nids) {
  TORCH_CHECK_VALUE(counts.size() == tables.size(), "counts has ", counts.size(),
                    " entries for ", tables.size(), " tables");
  int64_t total = 0, numel = 0;
  for (size_t t = 0; t < counts.size(); t++) {
    TORCH_CHECK_VALUE(counts[t] >= 0, "counts[", t, "] is negative: ", counts[t]);
    total += counts[t];
    numel += counts[t] * tables[t].dim;
  }
  TORCH_CHECK_VALUE(total == nids, "counts sum to ", total, " but ids holds ", nids);
  return numel;
}

// A radix sort packs (row << position bits | position) into 64 bits.
void check_sort_key(int64_t rows, int64_t n, const char* op) {
  const int bits = k::bit_length(static_cast<uint64_t>(n > 1 ? n - 1 : 1)) +
                   k::bit_length(static_cast<uint64_t>(rows > 0 ? rows - 1 : 0));
  TORCH_CHECK_VALUE(bits <= 63, op, ": ", rows, " rows and ", n,
                    " ids do not fit one 64-bit sort key; split the call");
}

// A lookup's bags: idx (each id's row, or bag) and offsets (the bags' bounds, the last one
// included), both int32 and 1-D, the offsets running from 0 to the number of ids without
// decreasing, every index in [0, bound) (`unit`: what the indices count, for the message).
// Returns the longest bag. Branch-free scans (they run on every step's lookup and push); the
// rare bad input is searched again to name it.
int64_t check_bags(const Tensor& idx, const Tensor& offsets, int64_t bound, const char* unit,
                   const std::string& idx_name = "idx", const std::string& offsets_name = "offsets") {
  check_cpu_contiguous(idx, idx_name.c_str());
  check_cpu_contiguous(offsets, offsets_name.c_str());
  TORCH_CHECK_TYPE(idx.scalar_type() == at::kInt && offsets.scalar_type() == at::kInt, idx_name, " and ",
                   offsets_name, " must be int32, got ", idx.scalar_type(), " and ", offsets.scalar_type());
  TORCH_CHECK_VALUE(idx.dim() == 1 && offsets.dim() == 1 && offsets.numel() >= 1, idx_name, " and ", offsets_name,
                    " must be 1-D, ", offsets_name, " with at least one entry");
  const int64_t n = idx.numel(), nbags = offsets.numel() - 1;
  const int32_t* op = offsets.data_ptr<int32_t>();
  TORCH_CHECK_VALUE(op[0] == 0 && op[nbags] == n, offsets_name, " must run from 0 to ", n, " (the ids), got ", op[0],
                    " to ", op[nbags]);
  int32_t shortest = 0, longest = 0;
  for (int64_t g = 0; g < nbags; g++) {
    const int32_t len = op[g + 1] - op[g];
    shortest = std::min(shortest, len);
    longest = std::max(longest, len);
  }
  if (shortest < 0)
    for (int64_t g = 0; g < nbags; g++)
      TORCH_CHECK_VALUE(op[g] <= op[g + 1], offsets_name, " must not decrease (bag ", g, ")");
  const int32_t* ip = idx.data_ptr<int32_t>();
  // As unsigned, a negative index is 2^31 or more, past any bound an int32 index can meet.
  const uint32_t ubound = static_cast<uint32_t>(std::clamp<int64_t>(bound, 0, int64_t{1} << 31));
  int32_t bad = 0;
  for (int64_t p = 0; p < n; p++) bad |= static_cast<int32_t>(static_cast<uint32_t>(ip[p]) >= ubound);
  if (bad)
    for (int64_t p = 0; p < n; p++)
      TORCH_CHECK_VALUE(ip[p] >= 0 && ip[p] < bound, idx_name, "[", p, "] = ", ip[p], " is not one of the ", bound,
                        " ", unit);
  return longest;
}

// -- route ----------------------------------------------------------------------------------------

using RouteTuple = std::tuple<int64_t, int64_t, int64_t, int64_t, Tensor, Tensor, Tensor, Tensor, Tensor,
                              Tensor, Tensor, Tensor, Tensor>;

// route and route_hashed: row_base (tables + 1 entries) for tables of rows, or undefined for raw
// ids (partitions > 0).
RouteTuple route_batch(const Tensor& ids, const Tensor& lengths, const Tensor& feature_table,
                       const Tensor& row_base, const Tensor& shards, const Tensor& server_rank,
                       int64_t partitions, int64_t num_servers, int64_t batch_size,
                       const std::optional<Tensor>& weights, bool mean, bool sample_major, bool backward) {
  check_int64_1d(ids, "ids");
  check_int64_1d(lengths, "lengths");
  check_int64_1d(feature_table, "feature_table");
  check_int64_1d(shards, "shards");
  check_cpu_contiguous(server_rank, "server_rank");
  TORCH_CHECK_TYPE(server_rank.scalar_type() == at::kLong, "server_rank must be int64, got ",
                   server_rank.scalar_type());
  const int64_t n = ids.numel(), nf = feature_table.numel(), ntab = shards.numel();
  TORCH_CHECK_VALUE(batch_size >= 0, "batch_size must be >= 0, got ", batch_size);
  TORCH_CHECK_VALUE(num_servers >= 1, "num_servers must be >= 1, got ", num_servers);
  TORCH_CHECK_VALUE(lengths.numel() == nf * batch_size, "lengths holds ", lengths.numel(),
                    " bags; expected features x batch_size = ", nf, " x ", batch_size);
  TORCH_CHECK_VALUE(server_rank.dim() == 2 && server_rank.size(0) == ntab,
                    "server_rank must be [tables, max shards] = [", ntab, ", *], got shape ",
                    server_rank.sizes());
  const int64_t width = server_rank.size(1);
  const int64_t* len = lengths.data_ptr<int64_t>();
  const int64_t* ft = feature_table.data_ptr<int64_t>();
  const int64_t* sh = shards.data_ptr<int64_t>();
  const int64_t* sr = server_rank.data_ptr<int64_t>();
  int64_t total = 0;
  for (int64_t i = 0; i < lengths.numel(); i++) {
    TORCH_CHECK_VALUE(len[i] >= 0, "lengths[", i, "] is negative: ", len[i]);
    total += len[i];
  }
  TORCH_CHECK_VALUE(total == n, "lengths sum to ", total, " but ids holds ", n);
  for (int64_t f = 0; f < nf; f++)
    TORCH_CHECK_VALUE(ft[f] >= 0 && ft[f] < ntab, "feature_table[", f, "] = ", ft[f],
                      " is not a table index in [0, ", ntab, ")");
  for (int64_t t = 0; t < ntab; t++) {
    TORCH_CHECK_VALUE(sh[t] >= 1 && sh[t] <= width, "shards[", t, "] = ", sh[t],
                      " is not in [1, ", width, "]");
    for (int64_t s = 0; s < sh[t]; s++)
      TORCH_CHECK_VALUE(sr[t * width + s] >= 0 && sr[t * width + s] < num_servers,
                        "server_rank[", t, ", ", s, "] = ", sr[t * width + s],
                        " is not a server in [0, ", num_servers, ")");
  }
  const int64_t* rb = nullptr;
  if (partitions == 0) {
    check_int64_1d(row_base, "row_base");
    TORCH_CHECK_VALUE(row_base.numel() == ntab + 1, "row_base holds ", row_base.numel(),
                      " entries; expected tables + 1 = ", ntab + 1);
    rb = row_base.data_ptr<int64_t>();
    TORCH_CHECK_VALUE(rb[0] == 0, "row_base[0] must be 0, got ", rb[0]);
    for (int64_t t = 0; t < ntab; t++)
      TORCH_CHECK_VALUE(rb[t + 1] >= rb[t], "row_base must not decrease: row_base[", t + 1,
                        "] = ", rb[t + 1], " < row_base[", t, "] = ", rb[t]);
    check_sort_key(rb[ntab], n, "route");
  } else {
    TORCH_CHECK_VALUE(partitions >= 1, "partitions must be >= 1, got ", partitions);
  }
  const float* w = nullptr;
  if (weights.has_value()) {
    check_float32(*weights, "weights");
    TORCH_CHECK_VALUE(weights->dim() == 1 && weights->numel() == n, "weights must be [", n,
                      "] like ids, got shape ", weights->sizes());
    w = weights->data_ptr<float>();
  }

  auto i64 = at::TensorOptions().dtype(at::kLong);
  auto f32 = at::TensorOptions().dtype(at::kFloat);
  Tensor req = at::empty({n}, i64), per = at::empty({num_servers, ntab}, i64);
  Tensor raw = at::empty({num_servers}, i64), idx = at::empty({n}, i64);
  Tensor offsets = at::empty({nf * batch_size + 1}, i64);
  Tensor weights_out = at::empty({w ? n : 0}, f32);
  Tensor grad_bags = at::empty({backward ? n : 0}, i64), grad_offsets = at::empty({backward ? n + 1 : 1}, i64);
  Tensor grad_scale = at::empty({backward && (w || mean) ? n : 0}, f32);
  const k::RouteIn in{n,  ids.data_ptr<int64_t>(), nf,    batch_size, len,         ft,        ntab, rb, sh,
                      sr, width,                   num_servers, w,    mean,        sample_major, partitions,
                      backward};
  const k::RouteOut out{req.data_ptr<int64_t>(),
                        per.data_ptr<int64_t>(),
                        raw.data_ptr<int64_t>(),
                        idx.data_ptr<int64_t>(),
                        offsets.data_ptr<int64_t>(),
                        w ? weights_out.data_ptr<float>() : nullptr,
                        backward ? grad_bags.data_ptr<int64_t>() : nullptr,
                        backward ? grad_offsets.data_ptr<int64_t>() : nullptr,
                        backward && (w || mean) ? grad_scale.data_ptr<float>() : nullptr};
  k::Status st;
  int64_t nu = k::route(in, out, &st);
  if (nu < 0) nu = 0;
  return {st.code,   st.table,    st.position, st.count,  req.narrow(0, 0, nu),
          per,       raw,         idx,         offsets,   weights_out,
          grad_bags, backward ? grad_offsets.narrow(0, 0, nu + 1) : grad_offsets.narrow(0, 0, 0), grad_scale};
}

RouteTuple route(const Tensor& ids, const Tensor& lengths, const Tensor& feature_table, const Tensor& row_base,
                 const Tensor& shards, const Tensor& server_rank, int64_t num_servers, int64_t batch_size,
                 const std::optional<Tensor>& weights, bool mean, bool sample_major, bool backward) {
  return route_batch(ids, lengths, feature_table, row_base, shards, server_rank, 0, num_servers, batch_size,
                     weights, mean, sample_major, backward);
}

RouteTuple route_hashed(const Tensor& ids, const Tensor& lengths, const Tensor& feature_table,
                        const Tensor& shards, const Tensor& server_rank, int64_t partitions,
                        int64_t num_servers, int64_t batch_size, const std::optional<Tensor>& weights,
                        bool mean, bool sample_major, bool backward) {
  TORCH_CHECK_VALUE(partitions >= 1, "partitions must be >= 1, got ", partitions);
  return route_batch(ids, lengths, feature_table, Tensor(), shards, server_rank, partitions, num_servers,
                     batch_size, weights, mean, sample_major, backward);
}

// -- the server's rows --------------------------------------------------------------------------

StatusTuple gather_rows(TensorList tables, const Tensor& ids, IntArrayRef counts,
                        const Tensor& out) {
  const auto views = table_views(tables, "tables");
  check_int64_1d(ids, "ids");
  const int64_t numel = check_counts(counts, views, ids.numel());
  check_cpu_contiguous(out, "out");
  const k::DType odt = float_dtype(out, "out");
  TORCH_CHECK_VALUE(out.numel() >= numel, "out holds ", out.numel(), " elements; the rows need ",
                    numel);
  const int64_t* ip = ids.data_ptr<int64_t>();
  const k::Status st = k::first_bad_id(views.data(), static_cast<int64_t>(views.size()),
                                       counts.data(), ip);
  if (st.code != k::kOk) return as_tuple(st);
  // All tables' ids as one range split over threads: task [lo, hi) reads the tables it spans.
  const int64_t ntab = static_cast<int64_t>(views.size());
  std::vector<int64_t> first_id(ntab + 1, 0), first_out(ntab + 1, 0);
  int64_t widest = 1;
  for (int64_t t = 0; t < ntab; t++) {
    first_id[t + 1] = first_id[t] + counts[t];
    first_out[t + 1] = first_out[t] + counts[t] * views[t].dim;
    widest = std::max(widest, views[t].dim);
  }
  const k::RowKernels& kern = k::dispatch();
  char* o = static_cast<char*>(out.data_ptr());
  const int64_t esize = out.element_size();
  at::parallel_for(0, ids.numel(), row_grain(widest), [&](int64_t lo, int64_t hi) {
    int64_t t = std::upper_bound(first_id.begin(), first_id.end(), lo) - first_id.begin() - 1;
    for (int64_t p = lo; p < hi; t++) {
      const int64_t end = std::min(hi, first_id[t + 1]);
      if (end > p)
        kern.gather(views[t], ip + p, end - p,
                    o + (first_out[t] + (p - first_id[t]) * views[t].dim) * esize, odt);
      p = std::max(p, end);
    }
  });
  return as_tuple(st);
}

// Bags pooled from the tables' rows as they are (pool_on: server): the rows are `ids` of the
// tables (split by counts, as gather_rows), numbered in that order; bag b pools rows idx[p] for
// p in [offsets[b], offsets[b + 1]) into out[b]. Every table shares one dim and dtype.
StatusTuple pool_rows(TensorList tables, const Tensor& ids, IntArrayRef counts, const Tensor& idx,
                      const Tensor& offsets, const std::optional<Tensor>& weights, bool mean,
                      const Tensor& out) {
  const auto views = table_views(tables, "tables");
  TORCH_CHECK_VALUE(!views.empty(), "pool_rows needs at least one table (the rows' dim and dtype)");
  check_int64_1d(ids, "ids");
  check_counts(counts, views, ids.numel());
  const int64_t nrows = ids.numel();
  const int64_t dim = views[0].dim;
  const k::DType dtype = views[0].dtype;
  for (size_t t = 1; t < views.size(); t++)
    TORCH_CHECK_VALUE(views[t].dim == dim && views[t].dtype == dtype, "tables[", t,
                      "] differs from tables[0] in dim or dtype: one call pools one group");
  check_bags(idx, offsets, nrows, "rows");
  const int64_t n = idx.numel(), nbags = offsets.numel() - 1;
  const int32_t* ip = idx.data_ptr<int32_t>();
  const int32_t* op = offsets.data_ptr<int32_t>();
  const float* wp = nullptr;
  if (weights.has_value()) {
    check_float32(*weights, "weights");
    TORCH_CHECK_VALUE(weights->numel() == n, n, " ids but ", weights->numel(), " weights");
    TORCH_CHECK_VALUE(!mean, "per-sample weights pool by sum only (as embedding_bag), not mean");
    wp = weights->data_ptr<float>();
  }
  check_cpu_contiguous(out, "out");
  const k::DType odt = float_dtype(out, "out");
  TORCH_CHECK_VALUE(out.numel() == nbags * dim, "out holds ", out.numel(), " elements; ", nbags, " bags of ", dim,
                    " need ", nbags * dim);
  const int64_t* id = ids.data_ptr<int64_t>();
  const k::Status st = k::first_bad_id(views.data(), static_cast<int64_t>(views.size()), counts.data(), id);
  if (st.code != k::kOk) return as_tuple(st);
  // Each row's address in its table: the kernel reads the rows where they are.
  std::vector<const void*> rows(static_cast<size_t>(nrows));
  const int64_t rbytes = dim * static_cast<int64_t>(at::elementSize(tables[0].scalar_type()));
  for (int64_t t = 0, p = 0; t < static_cast<int64_t>(views.size()); t++) {
    const char* base = static_cast<const char*>(views[t].data);
    for (int64_t e = p + counts[t]; p < e; p++) rows[p] = base + id[p] * rbytes;
  }
  const k::RowKernels& kern = k::dispatch();
  char* o = static_cast<char*>(out.data_ptr());
  const int64_t obytes = dim * out.element_size();
  // Bags split over threads, each task at least row_grain rows' worth of ids.
  const int64_t per_bag = std::max<int64_t>(1, nbags ? n / nbags : 1);
  at::parallel_for(0, nbags, std::max<int64_t>(1, row_grain(dim) / per_bag), [&](int64_t lo, int64_t hi) {
    kern.pool(rows.data(), dtype, dim, ip, op + lo, hi - lo, wp, mean, o + lo * obytes, odt);
  });
  return as_tuple(st);
}

// grads: the gradient rows of every table in order, in one or more tensors (say one per
// contribution), each holding whole tables' rows: no copy to join a step's contributions.
StatusTuple sgd_rows_(TensorList tables, const Tensor& ids, IntArrayRef counts, TensorList grads,
                      double alpha) {
  const auto views = table_views(tables, "tables");
  check_int64_1d(ids, "ids");
  const int64_t numel = check_counts(counts, views, ids.numel());
  TORCH_CHECK_VALUE(!grads.empty(), "grads must hold at least one tensor");
  const k::DType gdt = float_dtype(grads[0], "grads[0]");
  int64_t gnumel = 0;
  for (size_t j = 0; j < grads.size(); j++) {
    const std::string what = "grads[" + std::to_string(j) + "]";
    check_cpu_contiguous(grads[j], what.c_str());
    TORCH_CHECK_TYPE(float_dtype(grads[j], what) == gdt, what, " has dtype ", grads[j].scalar_type(),
                     "; grads[0] has ", grads[0].scalar_type());
    gnumel += grads[j].numel();
  }
  TORCH_CHECK_VALUE(gnumel == numel, "grads hold ", gnumel, " elements; the rows need ", numel);
  const int64_t ntab = static_cast<int64_t>(views.size());
  for (int64_t t = 0; t < ntab; t++)
    if (views[t].dtype != k::DType::f32) check_sort_key(views[t].rows, counts[t], "sgd_rows_");
  const int64_t* ip = ids.data_ptr<int64_t>();
  k::Status st = k::first_bad_id(views.data(), ntab, counts.data(), ip);
  if (st.code != k::kOk) return as_tuple(st);
  std::vector<const char*> grad_of(ntab);
  std::vector<int64_t> first_id(ntab);
  size_t j = 0;
  int64_t used = 0, p = 0;  // elements of grads[j] taken by earlier tables
  for (int64_t t = 0; t < ntab; t++) {  // every gradient checked before any row is written
    const int64_t n = counts[t] * views[t].dim;
    while (n > 0 && used == grads[j].numel()) j++, used = 0;
    TORCH_CHECK_VALUE(used + n <= grads[j].numel(), "table ", t, "'s ", n, " gradient elements cross the end of grads[",
                      j, "] (", grads[j].numel(), " elements): each tensor of grads must hold whole tables");
    grad_of[t] = static_cast<const char*>(grads[j].data_ptr()) + used * grads[j].element_size();
    used += n;
    first_id[t] = p;
    int64_t first = -1;
    const int64_t bad = k::dispatch().nonfinite_rows(grad_of[t], gdt, counts[t], views[t].dim, &first);
    if (bad && st.code == k::kOk) {
      st.code = k::kNonFinite;
      st.table = t;
      st.position = p + first;
    }
    st.count += bad;
    p += counts[t];
  }
  if (st.code != k::kOk) return as_tuple(st);
  // Tables sharing memory (a table listed once per contribution) are one group, updated in the
  // order listed; the groups run on threads of their own.
  std::vector<std::vector<int64_t>> groups;
  std::vector<int64_t> group_of(ntab, -1);
  for (int64_t a = 0; a < ntab; a++) {
    for (int64_t b = 0; b < a && group_of[a] < 0; b++)
      if (tables[a].is_alias_of(tables[b])) group_of[a] = group_of[b];
    if (group_of[a] < 0) {
      group_of[a] = static_cast<int64_t>(groups.size());
      groups.emplace_back();
    }
    groups[static_cast<size_t>(group_of[a])].push_back(a);
  }
  const k::RowKernels& kern = k::dispatch();
  at::parallel_for(0, static_cast<int64_t>(groups.size()), 1, [&](int64_t lo, int64_t hi) {
    for (int64_t g = lo; g < hi; g++)
      for (const int64_t t : groups[static_cast<size_t>(g)])
        kern.sgd(views[t], ip + first_id[t], counts[t], grad_of[t], gdt, static_cast<float>(alpha));
  });
  return as_tuple(st);
}

std::tuple<int64_t, int64_t, int64_t, int64_t, Tensor, Tensor> sum_rows(const Tensor& ids,
                                                                        const Tensor& grads,
                                                                        double scale,
                                                                        int64_t num_rows) {
  check_int64_1d(ids, "ids");
  check_cpu_contiguous(grads, "grads");
  const k::DType gdt = float_dtype(grads, "grads");
  TORCH_CHECK_VALUE(grads.dim() == 2 && grads.size(0) == ids.numel(),
                    "grads must be [len(ids), dim] = [", ids.numel(), ", *], got shape ",
                    grads.sizes());
  TORCH_CHECK_VALUE(num_rows >= 0, "num_rows must be >= 0, got ", num_rows);
  const int64_t n = ids.numel(), d = grads.size(1);
  check_sort_key(num_rows, n, "sum_rows");
  const k::Table table{nullptr, k::DType::f32, num_rows, d};
  const int64_t* ip = ids.data_ptr<int64_t>();
  const k::Status st = k::first_bad_id(&table, 1, &n, ip);
  Tensor rows = at::empty({n}, at::TensorOptions().dtype(at::kLong));
  Tensor summed = at::empty({n, d}, at::TensorOptions().dtype(at::kFloat));
  int64_t nu = 0;
  if (st.code == k::kOk)
    nu = k::dispatch().sum_rows(n, ip, grads.data_ptr(), gdt, d, static_cast<float>(scale),
                                num_rows, rows.data_ptr<int64_t>(), summed.data_ptr<float>());
  return {st.code, st.table, st.position, st.count, rows.narrow(0, 0, nu), summed.narrow(0, 0, nu)};
}

// -- optimizers -----------------------------------------------------------------------------------

k::Optim optim_kind(std::string_view kind) {
  if (kind == "sgd") return k::Optim::sgd;
  if (kind == "adagrad") return k::Optim::adagrad;
  if (kind == "rowwise_adagrad") return k::Optim::rowwise_adagrad;
  if (kind == "adam") return k::Optim::adam;
  TORCH_CHECK_VALUE(false, "optimizer kind must be one of sgd, adagrad, rowwise_adagrad, adam; got '",
                    std::string(kind), "'");
}

// The state each optimizer keeps, in the order of the op's state list: (rows x dim) when per
// element, (rows) when per row.
std::vector<bool> state_per_element(k::Optim kind) {
  switch (kind) {
    case k::Optim::adagrad:
      return {true};
    case k::Optim::rowwise_adagrad:
      return {false};
    case k::Optim::adam:
      return {true, true, false};
    default:
      return {};
  }
}

// Checks one table's state list against its weight; returns the pointers.
k::State state_view(k::Optim kind, TensorList state, const k::Table& w) {
  const auto shapes = state_per_element(kind);
  TORCH_CHECK_VALUE(state.size() == shapes.size(), "state holds ", state.size(),
                    " tensors; the optimizer keeps ", shapes.size());
  float* ptrs[3] = {nullptr, nullptr, nullptr};
  for (size_t i = 0; i < shapes.size(); i++) {
    const std::string what = "state[" + std::to_string(i) + "]";
    check_float32(state[i], what);
    if (shapes[i]) {
      TORCH_CHECK_VALUE(state[i].dim() == 2 && state[i].size(0) == w.rows && state[i].size(1) == w.dim,
                        what, " must be [", w.rows, ", ", w.dim, "] like the weight, got shape ",
                        state[i].sizes());
    } else {
      TORCH_CHECK_VALUE(state[i].dim() == 1 && state[i].size(0) == w.rows, what, " must be [",
                        w.rows, "] (one value per row), got shape ", state[i].sizes());
    }
    ptrs[i] = state[i].data_ptr<float>();
  }
  return {ptrs[0], ptrs[1], ptrs[2]};
}

std::tuple<int64_t, int64_t, int64_t, int64_t, Tensor, std::vector<Tensor>> optimizer_rows(
    std::string_view kind_name, const Tensor& rows, const Tensor& grads, double grad_scale,
    const Tensor& weight, TensorList state, double lr, double eps, double weight_decay,
    double beta1, double beta2) {
  const k::Optim kind = optim_kind(kind_name);
  check_int64_1d(rows, "rows");
  const k::Table w = table_view(weight, "weight");
  const k::State sv = state_view(kind, state, w);
  check_cpu_contiguous(grads, "grads");
  k::DType gdt = float_dtype(grads, "grads");
  const int64_t n = rows.numel(), d = w.dim;
  TORCH_CHECK_VALUE(grads.dim() == 2 && grads.size(0) == n && grads.size(1) == d,
                    "grads must be [len(rows), dim] = [", n, ", ", d, "], got shape ", grads.sizes());
  const int64_t* rp = rows.data_ptr<int64_t>();
  k::Status st = k::first_bad_id(&w, 1, &n, rp);
  auto f32 = at::TensorOptions().dtype(at::kFloat);
  Tensor new_w = at::empty({n, d}, f32);
  std::vector<Tensor> new_state;
  const auto shapes = state_per_element(kind);
  float* optr[3] = {nullptr, nullptr, nullptr};
  for (size_t i = 0; i < shapes.size(); i++) {
    new_state.push_back(shapes[i] ? at::empty({n, d}, f32) : at::empty({n}, f32));
    optr[i] = new_state.back().data_ptr<float>();
  }
  if (st.code != k::kOk || n == 0) return {st.code, st.table, st.position, st.count, new_w, new_state};

  k::Hyper h{static_cast<float>(lr),           static_cast<float>(eps),
             static_cast<float>(weight_decay), static_cast<float>(1.0 - beta1),
             static_cast<float>(beta2),        static_cast<float>(1.0 - beta2)};
  Tensor g = grads, mean, root, step, bc2;
  float gscale = static_cast<float>(grad_scale);
  if (kind == k::Optim::rowwise_adagrad) {  // the gradient rows once, for torch's mean
    g = grads.to(at::kFloat);
    if (grad_scale != 1.0) g = g.mul(grad_scale);
    if (weight_decay != 0.0) g = g.add(weight.index_select(0, rows).to(at::kFloat), weight_decay);
    mean = g.pow(2).mean(1);
    gdt = k::DType::f32;
    gscale = 1.0f;
    h.weight_decay = 0.0f;
  } else if (kind == k::Optim::adam) {  // lr / (1 - beta1 ** k), sqrt(1 - beta2 ** k) in float64
    const Tensor k64 = state[2].index_select(0, rows).add(1).to(at::kDouble);
    step = at::reciprocal(at::rsub(at::pow(beta1, k64), 1)).mul(lr).to(at::kFloat);
    bc2 = at::sqrt(at::rsub(at::pow(beta2, k64), 1)).to(at::kFloat);
  }
  auto ptr = [](const Tensor& t) { return t.defined() ? t.data_ptr<float>() : nullptr; };
  // Rows [lo, hi) of every per-row array.
  auto part = [&](const k::FromTorch& t, int64_t lo) {
    const int64_t root_width = kind == k::Optim::rowwise_adagrad ? 1 : d;
    return k::FromTorch{t.mean ? t.mean + lo : nullptr, t.root ? t.root + lo * root_width : nullptr,
                        t.step ? t.step + lo : nullptr, t.bc2 ? t.bc2 + lo : nullptr};
  };
  auto out_part = [&](int64_t lo) {
    return k::State{optr[0] ? optr[0] + lo * (shapes[0] ? d : 1) : nullptr,
                    optr[1] ? optr[1] + lo * d : nullptr, optr[2] ? optr[2] + lo : nullptr};
  };
  const char* gp = static_cast<const char*>(g.data_ptr());
  const int64_t grow = d * g.element_size();
  const k::RowKernels& kern = k::dispatch();
  if (kind != k::Optim::sgd) {
    const k::FromTorch t{ptr(mean)};
    at::parallel_for(0, n, row_grain(d), [&](int64_t lo, int64_t hi) {
      kern.state_step(kind, w, sv, hi - lo, rp + lo, gp + lo * grow, gdt, gscale, h, part(t, lo),
                      out_part(lo));
    });
    // Row-wise Adagrad's root is the correctly rounded one (float64, rounded once), which its
    // one-pass in-place kernel takes a row at a time; the others' is torch's float32 sqrt.
    root = kind == k::Optim::rowwise_adagrad ? at::sqrt(new_state[0].to(at::kDouble)).to(at::kFloat)
                                             : at::sqrt(new_state[kind == k::Optim::adam ? 1 : 0]);
  }
  const k::FromTorch t{ptr(mean), ptr(root), ptr(step), ptr(bc2)};
  std::mutex mu;
  at::parallel_for(0, n, row_grain(d), [&](int64_t lo, int64_t hi) {
    int64_t first = -1;
    const int64_t bad = kern.weight_step(kind, w, out_part(lo), hi - lo, rp + lo, gp + lo * grow, gdt,
                                         gscale, h, part(t, lo), new_w.data_ptr<float>() + lo * d,
                                         &first);
    if (bad) {
      std::lock_guard<std::mutex> lock(mu);
      if (st.code == k::kOk || lo + first < st.position) {
        st.code = k::kNonFinite;
        st.table = 0;
        st.position = lo + first;
      }
      st.count += bad;
    }
  });
  return {st.code, st.table, st.position, st.count, new_w, new_state};
}

// -- one optimizer step in place ---------------------------------------------------------------

// MKL's float square root, exported by libtorch_cpu in torch's MKL builds: at::sqrt runs it
// (ATen/cpu/vml.h) in this mode. Weak, so a build without it links and takes the two-pass path.
extern "C" void vmsSqrt(int n, const float* a, float* r, long long mode) __attribute__((weak));
constexpr long long kVmlHa = 0x2, kVmlFtzdazOff = 0x140000, kVmlErrmodeIgnore = 0x100;

void vml_sqrt(int64_t n, const float* x, float* y) {
  vmsSqrt(static_cast<int>(n), x, y, kVmlHa | kVmlFtzdazOff | kVmlErrmodeIgnore);
}

// Deterministic test values: positive, over many binades, with some zeros.
void fill_test_values(float* p, int64_t n, uint32_t seed, bool signed_values) {
  uint32_t s = seed;
  for (int64_t i = 0; i < n; i++) {
    s = s * 1664525u + 1013904223u;
    const float u = static_cast<float>(s >> 8) / 16777216.0f;
    float v = std::ldexp(0.5f + u, static_cast<int>((s >> 3) % 24) - 12);
    if (signed_values && (s & 4)) v = -v;
    p[i] = (i % 97 == 5) ? 0.0f : v;
  }
}

// Whether the in-place kernel reproduces optimizer_rows (torch's square roots and row means)
// for this optimizer and row width; for rowwise_adagrad the lanes of torch's row sum. Found
// once per (kind, dim) by running both on a small table; 0: it does not (two passes then).
int inplace_lanes(k::Optim kind, int64_t d) {
  static std::mutex mu;
  static std::map<std::pair<int, int64_t>, int> known;
  std::lock_guard<std::mutex> lock(mu);
  const auto key = std::make_pair(static_cast<int>(kind), d);
  auto it = known.find(key);
  if (it != known.end()) return it->second;
  int found = 0;
  if (vmsSqrt != nullptr || kind == k::Optim::sgd || kind == k::Optim::rowwise_adagrad) {
    const int64_t n = 37;
    const char* names[] = {"sgd", "adagrad", "rowwise_adagrad", "adam"};
    auto f32 = at::TensorOptions().dtype(at::kFloat);
    Tensor weight = at::empty({n + 3, d}, f32), grads = at::empty({n, d}, f32);
    fill_test_values(weight.data_ptr<float>(), weight.numel(), 7, true);
    fill_test_values(grads.data_ptr<float>(), grads.numel(), 11, true);
    Tensor rows = at::arange(1, n + 1, at::TensorOptions().dtype(at::kLong));
    std::vector<Tensor> state;
    for (bool per_el : state_per_element(kind)) {
      state.push_back(per_el ? at::empty({n + 3, d}, f32) : at::empty({n + 3}, f32));
      fill_test_values(state.back().data_ptr<float>(), state.back().numel(), 13, false);
    }
    if (kind == k::Optim::adam) state[2].copy_(at::arange(n + 3, f32).remainder(5));
    const double lr = 0.1, eps = 1e-8, wd = 0.01, b1 = 0.9, b2 = 0.999, gs = 0.5;
    auto want = optimizer_rows(names[static_cast<int>(kind)], rows, grads, gs, weight, state, lr,
                               eps, wd, b1, b2);
    const k::Table w{nullptr, k::DType::f32, n + 3, d};
    const k::Hyper h{static_cast<float>(lr), static_cast<float>(eps), static_cast<float>(wd),
                     static_cast<float>(1.0 - b1), static_cast<float>(b2),
                     static_cast<float>(1.0 - b2)};
    Tensor step, bc2;
    if (kind == k::Optim::adam) {
      const Tensor k64 = state[2].index_select(0, rows).add(1).to(at::kDouble);
      step = at::reciprocal(at::rsub(at::pow(b1, k64), 1)).mul(lr).to(at::kFloat);
      bc2 = at::sqrt(at::rsub(at::pow(b2, k64), 1)).to(at::kFloat);
    }
    for (int lanes : {16, 8}) {
      Tensor wc = weight.clone();
      std::vector<Tensor> sc;
      for (auto& t : state) sc.push_back(t.clone());
      Tensor uw = at::empty({n, d}, f32), u1 = at::empty({n, d}, f32), u2 = at::empty({n, d}, f32),
             u3 = at::empty({n}, f32);
      k::Table wt = w;
      wt.data = wc.data_ptr();
      const k::State sv{sc.size() > 0 ? sc[0].data_ptr<float>() : nullptr,
                        sc.size() > 1 ? sc[1].data_ptr<float>() : nullptr,
                        sc.size() > 2 ? sc[2].data_ptr<float>() : nullptr};
      k::FromTorch ft;
      ft.step = step.defined() ? step.data_ptr<float>() : nullptr;
      ft.bc2 = bc2.defined() ? bc2.data_ptr<float>() : nullptr;
      ft.sqrt = vml_sqrt;
      ft.sum_lanes = lanes;
      int stop = 0;
      const k::StepResult r = k::dispatch().step_inplace(
          kind, wt, sv, n, rows.data_ptr<int64_t>(), grads.data_ptr(), k::DType::f32,
          static_cast<float>(gs), h, ft,
          k::Undo{uw.data_ptr(), u1.data_ptr<float>(), u2.data_ptr<float>(), u3.data_ptr<float>()},
          &stop);
      bool same = std::get<0>(want) == k::kOk && r.bad == 0 && r.committed == n &&
                  at::equal(wc.index_select(0, rows), std::get<4>(want));
      for (size_t i = 0; same && i < sc.size(); i++)
        same = at::equal(sc[i].index_select(0, rows), std::get<5>(want)[i]);
      if (same) {
        found = lanes;
        break;
      }
      if (kind != k::Optim::rowwise_adagrad) break;  // lanes matter to the row mean only
    }
  }
  known[key] = found;
  return found;
}

bool strictly_ascending(const int64_t* r, int64_t n) {
  bool up = true;
  for (int64_t i = 1; i < n; i++) up &= r[i] > r[i - 1];
  return up;
}

// Grow-only scratch for the undo log of the calling thread.
char* undo_scratch(int64_t bytes) {
  static thread_local std::vector<char> buf;
  if (static_cast<int64_t>(buf.size()) < bytes) buf.resize(static_cast<size_t>(bytes));
  return buf.data();
}

StatusTuple optimizer_step_(std::string_view kind_name, TensorList weights, TensorList state,
                            TensorList rows, TensorList grads, at::ArrayRef<double> grad_scales,
                            double lr, double eps, double weight_decay, double beta1,
                            double beta2) {
  const k::Optim kind = optim_kind(kind_name);
  const int64_t ntab = static_cast<int64_t>(weights.size());
  const auto shapes = state_per_element(kind);
  const int64_t ns = static_cast<int64_t>(shapes.size());
  TORCH_CHECK_VALUE(static_cast<int64_t>(rows.size()) == ntab && static_cast<int64_t>(grads.size()) == ntab &&
                        static_cast<int64_t>(grad_scales.size()) == ntab,
                    "rows, grads and grad_scales must hold one entry per table (", ntab, "), got ",
                    rows.size(), ", ", grads.size(), " and ", grad_scales.size());
  TORCH_CHECK_VALUE(static_cast<int64_t>(state.size()) == ntab * ns, "state holds ", state.size(),
                    " tensors; ", ntab, " tables x ", ns, " for ", std::string(kind_name));
  const auto views = table_views(weights, "weights");
  std::vector<k::State> sv;
  std::vector<k::DType> gdt;
  k::Status st;
  for (int64_t t = 0; t < ntab; t++) {
    sv.push_back(state_view(kind, state.slice(t * ns, ns), views[t]));
    check_int64_1d(rows[t], ("rows[" + std::to_string(t) + "]").c_str());
    const std::string gw = "grads[" + std::to_string(t) + "]";
    check_cpu_contiguous(grads[t], gw.c_str());
    gdt.push_back(float_dtype(grads[t], gw));
    const int64_t n = rows[t].numel(), d = views[t].dim;
    TORCH_CHECK_VALUE(grads[t].dim() == 2 && grads[t].size(0) == n && grads[t].size(1) == d, gw,
                      " must be [len(rows[", t, "]), dim] = [", n, ", ", d, "], got shape ",
                      grads[t].sizes());
  }
  for (int64_t t = 0; t < ntab && st.code == k::kOk; t++) {
    const int64_t n = rows[t].numel();
    st = k::first_bad_id(&views[t], 1, &n, rows[t].data_ptr<int64_t>());
    if (st.code != k::kOk) st.table = t;
  }
  if (st.code != k::kOk) return as_tuple(st);

  bool inplace = true;
  std::vector<int> lanes(ntab, 0);
  for (int64_t t = 0; t < ntab && inplace; t++) {
    lanes[t] = inplace_lanes(kind, views[t].dim);
    inplace = lanes[t] > 0 && strictly_ascending(rows[t].data_ptr<int64_t>(), rows[t].numel());
    for (int64_t u = 0; u < t && inplace; u++) inplace = !weights[t].is_alias_of(weights[u]);
  }
  if (!inplace) {  // two passes: every table's new rows computed and checked, then written
    std::vector<std::tuple<int64_t, int64_t, int64_t, int64_t, Tensor, std::vector<Tensor>>> out;
    for (int64_t t = 0; t < ntab; t++) {
      out.push_back(optimizer_rows(kind_name, rows[t], grads[t], grad_scales[t], weights[t],
                                   state.slice(t * ns, ns), lr, eps, weight_decay, beta1, beta2));
      if (std::get<0>(out.back()) != k::kOk)
        return {std::get<0>(out.back()), t, std::get<2>(out.back()), std::get<3>(out.back())};
    }
    const k::RowKernels& kern = k::dispatch();
    for (int64_t t = 0; t < ntab; t++) {
      const int64_t n = rows[t].numel(), d = views[t].dim;
      const int64_t* rp = rows[t].data_ptr<int64_t>();
      kern.scatter(views[t].data, views[t].dtype, d, rp, n, std::get<4>(out[t]).data_ptr(), k::DType::f32);
      for (int64_t i = 0; i < ns; i++)
        kern.scatter(state[t * ns + i].data_ptr(), k::DType::f32, shapes[i] ? d : 1, rp, n,
                     std::get<5>(out[t])[i].data_ptr(), k::DType::f32);
    }
    return as_tuple(st);
  }

  // One visit a row: each table's rows updated in place on torch's threads, the old rows kept
  // in an undo log; a non-finite new weight anywhere restores every row written.
  std::vector<int64_t> undo_at(ntab + 1, 0);
  for (int64_t t = 0; t < ntab; t++) {
    const int64_t n = rows[t].numel(), d = views[t].dim;
    const int64_t esize = weights[t].element_size();
    undo_at[t + 1] = undo_at[t] + ((n * d * esize + 63) & ~int64_t{63}) + 3 * n * d * 4 + 2 * n * 4 + 64;
  }
  char* undo_base = undo_scratch(undo_at[ntab]);
  struct Done {
    int64_t table, lo, count;
  };
  std::vector<Done> done;
  std::vector<k::Undo> undo(ntab);
  const k::RowKernels& kern = k::dispatch();
  k::Hyper h{static_cast<float>(lr),           static_cast<float>(eps),
             static_cast<float>(weight_decay), static_cast<float>(1.0 - beta1),
             static_cast<float>(beta2),        static_cast<float>(1.0 - beta2)};
  for (int64_t t = 0; t < ntab && st.code == k::kOk; t++) {
    const int64_t n = rows[t].numel(), d = views[t].dim;
    if (n == 0) continue;
    const int64_t esize = weights[t].element_size();
    char* u = undo_base + undo_at[t];
    const int64_t wbytes = (n * d * esize + 63) & ~int64_t{63};
    float* uf = reinterpret_cast<float*>(u + wbytes);
    undo[t] = k::Undo{u, uf, uf + n * d, uf + 2 * n * d};
    const int64_t* rp = rows[t].data_ptr<int64_t>();
    Tensor step, bc2;
    if (kind == k::Optim::adam) {
      const Tensor k64 = state[t * ns + 2].index_select(0, rows[t]).add(1).to(at::kDouble);
      step = at::reciprocal(at::rsub(at::pow(beta1, k64), 1)).mul(lr).to(at::kFloat);
      bc2 = at::sqrt(at::rsub(at::pow(beta2, k64), 1)).to(at::kFloat);
    }
    const char* gp = static_cast<const char*>(grads[t].data_ptr());
    const int64_t grow = d * grads[t].element_size();
    const int64_t s1w = ns > 0 && shapes[0] ? d : 1;
    int stop = 0;
    std::mutex mu;
    at::parallel_for(0, n, row_grain(d), [&](int64_t lo, int64_t hi) {
      k::FromTorch ft;
      ft.step = step.defined() ? step.data_ptr<float>() + lo : nullptr;
      ft.bc2 = bc2.defined() ? bc2.data_ptr<float>() + lo : nullptr;
      ft.sqrt = vml_sqrt;
      ft.sum_lanes = lanes[t];
      const k::Undo ur{static_cast<char*>(undo[t].w) + lo * d * esize, undo[t].s1 + lo * s1w,
                       undo[t].s2 + lo * d, undo[t].s3 + lo};
      const k::StepResult r = kern.step_inplace(kind, views[t], sv[t], hi - lo, rp + lo,
                                                gp + lo * grow, gdt[t],
                                                static_cast<float>(grad_scales[t]), h, ft, ur, &stop);
      std::lock_guard<std::mutex> lock(mu);
      if (r.committed) done.push_back({t, lo, r.committed});
      if (r.bad) {
        if (st.code == k::kOk || lo + r.first_bad < st.position) {
          st.code = k::kNonFinite;
          st.table = t;
          st.position = lo + r.first_bad;
        }
        st.count += r.bad;
      }
    });
  }
  if (st.code != k::kOk) {
    for (const Done& x : done) {
      const int64_t n = x.count, d = views[x.table].dim;
      const int64_t* rp = rows[x.table].data_ptr<int64_t>() + x.lo;
      const k::Undo& u = undo[x.table];
      const int64_t esize = weights[x.table].element_size();
      kern.scatter(views[x.table].data, views[x.table].dtype, d, rp, n,
                   static_cast<char*>(u.w) + x.lo * d * esize, views[x.table].dtype);
      const float* old[3] = {u.s1, u.s2, u.s3};
      float* now[3] = {sv[x.table].s1, sv[x.table].s2, sv[x.table].s3};
      for (int64_t i = 0; i < ns; i++) {
        const int64_t width = shapes[i] ? d : 1;
        kern.scatter(now[i], k::DType::f32, width, rp, n, old[i] + x.lo * width, k::DType::f32);
      }
    }
  }
  return as_tuple(st);
}

StatusTuple scatter_rows_(const Tensor& dst, const Tensor& rows, const Tensor& src) {
  check_cpu_contiguous(dst, "dst");
  const k::DType ddt = float_dtype(dst, "dst");
  check_int64_1d(rows, "rows");
  check_cpu_contiguous(src, "src");
  const k::DType sdt = float_dtype(src, "src");
  TORCH_CHECK_VALUE(dst.dim() == 1 || dst.dim() == 2, "dst must be 1-D or 2-D, got shape ",
                    dst.sizes());
  const int64_t n = rows.numel(), width = dst.dim() == 2 ? dst.size(1) : 1;
  TORCH_CHECK_VALUE(src.dim() == dst.dim() && src.size(0) == n && (dst.dim() == 1 || src.size(1) == width),
                    "src must be [len(rows)", dst.dim() == 2 ? ", dim" : "", "] = [", n,
                    dst.dim() == 2 ? ", " + std::to_string(width) : std::string(), "], got shape ",
                    src.sizes());
  const k::Table t{dst.data_ptr(), ddt, dst.size(0), width};
  const int64_t* rp = rows.data_ptr<int64_t>();
  const k::Status st = k::first_bad_id(&t, 1, &n, rp);
  if (st.code != k::kOk) return as_tuple(st);
  // One thread, in order: with a row listed twice the last copy wins, as in index_copy_.
  k::dispatch().scatter(dst.data_ptr(), ddt, width, rp, n, src.data_ptr(), sdt);
  return as_tuple(st);
}

// Plain SGD straight from the gradients of one pooled lookup's bags (pool_on: server): what
// sgd_rows_ does with the row gradients embedding_bag makes of them, bit for bit, without those
// row gradients in memory. grad: float32, group after group, bags[g] x the group's dim each;
// group g's rows (grad_offsets[g]: rows + 1 bounds into grad_bags[g] and grad_scale[g]) are the
// next tables' ids in order, each id once. Every row's gradient is known finite before any row
// is written: from the largest gradient, factor and number of bags of a row, or else by summing
// each row once without writing it.
StatusTuple sgd_bags_(TensorList tables, const Tensor& ids, IntArrayRef counts, const Tensor& grad,
                      TensorList grad_bags, TensorList grad_offsets, const c10::List<std::optional<Tensor>>& grad_scale,
                      IntArrayRef bags, IntArrayRef dims, double alpha) {
  const auto views = table_views(tables, "tables");
  check_int64_1d(ids, "ids");
  check_counts(counts, views, ids.numel());
  check_float32(grad, "grad");
  const size_t ngroups = bags.size();
  TORCH_CHECK_VALUE(grad_bags.size() == ngroups && grad_offsets.size() == ngroups && grad_scale.size() == ngroups &&
                        dims.size() == ngroups,
                    "grad_bags, grad_offsets, grad_scale, bags and dims must have one entry per group");
  const int64_t ntab = static_cast<int64_t>(views.size());
  const int64_t* ip = ids.data_ptr<int64_t>();
  k::Status st = k::first_bad_id(views.data(), ntab, counts.data(), ip);
  if (st.code != k::kOk) return as_tuple(st);
  struct Slice {  // one table's rows of one group
    int64_t table, first_id;  // first_id: the table's first id in ids
    const float* g;           // the group's bag gradients
    const int32_t* gb;
    const int32_t* go;  // the table's first row's bounds in the group's grad_offsets
    const float* gs;
    bool checked;  // its rows' gradients are finite by the bound
  };
  std::vector<Slice> slices;
  const float* gp = grad.data_ptr<float>();
  const k::RowKernels& kern = k::dispatch();
  int64_t t = 0, p = 0, used = 0;
  for (size_t j = 0; j < ngroups; j++) {
    const Tensor& gb = grad_bags[j];
    const Tensor& go = grad_offsets[j];
    const int64_t nb = bags[j], dim = dims[j];
    TORCH_CHECK_VALUE(nb >= 0 && dim >= 0, "bags[", j, "] or dims[", j, "] is negative");
    const std::string index = "[" + std::to_string(j) + "]";
    const int64_t longest = check_bags(gb, go, nb, "bags", "grad_bags" + index, "grad_offsets" + index);
    const int64_t rows = go.numel() - 1, n = gb.numel();
    const int32_t* gop = go.data_ptr<int32_t>();
    const int32_t* gbp = gb.data_ptr<int32_t>();
    const float* gsp = nullptr;
    const std::optional<Tensor> scale = grad_scale.get(j);
    if (scale.has_value()) {
      check_float32(*scale, "grad_scale");
      TORCH_CHECK_VALUE(scale->numel() == n, "grad_scale[", j, "] has ", scale->numel(), " entries for ", n);
      gsp = scale->data_ptr<float>();
    }
    const size_t first_slice = slices.size();
    int64_t r = 0;
    while (r < rows) {  // the tables holding this group's rows, in order
      TORCH_CHECK_VALUE(t < ntab, "the groups hold more rows than the tables' counts");
      TORCH_CHECK_VALUE(views[t].dim == dim, "table ", t, " has dim ", views[t].dim, "; its group's is ", dim);
      slices.push_back({t, p, gp + used, gbp, gop + r, gsp, false});
      r += counts[t];
      p += counts[t];
      t++;
    }
    TORCH_CHECK_VALUE(r == rows, "group ", j, "'s ", rows, " rows end inside a table");
    const int64_t need = nb * dim;
    TORCH_CHECK_VALUE(used + need <= grad.numel(), "grad holds ", grad.numel(),
                      " elements; the groups' bags need more");
    // No row's sum can leave float32's range (with room for rounding): a sum of at most
    // `longest` products each at most factor x most, all finite.
    const float most = kern.max_abs(gp + used, need), factor = gsp != nullptr ? kern.max_abs(gsp, n) : 1.0f;
    const bool bounded = static_cast<double>(longest) * factor * most < 1e37;  // false for infinity
    for (size_t k = first_slice; k < slices.size(); k++) slices[k].checked = bounded;
    used += need;
  }
  TORCH_CHECK_VALUE(t == ntab, "the tables hold more rows than the groups");
  TORCH_CHECK_VALUE(used == grad.numel(), "grad holds ", grad.numel(), " elements; the groups' bags hold ", used);
  for (const Slice& sl : slices) {  // every gradient checked before any row is written
    if (sl.checked) continue;
    int64_t first = -1;
    const int64_t bad = kern.nonfinite_bags(counts[sl.table], views[sl.table].dim, sl.g, sl.gb, sl.go, sl.gs, &first);
    if (bad && st.code == k::kOk) {
      st.code = k::kNonFinite;
      st.table = sl.table;
      st.position = sl.first_id + first;
    }
    st.count += bad;
  }
  if (st.code != k::kOk) return as_tuple(st);
  at::parallel_for(0, static_cast<int64_t>(slices.size()), 1, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; i++) {
      const Slice& sl = slices[static_cast<size_t>(i)];
      kern.sgd_bags(views[sl.table], ip + sl.first_id, counts[sl.table], sl.g, sl.gb, sl.go, sl.gs,
                    static_cast<float>(alpha));
    }
  });
  return as_tuple(st);
}

// -- bag_rows ------------------------------------------------------------------------------------

// The backward's index of bags pooled on a server (pool_on: server): for each row, the bags its
// ids fell in and their factors, grouped row by row -- the order route() gives (a row's ids in
// the batch's feature-major order: feature, then sample, then place in the bag), so that the
// row gradients are summed as a trainer sums them. Bags are numbered sample by sample over
// `features` features: bag s * features + j.
std::tuple<Tensor, Tensor, Tensor> bag_rows(const Tensor& idx, const Tensor& offsets, int64_t rows,
                                            int64_t features, const std::optional<Tensor>& weights, bool mean) {
  TORCH_CHECK_VALUE(rows >= 0 && rows < (int64_t{1} << 31), "rows must be in [0, 2^31), got ", rows);
  check_bags(idx, offsets, rows, "rows");
  const int64_t n = idx.numel(), nbags = offsets.numel() - 1;
  TORCH_CHECK_VALUE(features >= 1 && nbags % features == 0, nbags, " bags are not a whole number of samples of ",
                    features, " features");
  const int32_t* ip = idx.data_ptr<int32_t>();
  const int32_t* op = offsets.data_ptr<int32_t>();
  const float* wp = nullptr;
  if (weights.has_value()) {
    check_float32(*weights, "weights");
    TORCH_CHECK_VALUE(weights->numel() == n, n, " ids but ", weights->numel(), " weights");
    wp = weights->data_ptr<float>();
  }
  auto i32 = idx.options();
  Tensor grad_offsets = at::zeros({rows + 1}, i32);
  int32_t* go = grad_offsets.data_ptr<int32_t>();
  for (int64_t p = 0; p < n; p++) go[ip[p] + 1]++;
  for (int64_t r = 0; r < rows; r++) go[r + 1] += go[r];
  std::vector<int32_t> next(go, go + rows);
  Tensor grad_bags = at::empty({n}, i32);
  Tensor grad_scale = at::empty({wp != nullptr || mean ? n : 0}, idx.options().dtype(at::kFloat));
  int32_t* gb = grad_bags.data_ptr<int32_t>();
  float* gs = grad_scale.data_ptr<float>();
  const int64_t samples = nbags / features;
  for (int64_t j = 0; j < features; j++) {
    for (int64_t s = 0; s < samples; s++) {
      const int64_t bag = s * features + j;
      const float inv_len = 1.0f / static_cast<float>(std::max(op[bag + 1] - op[bag], 1));
      for (int64_t p = op[bag]; p < op[bag + 1]; p++) {
        const int32_t q = next[ip[p]]++;
        gb[q] = static_cast<int32_t>(bag);
        if (wp != nullptr) {
          gs[q] = wp[p];
        } else if (mean) {
          gs[q] = inv_len;
        }
      }
    }
  }
  return {grad_bags, grad_offsets, grad_scale};
}

std::string isa() { return k::dispatch().isa; }

// The lanes of torch's row sum with which optimizer_step_ updates rows of this width in place
// (one pass, an undo log); 0 where its in-place kernel would not reproduce torch, so it takes
// two passes.
int64_t in_place_lanes(std::string_view kind, int64_t dim) {
  TORCH_CHECK_VALUE(dim > 0, "dim must be positive, got ", dim);
  return inplace_lanes(optim_kind(kind), dim);
}

}  // namespace

TORCH_LIBRARY(hybrid, m) {
  m.def(
      "route(Tensor ids, Tensor lengths, Tensor feature_table, Tensor row_base, Tensor shards, "
      "Tensor server_rank, int num_servers, int batch_size, Tensor? weights, bool mean, "
      "bool sample_major, bool backward=True) -> (int, int, int, int, Tensor, Tensor, Tensor, Tensor, Tensor, "
      "Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "route_hashed(Tensor ids, Tensor lengths, Tensor feature_table, Tensor shards, Tensor server_rank, "
      "int partitions, int num_servers, int batch_size, Tensor? weights, bool mean, bool sample_major, "
      "bool backward=True) -> (int, int, int, int, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, "
      "Tensor)");
  m.def("gather_rows(Tensor[] tables, Tensor ids, int[] counts, Tensor(a!) out) -> (int, int, int, int)");
  m.def(
      "pool_rows(Tensor[] tables, Tensor ids, int[] counts, Tensor idx, Tensor offsets, Tensor? weights, "
      "bool mean, Tensor(a!) out) -> (int, int, int, int)");
  m.def(
      "sgd_rows_(Tensor(a!)[] tables, Tensor ids, int[] counts, Tensor[] grads, float alpha) -> "
      "(int, int, int, int)");
  m.def(
      "sgd_bags_(Tensor(a!)[] tables, Tensor ids, int[] counts, Tensor grad, Tensor[] grad_bags, "
      "Tensor[] grad_offsets, Tensor?[] grad_scale, int[] bags, int[] dims, float alpha) -> (int, int, int, int)");
  m.def(
      "sum_rows(Tensor ids, Tensor grads, float scale, int num_rows) -> "
      "(int, int, int, int, Tensor, Tensor)");
  m.def(
      "optimizer_rows(str kind, Tensor rows, Tensor grads, float grad_scale, Tensor weight, "
      "Tensor[] state, float lr, float eps, float weight_decay, float beta1, float beta2) -> "
      "(int, int, int, int, Tensor, Tensor[])");
  m.def(
      "optimizer_step_(str kind, Tensor(a!)[] weights, Tensor(b!)[] state, Tensor[] rows, "
      "Tensor[] grads, float[] grad_scales, float lr, float eps, float weight_decay, float beta1, "
      "float beta2) -> (int, int, int, int)");
  m.def("scatter_rows_(Tensor(a!) dst, Tensor rows, Tensor src) -> (int, int, int, int)");
  m.def(
      "bag_rows(Tensor idx, Tensor offsets, int rows, int features, Tensor? weights, bool mean) -> "
      "(Tensor, Tensor, Tensor)");
  m.def("isa() -> str", isa);
  m.def("in_place_lanes(str kind, int dim) -> int", in_place_lanes);
}

TORCH_LIBRARY_IMPL(hybrid, CompositeExplicitAutograd, m) {
  m.impl("route", route);
  m.impl("route_hashed", route_hashed);
  m.impl("gather_rows", gather_rows);
  m.impl("pool_rows", pool_rows);
  m.impl("sgd_rows_", sgd_rows_);
  m.impl("sgd_bags_", sgd_bags_);
  m.impl("sum_rows", sum_rows);
  m.impl("optimizer_rows", optimizer_rows);
  m.impl("optimizer_step_", optimizer_step_);
  m.impl("scatter_rows_", scatter_rows_);
  m.impl("bag_rows", bag_rows);
}

// `import hybrid._C` loads this library, which registers the operators above.
extern "C" PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}
