// hybrid's row kernels on raw memory: no torch types here, so the same code can be compiled
// once per instruction set (kernels_base.cpp, kernels_avx2.cpp) and picked at run time.
// ops.cpp checks every tensor before it calls in; these functions trust what they are given
// except the data itself (row ids against their table, finiteness), which they report.
#pragma once

#include <cstdint>
#include <cstring>

namespace hybrid {
namespace kernels {

// Element types a table, a gradient or an output may have.
enum class DType : int { f32 = 0, bf16 = 1, f16 = 2 };

// One table's rows: rows x dim elements of dtype, contiguous.
struct Table {
  void* data;
  DType dtype;
  int64_t rows;
  int64_t dim;
};

// What a kernel found wrong in its data; code kOk when nothing.
enum Code : int64_t { kOk = 0, kBadRow = 1, kNonFinite = 2 };
struct Status {
  int64_t code = kOk;
  int64_t table = -1;     // the (first) table of the offending id or value
  int64_t position = -1;  // the first offending id's or row's position in the call's ids
  int64_t count = 0;      // kNonFinite: how many rows hold a non-finite value
};

enum class Optim : int { sgd = 0, adagrad = 1, rowwise_adagrad = 2, adam = 3 };

// Hyper-parameters as float32, the precision torch applies them in to float32 tensors.
struct Hyper {
  float lr, eps, weight_decay, beta1_weight, beta2, beta2_weight;  // *_weight = 1 - beta
};

// The state tensors of one table for an optimizer (nullptr where the optimizer has none):
// s1 = sum (adagrad: rows x dim; rowwise_adagrad: rows) or exp_avg (adam, rows x dim),
// s2 = exp_avg_sq (adam, rows x dim), s3 = step (adam, rows).
struct State {
  float* s1 = nullptr;
  float* s2 = nullptr;
  float* s3 = nullptr;
};

// Values the optimizer takes from torch (ops.cpp computes them with the reference's own ATen
// calls, so they round exactly as there: torch's reductions, pow, and its float sqrt -- MKL's
// vsSqrt, which is not correctly rounded -- cannot be reproduced element by element).
// rowwise_adagrad: mean = the mean of each squared gradient row; root = sqrt of the new sum,
// correctly rounded (torch's float64 sqrt rounded to float32: its in-place kernel takes each
// row's root on its own, with the CPU's square root, rather than a vector of them from MKL).
// adagrad: root = sqrt of the new sum (rows x dim). adam: step = step size, bc2 = sqrt of the
// second bias correction (per row), root = sqrt of the new exp_avg_sq (rows x dim).
struct FromTorch {
  const float* mean = nullptr;
  const float* root = nullptr;
  const float* step = nullptr;
  const float* bc2 = nullptr;
  // step_inplace only: torch's float32 square root of n values for adagrad and adam (MKL's
  // vmsSqrt in the mode ATen calls it with, checked against at::sqrt once), and the lanes of
  // torch's vectorized row sum for rowwise_adagrad (8 or 16, whichever reproduces at::mean:
  // checked once per optimizer and dim).
  void (*sqrt)(int64_t n, const float* x, float* y) = nullptr;
  int sum_lanes = 0;
};

// Where step_inplace saves the rows it overwrites (position-indexed, n rows each, nullptr
// where the optimizer has no such state), so that a failed step can be undone.
struct Undo {
  void* w;  // n x dim elements of the table's dtype
  float* s1;
  float* s2;
  float* s3;
};

// What step_inplace did: rows [0, committed) written (the undo log holds their old values),
// how many rows' new weights are not finite and the first of them (-1: none).
struct StepResult {
  int64_t committed = 0;
  int64_t bad = 0;
  int64_t first_bad = -1;
};

// The per-instruction-set row kernels (one instance per ISA; see dispatch()). Each works on
// one table and a range of its ids, so ops.cpp can split a call over threads.
struct RowKernels {
  const char* isa;
  // Rows ids[0..n) of table t into out (n x t.dim elements of out_dtype). Ids already checked.
  void (*gather)(const Table& t, const int64_t* ids, int64_t n, void* out, DType out_dtype);
  // t[ids[k]] += alpha * grad[k] for k in order, as index_add_ does in float32 (one fused
  // multiply-add a row and element); a 16-bit table's rows are added up in float32 and rounded
  // once. Ids and gradients already checked.
  void (*sgd)(const Table& t, const int64_t* ids, int64_t n, const void* grad, DType grad_dtype,
              float alpha);
  // Plain SGD from the gradients of bags pooled where the rows are: for each of n distinct
  // checked ids, its gradient row summed from bag_grads rows bags[p] for p in [offsets[k],
  // offsets[k + 1]) (times scale[p] where scale is given) as pool sums a bag, then added as sgd
  // adds a gradient row. bag_grads: float32 rows of t.dim.
  void (*sgd_bags)(const Table& t, const int64_t* ids, int64_t n, const float* bag_grads,
                   const int32_t* bags, const int32_t* offsets, const float* scale, float alpha);
  // How many of those n gradient rows (d wide) hold a non-finite value; *first the first (-1:
  // none). Nothing is written.
  int64_t (*nonfinite_bags)(int64_t n, int64_t d, const float* bag_grads, const int32_t* bags,
                            const int32_t* offsets, const float* scale, int64_t* first);
  // The largest magnitude among n float32 values; +infinity if one is not finite.
  float (*max_abs)(const float* x, int64_t n);
  // Bags of rows pooled where the rows are (pool_on: server): bag b is rows[idx[p]] for p in
  // [offsets[b], offsets[b + 1]), each row dim elements of dtype, summed in order in float32
  // (weights: each row times weights[p], one fused multiply-add an element; mean: the sum
  // divided by the bag's length, an empty bag 0), rounded once into out (nbags x dim of
  // out_dtype). That is torch's embedding_bag over the gathered rows, bit for bit, without
  // the gathered copy. Indices already checked.
  void (*pool)(const void* const* rows, DType dtype, int64_t dim, const int32_t* idx,
               const int32_t* offsets, int64_t nbags, const float* weights, bool mean, void* out,
               DType out_dtype);
  // Distinct rows of n checked ids (ascending) and their gradients summed in arrival order,
  // times scale: rows_out, sum_out (n rows of d at most). Returns the number of rows.
  int64_t (*sum_rows)(int64_t n, const int64_t* ids, const void* grads, DType grad_dtype,
                      int64_t d, float scale, int64_t nrows, int64_t* rows_out, float* sum_out);
  // One optimizer step of n distinct checked rows of one table, in two passes around torch's
  // square roots; the table and its state are only read. state_step: the new state rows into
  // `out` (rowwise_adagrad takes t.mean). weight_step: the new weight rows into out_w, from
  // `out` and t.root (and t.step, t.bc2); returns how many rows hold a non-finite value,
  // *first_bad the first (-1: none).
  void (*state_step)(Optim kind, const Table& weight, const State& state, int64_t n,
                     const int64_t* rows, const void* grads, DType grad_dtype, float grad_scale,
                     const Hyper& h, const FromTorch& t, const State& out);
  int64_t (*weight_step)(Optim kind, const Table& weight, const State& out, int64_t n,
                         const int64_t* rows, const void* grads, DType grad_dtype,
                         float grad_scale, const Hyper& h, const FromTorch& t, float* out_w,
                         int64_t* first_bad);
  // One optimizer step of n distinct (ascending) checked rows of one table, written in place:
  // each row's weight and state read, updated and written in one visit (rows taken in chunks
  // of a few, so torch's square root runs over a chunk at a time). A row whose new weight is
  // not finite is not written (row-wise Adagrad: not beyond the window of rows it checks at
  // once), nor is any row after it once *stop is set (by this call or a sibling on another
  // thread; it sets *stop itself); every row's non-finite new weight is counted all the same.
  // The old values of every written row go to undo, so the caller can restore them.
  StepResult (*step_inplace)(Optim kind, const Table& weight, const State& state, int64_t n,
                             const int64_t* rows, const void* grads, DType grad_dtype,
                             float grad_scale, const Hyper& h, const FromTorch& t,
                             const Undo& undo, int* stop);
  // dst[rows[i]] = src[i] (width elements a row; src converted to dst's dtype). Rows already
  // checked.
  void (*scatter)(void* dst, DType dst_dtype, int64_t width, const int64_t* rows, int64_t n,
                  const void* src, DType src_dtype);
  // Row at[i] (i where at is nullptr) of out (dim elements of out_dtype a row) set to the
  // initial value of id ids[i] (hash.h: row_hash(ids[i], key), initial_value per column), for
  // i in [0, n): a vectorizable loop over the columns.
  void (*initial_rows)(void* out, DType out_dtype, int64_t dim, const int64_t* ids, const int64_t* at,
                       int64_t n, uint32_t key, float bound);
  // How many of nrows rows of x (d elements of dtype each) hold a non-finite value; *first =
  // the first (-1: none).
  int64_t (*nonfinite_rows)(const void* x, DType dtype, int64_t nrows, int64_t d, int64_t* first);
};

// The kernels for this CPU: AVX2+FMA where the CPU has them (x86-64), else the baseline build.
const RowKernels& dispatch();
extern const RowKernels base_kernels;
#if defined(__x86_64__)
extern const RowKernels avx2_kernels;
#endif

// -- instruction-set independent (route.cpp) ----------------------------------------------------

// How many rows ahead of the one it works on a one-pass row kernel (gather, SGD, row-wise
// Adagrad, scatter, initial rows, a dynamic table's lookup) requests rows from memory: about
// 4 KiB of rows, at least 4. Random rows come from DRAM, and only with that much in flight do
// their lines arrive before the loop reaches them (AMD EPYC, 128 MB table, rows of 32 floats:
// the gather took 11.8 ns a row requesting each row's first line 8 rows ahead, 7.9 requesting
// all its lines 32 rows ahead, no faster 64 ahead; SGD 16 ns and 7.8; rows of 16, 64 and 128
// floats alike).
inline int64_t rows_ahead(int64_t row_bytes) {
  constexpr int64_t kAheadBytes = 4096;
  return kAheadBytes / row_bytes > 4 ? kAheadBytes / row_bytes : 4;
}

constexpr int64_t kLine = 64;

// Every cache line of a row of `bytes` bytes at p (for reading).
inline void prefetch_row(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += kLine) __builtin_prefetch(c + off);
}

// Copies a row of `bytes` bytes: for the common row sizes a copy of known length, which the
// compiler makes a few vector moves; memcpy with a length known only at run time is a call a
// row (a gather of 128-byte rows: 7.9 ns a row with the call, 7.0 without).
inline void copy_row(void* out, const void* src, int64_t bytes) {
  switch (bytes) {
    case 64:
      std::memcpy(out, src, 64);
      break;
    case 128:
      std::memcpy(out, src, 128);
      break;
    case 256:
      std::memcpy(out, src, 256);
      break;
    default:
      std::memcpy(out, src, static_cast<size_t>(bytes));
  }
}

int bit_length(uint64_t x);

// Stable LSD radix sort of n keys by bits [lo, hi); tmp holds n scratch keys. The result is in a.
void radix_sort(uint64_t* a, uint64_t* tmp, int64_t n, int lo, int hi);

// The positions of n ids (each in [0, nrows)) grouped by id, in order within an id: keys[i] =
// (id << pos_bits) | position, ascending; keys holds 2n (the second half is scratch). Returns
// pos_bits.
int sort_by_row(const int64_t* ids, int64_t n, int64_t nrows, uint64_t* keys);

// First id outside its table, tables in order (chunk t of ids is counts[t] long).
Status first_bad_id(const Table* tables, int64_t ntab, const int64_t* counts, const int64_t* ids);

struct RouteIn {
  int64_t n;                  // ids
  const int64_t* ids;         // feature-major: feature f's bags, sample by sample
  int64_t nf, b;              // features, samples
  const int64_t* lengths;     // nf * b bag lengths, feature-major
  const int64_t* feat_table;  // table of each feature
  int64_t ntab;
  const int64_t* row_base;     // ntab + 1: each table's first row in one global row space
  const int64_t* shards;       // ntab: shards of each table (1: table-wise)
  const int64_t* server_rank;  // ntab x width: server of each shard
  int64_t width;
  int64_t nsrv;
  const float* weights;  // n per-id weights, or nullptr
  bool mean;             // grad_scale = 1 / len(bag) (whether or not there are weights)
  bool sample_major;     // bags ordered (sample, feature); else (feature, sample), ids in input order
  int64_t partitions;    // 0: ids are rows of their tables; > 0: raw ids (ids: dynamic), each sent
                         // as itself to the shard (fmix64(id) mod partitions) % shards, row_base unused
  bool backward = true;  // the backward's index (grad_*); false: not written (bags the servers pool)
};

struct RouteOut {
  int64_t* req;           // n (num_unique used): local rows (raw ids), server-major, table-minor, ascending
  int64_t* per;           // nsrv * ntab
  int64_t* raw;           // nsrv
  int64_t* idx;           // n
  int64_t* offsets;       // nf * b + 1
  float* weights;         // n, or nullptr
  int64_t* grad_bags;     // n (unused unless RouteIn::backward)
  int64_t* grad_offsets;  // n + 1 (num_unique + 1 used)
  float* grad_scale;      // n, or nullptr
};

// One batch's route (hybrid/ops/reference.py, route() and route_hashed()). Returns the number of distinct rows,
// or -1 with *status saying which id lies outside its table (nothing useful written then).
int64_t route(const RouteIn& in, const RouteOut& out, Status* status);

}  // namespace kernels
}  // namespace hybrid
