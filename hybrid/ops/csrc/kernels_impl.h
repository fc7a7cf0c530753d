// The row kernels' bodies, compiled once per instruction set: a kernels_<isa>.cpp defines
// HY_ISA (the namespace) and HY_KERNELS (the RowKernels instance), includes the standard and
// project headers, switches the target ISA on, and includes this file. Nothing here may
// include a header (an inline function compiled for AVX2 could otherwise be linked into code
// that runs on a CPU without it).
//
// Arithmetic is float32 and follows hybrid/ops/reference.py operation by operation: a fused
// multiply-add (__builtin_fmaf) exactly where torch's CPU kernels fuse one (add with alpha,
// addcmul, lerp), every other product and sum rounded on its own (the build passes
// -ffp-contract=off), so the results equal the reference's bit for bit.

namespace hybrid {
namespace kernels {
namespace HY_ISA {

// How far ahead the two-pass optimizer kernels and the chunks of the in-place ones request
// rows (their rows were read once already, or are requested into L2 a pass earlier).
constexpr int64_t kPrefetchAhead = 8;

// Every cache line of a row into the second-level cache only (for a later pass over the rows).
inline void prefetch_row_l2(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += kLine) __builtin_prefetch(c + off, 0, 2);
}

inline void prefetch_row_w(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += kLine) __builtin_prefetch(c + off, 1);
}

// out = lanes that are NaN where some of the n float32 values at x is infinite or NaN, +0
// elsewhere (x - x is +0 for a finite x, and a sum of such values is NaN exactly when one of
// them is): a subtraction and an addition per 8 values, no comparison, no branch; four
// accumulators over blocks of 32, so that a long scan is not one chain of additions. (Vectors
// go by reference: the baseline build has no 32-byte registers to pass them in.)
typedef float v8f __attribute__((vector_size(32)));
inline void nonfinite_lanes(const float* x, int64_t n, v8f& out) {
  v8f acc[4] = {};
  int64_t j = 0;
  for (; j + 32 <= n; j += 32)
    for (int k = 0; k < 4; k++) {
      v8f v;
      std::memcpy(&v, x + j + 8 * k, sizeof v);
      acc[k] += v - v;
    }
  for (; j + 8 <= n; j += 8) {
    v8f v;
    std::memcpy(&v, x + j, sizeof v);
    acc[0] += v - v;
  }
  for (; j < n; j++) acc[0][0] += x[j] - x[j];
  out = (acc[0] + acc[1]) + (acc[2] + acc[3]);
}

// Whether some lane of v is NaN.
inline bool any_nan(const v8f& v) {
  bool nan = false;
  for (int e = 0; e < 8; e++) nan |= v[e] != v[e];
  return nan;
}

// acc = a * b + acc lane by lane, each a fused multiply-add (one vector instruction where the
// ISA has it; by reference, as the baseline build has no 32-byte registers to pass vectors in).
inline void fma8(const v8f& a, const v8f& b, v8f& acc) {
  for (int l = 0; l < 8; l++) acc[l] = __builtin_fmaf(a[l], b[l], acc[l]);
}

// Whether every element of a float32 row is finite.
inline bool finite_row(const float* x, int64_t d) {
  v8f lanes;
  nonfinite_lanes(x, d, lanes);
  return !any_nan(lanes);
}

// Per-thread scratch that only grows: no allocation per call once warm.
template <typename T>
inline T* scratch(int64_t n) {
  static thread_local T* buf = nullptr;
  static thread_local int64_t cap = 0;
  if (n > cap) {
    delete[] buf;
    cap = n > 2 * cap ? n : 2 * cap;
    buf = new T[cap];
  }
  return buf;
}

// -- gather -----------------------------------------------------------------------------------

template <typename S, typename O>
void gather_t(const typename S::T* w, int64_t d, const int64_t* ids, int64_t n,
              typename O::T* out) {
  const int64_t bytes = d * static_cast<int64_t>(sizeof(typename S::T));
  const int64_t ahead = rows_ahead(bytes);
  for (int64_t k = 0; k < n && k < ahead; k++) prefetch_row(w + ids[k] * d, bytes);
  for (int64_t k = 0; k < n; k++) {
    if (k + ahead < n) prefetch_row(w + ids[k + ahead] * d, bytes);
    const typename S::T* src = w + ids[k] * d;
    if constexpr (S::dtype == O::dtype) {
      copy_row(out, src, bytes);
    } else {
      for (int64_t j = 0; j < d; j++) out[j] = O::store(S::load(src[j]));
    }
    out += d;
  }
}

void gather(const Table& t, const int64_t* ids, int64_t n, void* out, DType out_dtype) {
  with_dtype(t.dtype, [&](auto s) {
    using S = decltype(s);
    with_dtype(out_dtype, [&](auto od) {
      using O = decltype(od);
      gather_t<S, O>(static_cast<const typename S::T*>(t.data), t.dim, ids, n,
                     static_cast<typename O::T*>(out));
    });
  });
}

// Calls f with the row length as a compile-time constant for the common embedding widths
// (row-wise Adagrad, rows of 32 and 64 floats: 14.6 and 24 ns a row against 31 and 51 with the
// length read at run time, whose row loops check trip count and aliasing on every row; float32
// rows of any of these widths run their row loops in explicit vectors of 8), else with 0.
template <typename F>
inline auto with_dim(int64_t d, F&& f) {
  switch (d) {
    case 32:
      return f(std::integral_constant<int64_t, 32>{});
    case 64:
      return f(std::integral_constant<int64_t, 64>{});
    case 16:
      return f(std::integral_constant<int64_t, 16>{});
    case 128:
      return f(std::integral_constant<int64_t, 128>{});
    default:
      return f(std::integral_constant<int64_t, 0>{});
  }
}

// -- bags pooled from the rows where they are ---------------------------------------------------

// One bag at a time into a float32 accumulator of the row's length (kD: known at compile time,
// 0: dim, in per-thread scratch). Each id's row is requested rows_ahead ids before its turn.
template <typename S, typename O, int64_t kD>
void pool_t(const void* const* rows, int64_t dim, const int32_t* idx, const int32_t* offsets,
            int64_t nbags, const float* weights, bool mean, typename O::T* out) {
  using T = typename S::T;
  const int64_t d = kD > 0 ? kD : dim;
  const int64_t bytes = d * static_cast<int64_t>(sizeof(T));
  float fixed[kD > 0 ? kD : 1];
  float* acc = kD > 0 ? fixed : scratch<float>(d);
  const int64_t n = offsets[nbags] - offsets[0];
  const int32_t* ids = idx + offsets[0];
  const int64_t ahead = rows_ahead(bytes);
  for (int64_t p = 0; p < n && p < ahead; p++) prefetch_row(rows[ids[p]], bytes);
  for (int64_t b = 0; b < nbags; b++) {
    for (int64_t j = 0; j < d; j++) acc[j] = 0.0f;
    const int64_t lo = offsets[b] - offsets[0], hi = offsets[b + 1] - offsets[0];
    for (int64_t p = lo; p < hi; p++) {
      if (p + ahead < n) prefetch_row(rows[ids[p + ahead]], bytes);
      const T* r = static_cast<const T*>(rows[ids[p]]);
      if (weights != nullptr) {
        const float w = weights[offsets[0] + p];
        for (int64_t j = 0; j < d; j++) acc[j] = __builtin_fmaf(w, S::load(r[j]), acc[j]);
      } else {
        for (int64_t j = 0; j < d; j++) acc[j] += S::load(r[j]);
      }
    }
    if (mean && hi > lo) {
      const float len = static_cast<float>(hi - lo);
      for (int64_t j = 0; j < d; j++) acc[j] /= len;
    }
    for (int64_t j = 0; j < d; j++) out[j] = O::store(acc[j]);
    out += d;
  }
}

void pool(const void* const* rows, DType dtype, int64_t dim, const int32_t* idx, const int32_t* offsets,
          int64_t nbags, const float* weights, bool mean, void* out, DType out_dtype) {
  with_dtype(dtype, [&](auto s) {
    using S = decltype(s);
    with_dtype(out_dtype, [&](auto od) {
      using O = decltype(od);
      with_dim(dim, [&](auto kd) {
        pool_t<S, O, decltype(kd)::value>(rows, dim, idx, offsets, nbags, weights, mean,
                                          static_cast<typename O::T*>(out));
      });
    });
  });
}

// -- plain SGD, straight into the table -------------------------------------------------------

template <typename G>
void sgd_f32(float* w, int64_t d, const int64_t* ids, int64_t n, const typename G::T* g,
             float alpha) {
  const int64_t ahead = rows_ahead(d * 4);
  for (int64_t k = 0; k < n && k < ahead; k++) prefetch_row_w(w + ids[k] * d, d * 4);
  for (int64_t k = 0; k < n; k++) {
    if (k + ahead < n) prefetch_row_w(w + ids[k + ahead] * d, d * 4);
    float* wr = w + ids[k] * d;
    for (int64_t j = 0; j < d; j++) wr[j] = __builtin_fmaf(alpha, G::load(g[j]), wr[j]);
    g += d;
  }
}

// Row k's gradient summed from its bags into acc (d floats), as pool_t sums a bag from its rows:
// in order, one fused multiply-add an element where scale is given, else an addition.
inline void sum_bags_row(float* acc, int64_t d, int64_t k, const float* bag_grads, const int32_t* bags,
                         const int32_t* offsets, const float* scale) {
  for (int64_t j = 0; j < d; j++) acc[j] = 0.0f;
  for (int64_t p = offsets[k]; p < offsets[k + 1]; p++) {
    const float* g = bag_grads + static_cast<int64_t>(bags[p]) * d;
    if (scale != nullptr) {
      const float f = scale[p];
      for (int64_t j = 0; j < d; j++) acc[j] = __builtin_fmaf(f, g[j], acc[j]);
    } else {
      for (int64_t j = 0; j < d; j++) acc[j] += g[j];
    }
  }
}

// Plain SGD from the gradients of bags pooled on the server: row k's gradient is summed from
// its bags into a float32 accumulator exactly as pool_t sums a bag from its rows (in order, one
// fused multiply-add an element where scale is given, else an addition), which is torch's
// embedding_bag over the bags' gradients, bit for bit; then it is added as sgd adds a gradient
// row (sgd_f32; a 16-bit row loaded, added, rounded once, as sgd_rounded does for a row that
// comes once). The n ids are distinct. The weight rows are requested rows_ahead ids ahead.
template <typename S, int64_t kD>
void sgd_bags_t(typename S::T* w, int64_t dim, const int64_t* ids, int64_t n, const float* bag_grads,
                const int32_t* bags, const int32_t* offsets, const float* scale, float alpha) {
  using T = typename S::T;
  const int64_t d = kD > 0 ? kD : dim;
  const int64_t bytes = d * static_cast<int64_t>(sizeof(T));
  const int64_t ahead = rows_ahead(bytes);
  for (int64_t k = 0; k < n && k < ahead; k++) prefetch_row_w(w + ids[k] * d, bytes);
  if constexpr (kD > 0 && kD % 8 == 0 && S::dtype == DType::f32) {
    // Float32 rows of a known width: the accumulator in vectors of 8 (registers).
    constexpr int64_t V = kD / 8;
    const v8f alpha8 = v8f{} + alpha;
    for (int64_t k = 0; k < n; k++) {
      if (k + ahead < n) prefetch_row_w(w + ids[k + ahead] * d, bytes);
      v8f acc[V] = {};
      for (int64_t p = offsets[k]; p < offsets[k + 1]; p++) {
        const float* g = bag_grads + static_cast<int64_t>(bags[p]) * kD;
        if (scale != nullptr) {
          const v8f f8 = v8f{} + scale[p];
          for (int64_t q = 0; q < V; q++) {
            v8f g8;
            std::memcpy(&g8, g + 8 * q, sizeof g8);
            fma8(f8, g8, acc[q]);
          }
        } else {
          for (int64_t q = 0; q < V; q++) {
            v8f g8;
            std::memcpy(&g8, g + 8 * q, sizeof g8);
            acc[q] += g8;
          }
        }
      }
      float* wr = w + ids[k] * kD;
      for (int64_t q = 0; q < V; q++) {
        v8f w8;
        std::memcpy(&w8, wr + 8 * q, sizeof w8);
        fma8(alpha8, acc[q], w8);
        std::memcpy(wr + 8 * q, &w8, sizeof w8);
      }
    }
    return;
  }
  float* acc = scratch<float>(d);
  for (int64_t k = 0; k < n; k++) {
    if (k + ahead < n) prefetch_row_w(w + ids[k + ahead] * d, bytes);
    sum_bags_row(acc, d, k, bag_grads, bags, offsets, scale);
    T* wr = w + ids[k] * d;
    if constexpr (S::dtype == DType::f32) {
      for (int64_t j = 0; j < d; j++) wr[j] = __builtin_fmaf(alpha, acc[j], wr[j]);
    } else {
      for (int64_t j = 0; j < d; j++) wr[j] = S::store(__builtin_fmaf(alpha, acc[j], S::load(wr[j])));
    }
  }
}

void sgd_bags(const Table& t, const int64_t* ids, int64_t n, const float* bag_grads, const int32_t* bags,
              const int32_t* offsets, const float* scale, float alpha) {
  with_dtype(t.dtype, [&](auto s) {
    using S = decltype(s);
    with_dim(t.dim, [&](auto kd) {
      sgd_bags_t<S, decltype(kd)::value>(static_cast<typename S::T*>(t.data), t.dim, ids, n, bag_grads, bags,
                                         offsets, scale, alpha);
    });
  });
}

// How many of n rows' gradients summed from their bags (as sgd_bags sums them) hold a
// non-finite value; *first the first (-1: none). Nothing is written.
int64_t nonfinite_bags(int64_t n, int64_t d, const float* bag_grads, const int32_t* bags, const int32_t* offsets,
                       const float* scale, int64_t* first) {
  float* acc = scratch<float>(d);
  int64_t count = 0;
  *first = -1;
  for (int64_t k = 0; k < n; k++) {
    sum_bags_row(acc, d, k, bag_grads, bags, offsets, scale);
    if (!finite_row(acc, d) && count++ == 0) *first = k;
  }
  return count;
}

// A 16-bit table: each distinct row loaded to float32 once, its gradients added in arrival
// order, rounded once (the reference adds into a float32 copy of the table).
template <typename S, typename G>
void sgd_rounded(typename S::T* w, int64_t d, int64_t nrows, const int64_t* ids, int64_t n,
                 const typename G::T* g, float alpha) {
  if (n == 0) return;
  uint64_t* packed = scratch<uint64_t>(2 * n);
  const int pos_bits = sort_by_row(ids, n, nrows, packed);
  float* acc = scratch<float>(d);
  const uint64_t mask = (uint64_t{1} << pos_bits) - 1;
  for (int64_t i = 0; i < n;) {
    const uint64_t row = packed[i] >> pos_bits;
    typename S::T* wr = w + static_cast<int64_t>(row) * d;
    for (int64_t j = 0; j < d; j++) acc[j] = S::load(wr[j]);
    for (; i < n && (packed[i] >> pos_bits) == row; i++) {
      const typename G::T* gr = g + static_cast<int64_t>(packed[i] & mask) * d;
      for (int64_t j = 0; j < d; j++) acc[j] = __builtin_fmaf(alpha, G::load(gr[j]), acc[j]);
    }
    for (int64_t j = 0; j < d; j++) wr[j] = S::store(acc[j]);
  }
}

void sgd(const Table& t, const int64_t* ids, int64_t n, const void* grad, DType grad_dtype,
         float alpha) {
  with_dtype(t.dtype, [&](auto s) {
    using S = decltype(s);
    with_dtype(grad_dtype, [&](auto gd) {
      using G = decltype(gd);
      const auto* g = static_cast<const typename G::T*>(grad);
      if constexpr (S::dtype == DType::f32) {
        sgd_f32<G>(static_cast<float*>(t.data), t.dim, ids, n, g, alpha);
      } else {
        sgd_rounded<S, G>(static_cast<typename S::T*>(t.data), t.dim, t.rows, ids, n, g, alpha);
      }
    });
  });
}

// -- summing repeated rows --------------------------------------------------------------------

template <typename G>
int64_t sum_rows_t(int64_t n, const int64_t* ids, const typename G::T* grads, int64_t d,
                   float scale, int64_t nrows, int64_t* rows_out, float* sum_out) {
  if (n == 0) return 0;
  bool ascending = true;
  for (int64_t i = 1; i < n; i++) ascending &= ids[i] > ids[i - 1];
  int64_t nu = 0;
  if (ascending) {  // one trainer's deduplicated ids: already the answer's order
    for (int64_t i = 0; i < n; i++) {
      rows_out[i] = ids[i];
      const typename G::T* g = grads + i * d;
      float* s = sum_out + i * d;
      for (int64_t j = 0; j < d; j++) s[j] = 0.0f + G::load(g[j]);  // index_add_ into zeros
    }
    nu = n;
  } else {
    uint64_t* packed = scratch<uint64_t>(2 * n);
    const int pos_bits = sort_by_row(ids, n, nrows, packed);
    const uint64_t mask = (uint64_t{1} << pos_bits) - 1;
    int64_t u = -1;
    uint64_t prev = 0;
    for (int64_t i = 0; i < n; i++) {
      const uint64_t r = packed[i] >> pos_bits;
      const int64_t q = static_cast<int64_t>(packed[i] & mask);
      if (i + kPrefetchAhead < n)
        prefetch_row(grads + static_cast<int64_t>(packed[i + kPrefetchAhead] & mask) * d,
                     d * static_cast<int64_t>(sizeof(typename G::T)));
      const typename G::T* g = grads + q * d;
      if (i == 0 || r != prev) {
        u++;
        rows_out[u] = static_cast<int64_t>(r);
        float* s = sum_out + u * d;
        for (int64_t j = 0; j < d; j++) s[j] = 0.0f + G::load(g[j]);
        prev = r;
      } else {
        float* s = sum_out + u * d;
        for (int64_t j = 0; j < d; j++) s[j] += G::load(g[j]);
      }
    }
    nu = u + 1;
  }
  if (scale != 1.0f)
    for (int64_t i = 0; i < nu * d; i++) sum_out[i] *= scale;
  return nu;
}

int64_t sum_rows(int64_t n, const int64_t* ids, const void* grads, DType grad_dtype, int64_t d,
                 float scale, int64_t nrows, int64_t* rows_out, float* sum_out) {
  return with_dtype(grad_dtype, [&](auto gd) {
    using G = decltype(gd);
    return sum_rows_t<G>(n, ids, static_cast<const typename G::T*>(grads), d, scale, nrows,
                         rows_out, sum_out);
  });
}

// -- optimizers -------------------------------------------------------------------------------

// torch's lerp(start, end, weight) for float32: one fused multiply-add from the nearer end.
inline float lerp(float start, float end, float weight) {
  const float diff = end - start;
  return (weight < 0.5f && weight > -0.5f) ? __builtin_fmaf(weight, diff, start)
                                           : __builtin_fmaf(weight - 1.0f, diff, end);
}

// Weight row r as float32: the table's own memory, or converted into buf.
template <typename S>
inline const float* weight_row(const typename S::T* w, int64_t r, int64_t d, float* buf) {
  if constexpr (S::dtype == DType::f32) {
    return w + r * d;
  } else {
    const typename S::T* src = w + r * d;
    for (int64_t j = 0; j < d; j++) buf[j] = S::load(src[j]);
    return buf;
  }
}

// One gradient row as the reference sees it: (grad * grad_scale).add(w, alpha=weight_decay).
template <typename G>
inline void grad_row(const typename G::T* gr, const float* wr, int64_t d, float gscale,
                     const Hyper& h, float* out) {
  const bool decay = h.weight_decay != 0.0f;
  for (int64_t j = 0; j < d; j++) {
    float gj = G::load(gr[j]);
    if (gscale != 1.0f) gj *= gscale;
    if (decay) gj = __builtin_fmaf(h.weight_decay, wr[j], gj);
    out[j] = gj;
  }
}

// Prefetches what row r of an optimizer step reads: its weight row and its state rows.
template <typename S>
inline void prefetch_step(Optim kind, const typename S::T* w, const State& st, int64_t r,
                          int64_t d) {
  prefetch_row(w + r * d, d * static_cast<int64_t>(sizeof(typename S::T)));
  if (kind == Optim::rowwise_adagrad) {
    __builtin_prefetch(st.s1 + r);
  } else if (kind != Optim::sgd) {
    prefetch_row(st.s1 + r * d, d * 4);
    if (kind == Optim::adam) {
      prefetch_row(st.s2 + r * d, d * 4);
      __builtin_prefetch(st.s3 + r);
    }
  }
}

// reference.optimizer_rows up to the square roots: the new state rows.
template <typename S, typename G>
void state_step_t(Optim kind, const Table& weight, const State& st, int64_t n,
                  const int64_t* rows, const typename G::T* grads, float gscale, const Hyper& h,
                  const FromTorch& t, const State& out) {
  const int64_t d = weight.dim;
  const typename S::T* w = static_cast<const typename S::T*>(weight.data);
  const bool needs_w = h.weight_decay != 0.0f;
  float* gbuf = scratch<float>(2 * d);
  float* wbuf = gbuf + d;
  for (int64_t i = 0; i < n; i++) {
    const int64_t r = rows[i];
    if (i + kPrefetchAhead < n) prefetch_step<S>(kind, w, st, rows[i + kPrefetchAhead], d);
    if (kind == Optim::rowwise_adagrad) {  // sum + grad.pow(2).mean(dim=1)
      out.s1[i] = st.s1[r] + t.mean[i];
      continue;
    }
    const float* wr = needs_w ? weight_row<S>(w, r, d, wbuf) : nullptr;
    grad_row<G>(grads + i * d, wr, d, gscale, h, gbuf);
    if (kind == Optim::adagrad) {  // sum.addcmul(grad, grad)
      const float* ar = st.s1 + r * d;
      float* oa = out.s1 + i * d;
      for (int64_t j = 0; j < d; j++) oa[j] = __builtin_fmaf(gbuf[j], gbuf[j], ar[j]);
    } else if (kind == Optim::adam) {
      out.s3[i] = st.s3[r] + 1.0f;
      const float* mr = st.s1 + r * d;
      const float* vr = st.s2 + r * d;
      float* om = out.s1 + i * d;
      float* ov = out.s2 + i * d;
      for (int64_t j = 0; j < d; j++) {
        om[j] = lerp(mr[j], gbuf[j], h.beta1_weight);  // exp_avg.lerp(grad, 1 - beta1)
        // exp_avg_sq.mul(beta2).addcmul(grad, grad, value=1 - beta2)
        ov[j] = __builtin_fmaf(h.beta2_weight * gbuf[j], gbuf[j], vr[j] * h.beta2);
      }
    }
  }
}

// reference.optimizer_rows from the square roots on: the new weight rows.
template <typename S, typename G>
int64_t weight_step_t(Optim kind, const Table& weight, const State& out, int64_t n,
                      const int64_t* rows, const typename G::T* grads, float gscale,
                      const Hyper& h, const FromTorch& t, float* out_w, int64_t* first_bad) {
  const int64_t d = weight.dim;
  const typename S::T* w = static_cast<const typename S::T*>(weight.data);
  const float neg_lr = -h.lr;
  float* gbuf = scratch<float>(2 * d);
  float* wbuf = gbuf + d;
  int64_t bad_rows = 0;
  *first_bad = -1;
  for (int64_t i = 0; i < n; i++) {
    if (i + kPrefetchAhead < n)
      prefetch_row(w + rows[i + kPrefetchAhead] * d, d * static_cast<int64_t>(sizeof(typename S::T)));
    const float* wr = weight_row<S>(w, rows[i], d, wbuf);
    float* ow = out_w + i * d;
    if (kind == Optim::adam) {  // w - step_size * (exp_avg / (sqrt(exp_avg_sq) / bc2).add(eps))
      const float* m = out.s1 + i * d;
      const float* root = t.root + i * d;
      for (int64_t j = 0; j < d; j++)
        ow[j] = wr[j] - t.step[i] * (m[j] / (root[j] / t.bc2[i] + h.eps));
    } else {
      grad_row<G>(grads + i * d, wr, d, gscale, h, gbuf);
      if (kind == Optim::sgd) {  // w.add(grad, alpha=-lr)
        for (int64_t j = 0; j < d; j++) ow[j] = __builtin_fmaf(neg_lr, gbuf[j], wr[j]);
      } else if (kind == Optim::adagrad) {  // w.addcdiv(grad, sqrt(sum).add(eps), value=-lr)
        const float* root = t.root + i * d;
        for (int64_t j = 0; j < d; j++) ow[j] = wr[j] + (neg_lr * gbuf[j]) / (root[j] + h.eps);
      } else {  // rowwise_adagrad: the same with one denominator a row
        const float denom = t.root[i] + h.eps;
        for (int64_t j = 0; j < d; j++) ow[j] = wr[j] + (neg_lr * gbuf[j]) / denom;
      }
    }
    if (!finite_row(ow, d) && bad_rows++ == 0) *first_bad = i;
  }
  return bad_rows;
}

void state_step(Optim kind, const Table& weight, const State& state, int64_t n,
                const int64_t* rows, const void* grads, DType grad_dtype, float grad_scale,
                const Hyper& h, const FromTorch& t, const State& out) {
  with_dtype(weight.dtype, [&](auto s) {
    using S = decltype(s);
    with_dtype(grad_dtype, [&](auto gd) {
      using G = decltype(gd);
      state_step_t<S, G>(kind, weight, state, n, rows, static_cast<const typename G::T*>(grads),
                         grad_scale, h, t, out);
    });
  });
}

int64_t weight_step(Optim kind, const Table& weight, const State& out, int64_t n,
                    const int64_t* rows, const void* grads, DType grad_dtype, float grad_scale,
                    const Hyper& h, const FromTorch& t, float* out_w, int64_t* first_bad) {
  return with_dtype(weight.dtype, [&](auto s) {
    using S = decltype(s);
    return with_dtype(grad_dtype, [&](auto gd) {
      using G = decltype(gd);
      return weight_step_t<S, G>(kind, weight, out, n, rows,
                                 static_cast<const typename G::T*>(grads), grad_scale, h, t,
                                 out_w, first_bad);
    });
  });
}

// -- one-pass optimizer step, in place ----------------------------------------------------------

// The two parts of torch's float32 sum of one contiguous row of d elements (ATen's
// vectorized_inner_sum for a reduction over the last dimension, vectors of L elements): the
// vector part in vacc (L lanes: four interleaved vector accumulators with its cascade levels,
// combined) and the scalar tail's sum in *tail. Inlined: as a call it took about a fifth of
// row-wise Adagrad's step.
template <int L>
__attribute__((always_inline)) inline void torch_row_sum_parts(const float* x, int64_t d, float* vacc,
                                                               float* tail) {
  constexpr int kIlp = 4, kLevels = 4;
  const int64_t nvec = d / L;
  const int64_t size = nvec / kIlp;  // rows of kIlp vectors
  float t = 0.0f;
  for (int64_t k = nvec * L; k < d; k++) t += x[k];
  *tail = t;
  if (size == 0) {  // fewer than kIlp vectors: the other accumulators stay +0, adding them is exact
    float v[L];
    for (int e = 0; e < L; e++) v[e] = 0.0f;
    for (int64_t q = 0; q < nvec; q++)
      for (int e = 0; e < L; e++) v[e] += x[q * L + e];
    for (int e = 0; e < L; e++) vacc[e] = v[e];
    return;
  }
  if (size < 16) {  // below the first cascade level: the upper levels stay +0 (exact to add)
    float a0[kIlp][L];
    for (int k = 0; k < kIlp; k++)
      for (int e = 0; e < L; e++) a0[k][e] = 0.0f;
    for (int64_t i = 0; i < size; i++)
      for (int k = 0; k < kIlp; k++)
        for (int e = 0; e < L; e++) a0[k][e] += x[(i * kIlp + k) * L + e];
    for (int64_t v = size * kIlp; v < nvec; v++)
      for (int e = 0; e < L; e++) a0[0][e] += x[v * L + e];
    for (int k = 1; k < kIlp; k++)
      for (int e = 0; e < L; e++) a0[0][e] += a0[k][e];
    for (int e = 0; e < L; e++) vacc[e] = a0[0][e];
    return;
  }
  float acc[kLevels][kIlp][L] = {};
  int64_t ceil_log2 = 0;
  while ((int64_t{1} << ceil_log2) < size) ceil_log2++;
  const int64_t level_power = ceil_log2 / kLevels > 4 ? ceil_log2 / kLevels : 4;
  const int64_t level_step = int64_t{1} << level_power, level_mask = level_step - 1;
  int64_t i = 0;
  for (; i + level_step <= size;) {
    for (int64_t j = 0; j < level_step; ++j, ++i)
      for (int k = 0; k < kIlp; k++) {
        const float* v = x + (i * kIlp + k) * L;
        for (int e = 0; e < L; e++) acc[0][k][e] += v[e];
      }
    for (int l = 1; l < kLevels; l++) {
      for (int k = 0; k < kIlp; k++)
        for (int e = 0; e < L; e++) {
          acc[l][k][e] += acc[l - 1][k][e];
          acc[l - 1][k][e] = 0.0f;
        }
      if ((i & (level_mask << (l * level_power))) != 0) break;
    }
  }
  for (; i < size; ++i)
    for (int k = 0; k < kIlp; k++) {
      const float* v = x + (i * kIlp + k) * L;
      for (int e = 0; e < L; e++) acc[0][k][e] += v[e];
    }
  for (int l = 1; l < kLevels; l++)
    for (int k = 0; k < kIlp; k++)
      for (int e = 0; e < L; e++) acc[0][k][e] += acc[l][k][e];
  // row_sum: the vectors after the last whole group of kIlp into the first accumulator, then
  // the accumulators into the first
  for (int64_t v = size * kIlp; v < nvec; v++)
    for (int e = 0; e < L; e++) acc[0][0][e] += x[v * L + e];
  for (int k = 1; k < kIlp; k++)
    for (int e = 0; e < L; e++) acc[0][0][e] += acc[0][k][e];
  for (int e = 0; e < L; e++) vacc[e] = acc[0][0][e];
}

// torch's float32 sum of one contiguous row of d elements, with vectors of `lanes` (8 or 16)
// elements: the tail first, then the lanes in order.
__attribute__((always_inline)) inline float torch_row_sum(const float* x, int64_t d, int lanes) {
  float vacc[16], sum;
  if (lanes == 16)
    torch_row_sum_parts<16>(x, d, vacc, &sum);
  else
    torch_row_sum_parts<8>(x, d, vacc, &sum);
  for (int e = 0; e < lanes; e++) sum += vacc[e];
  return sum;
}

// Prefetches the state rows of row r of an in-place step: into L1 (locality 3) or into L2
// only (locality 2).
template <int locality>
inline void prefetch_state(Optim kind, const State& st, int64_t r, int64_t d) {
  if (kind == Optim::rowwise_adagrad) {
    __builtin_prefetch(st.s1 + r, 0, locality);
  } else if (kind != Optim::sgd) {
    for (int64_t off = 0; off < d * 4; off += kLine) {
      __builtin_prefetch(reinterpret_cast<const char*>(st.s1 + r * d) + off, 0, locality);
      if (kind == Optim::adam)
        __builtin_prefetch(reinterpret_cast<const char*>(st.s2 + r * d) + off, 0, locality);
    }
    if (kind == Optim::adam) __builtin_prefetch(st.s3 + r, 0, locality);
  }
}

// Rows computed together around one square-root call (MKL's vmsSqrt: about 25 ns a call plus
// 0.1 ns a value); 512 rows of state and weights (and the chunk's buffers) stay in L2, and
// shorter chunks measured slower (64 rows: 12%), the weight rows then reaching L1 too late.
constexpr int64_t kStepChunk = 512;
// How far ahead the copy of a chunk's state requests a row's state: the loop only copies, so
// the loads of many rows overlap (a distance like the gather's keeps enough in flight).
constexpr int64_t kStateAhead = 16;
// How far ahead the state pass requests the weight rows the weight pass reads: its rows cost
// little compute each, so 8 rows ahead left the loads waiting for memory.
constexpr int64_t kWeightAhead = 32;

// Whether an in-place step may write row p's new weight ow: not when it is not finite (counted
// in res, and every thread of the step told to stop writing), nor once this thread or another
// found such a row.
inline bool may_write(const float* ow, int64_t d, int64_t p, StepResult& res, bool& writing,
                      int* stop) {
  if (!finite_row(ow, d)) {
    if (res.bad++ == 0) res.first_bad = p;
    __atomic_store_n(stop, 1, __ATOMIC_RELAXED);
    writing = false;
    return false;
  }
  if (!writing) return false;
  if (__atomic_load_n(stop, __ATOMIC_RELAXED) != 0) {
    writing = false;
    return false;
  }
  return true;
}

// Adagrad, Adam and SGD with weight decay: each chunk of rows in three passes: (1) the rows'
// state copied from the table into the undo log, a tight loop of copies whose loads the core
// overlaps as in the gather (interleaved with the arithmetic, each row's state load waited for
// memory on AMD EPYC, whatever the prefetch distance); (2) the new state computed from the log
// while the chunk's weight rows and the next chunk's state are requested into L2, then its
// square roots in one call; (3) the new weights computed, and written with the new state a row
// at a time (old weights into the undo log first), unless a step failed.
template <typename S, typename G>
StepResult step_inplace_t(Optim kind, const Table& weight, const State& st, int64_t n,
                          const int64_t* rows, const typename G::T* grads, float gscale,
                          const Hyper& h, const FromTorch& t, const Undo& undo, int* stop) {
  using T = typename S::T;
  const int64_t d = weight.dim;
  T* w = static_cast<T*>(weight.data);
  T* undo_w = static_cast<T*>(undo.w);
  const int64_t wbytes = d * static_cast<int64_t>(sizeof(T));
  const size_t sbytes = static_cast<size_t>(d) * 4;
  const bool needs_w = h.weight_decay != 0.0f;
  const float neg_lr = -h.lr;
  constexpr int64_t C = kStepChunk;
  // per chunk: gradients as the update sees them, new state (a, b), square roots
  float* g = scratch<float>(4 * C * d + 2 * d);
  float* a = g + C * d;
  float* b = a + C * d;
  float* root = b + C * d;
  float* wbuf = root + C * d;
  float* ow = wbuf + d;
  StepResult res;
  bool writing = __atomic_load_n(stop, __ATOMIC_RELAXED) == 0;
  for (int64_t i = 0; i < n && i < kStateAhead; i++) prefetch_state<3>(kind, st, rows[i], d);
  for (int64_t c0 = 0; c0 < n; c0 += C) {
    const int64_t m = n - c0 < C ? n - c0 : C;
    for (int64_t p = c0; p < c0 + m; p++) {  // (1) old state into the undo log
      const int64_t r = rows[p];
      if (p + kStateAhead < n) prefetch_state<3>(kind, st, rows[p + kStateAhead], d);
      if (kind == Optim::adagrad) {
        std::memcpy(undo.s1 + p * d, st.s1 + r * d, sbytes);
      } else if (kind == Optim::adam) {
        std::memcpy(undo.s1 + p * d, st.s1 + r * d, sbytes);
        std::memcpy(undo.s2 + p * d, st.s2 + r * d, sbytes);
        undo.s3[p] = st.s3[r];
      }
    }
    for (int64_t i = 0; i < m; i++) {  // (2) new state rows of the chunk
      const int64_t p = c0 + i;
      if (i + kWeightAhead < m) prefetch_row_l2(w + rows[p + kWeightAhead] * d, wbytes);
      if (p + m < n) prefetch_state<2>(kind, st, rows[p + m], d);
      const float* wr = needs_w ? weight_row<S>(w, rows[p], d, wbuf) : nullptr;
      float* gi = g + i * d;
      grad_row<G>(grads + p * d, wr, d, gscale, h, gi);
      if (kind == Optim::adagrad) {
        const float* ar = undo.s1 + p * d;
        float* oa = a + i * d;
        for (int64_t j = 0; j < d; j++) oa[j] = __builtin_fmaf(gi[j], gi[j], ar[j]);
      } else if (kind == Optim::adam) {
        const float* mr = undo.s1 + p * d;
        const float* vr = undo.s2 + p * d;
        float* om = a + i * d;
        float* ov = b + i * d;
        for (int64_t j = 0; j < d; j++) {
          om[j] = lerp(mr[j], gi[j], h.beta1_weight);
          ov[j] = __builtin_fmaf(h.beta2_weight * gi[j], gi[j], vr[j] * h.beta2);
        }
      }
    }
    if (kind == Optim::adagrad) {
      t.sqrt(m * d, a, root);
    } else if (kind == Optim::adam) {
      t.sqrt(m * d, b, root);
    }
    // (3) new weight rows, written with the new state unless a step failed. The state pass
    // brought the chunk's weight rows into L2 (most would be gone from L1 by now); each is
    // requested for writing a few rows ahead.
    for (int64_t i = 0; i < m && i < kPrefetchAhead; i++) prefetch_row_w(w + rows[c0 + i] * d, wbytes);
    for (int64_t i = 0; i < m; i++) {
      const int64_t p = c0 + i, r = rows[p];
      if (i + kPrefetchAhead < m) prefetch_row_w(w + rows[p + kPrefetchAhead] * d, wbytes);
      const float* wr = weight_row<S>(w, r, d, wbuf);
      const float* gi = g + i * d;
      if (kind == Optim::adam) {
        const float* m1 = a + i * d;
        const float* rt = root + i * d;
        for (int64_t j = 0; j < d; j++)
          ow[j] = wr[j] - t.step[p] * (m1[j] / (rt[j] / t.bc2[p] + h.eps));
      } else if (kind == Optim::sgd) {
        for (int64_t j = 0; j < d; j++) ow[j] = __builtin_fmaf(neg_lr, gi[j], wr[j]);
      } else {  // adagrad
        const float* rt = root + i * d;
        for (int64_t j = 0; j < d; j++) ow[j] = wr[j] + (neg_lr * gi[j]) / (rt[j] + h.eps);
      }
      if (!may_write(ow, d, p, res, writing, stop)) continue;
      T* wd = w + r * d;
      std::memcpy(undo_w + p * d, wd, static_cast<size_t>(wbytes));
      for (int64_t j = 0; j < d; j++) wd[j] = S::store(ow[j]);
      if (kind == Optim::adagrad) {
        std::memcpy(st.s1 + r * d, a + i * d, sbytes);
      } else if (kind == Optim::adam) {
        std::memcpy(st.s1 + r * d, a + i * d, sbytes);
        std::memcpy(st.s2 + r * d, b + i * d, sbytes);
        st.s3[r] = undo.s3[p] + 1.0f;
      }
      res.committed = p + 1;
    }
  }
  return res;
}

// Rows row-wise Adagrad writes before it checks that their new weights were finite.
constexpr int64_t kRowwiseCheckRows = 16;

// Row-wise Adagrad in one pass over the rows: each row's state, new state, square root (the
// correctly rounded one, as the reference's float64 root rounded to float32) and new weight
// in turn, the old weight and state into the undo log before the row is written. Its scalar
// root needs no batch of square roots, so no chunk has to be read twice. Whether the new
// weights are finite is checked once per kRowwiseCheckRows rows written (a check and a branch
// per row cost a quarter of the loop): a window holding a non-finite row is still committed,
// for the caller to restore, and the rows after it are only counted. kD: the row length when
// known at compile time (0: weight.dim).
template <typename S, typename G, int64_t kD>
StepResult step_rowwise_t(const Table& weight, const State& st, int64_t n, const int64_t* rows,
                          const typename G::T* grads, float gscale, const Hyper& h,
                          const FromTorch& t, const Undo& undo, int* stop) {
  using T = typename S::T;
  const int64_t d = kD > 0 ? kD : weight.dim;
  // float32 rows of a known multiple of 8 floats: the row loops in vectors of 8 (left to the
  // compiler, rows of 16 and 128 floats became scalar code)
  constexpr int64_t kVectors = S::dtype == DType::f32 && kD % 8 == 0 ? kD / 8 : 0;
  T* w = static_cast<T*>(weight.data);
  T* undo_w = static_cast<T*>(undo.w);
  const int64_t wbytes = d * static_cast<int64_t>(sizeof(T));
  const int64_t ahead = rows_ahead(wbytes);
  const bool needs_w = h.weight_decay != 0.0f;
  const float neg_lr = -h.lr;
  const int lanes = t.sum_lanes > 0 ? t.sum_lanes : 1;
  float* gi = scratch<float>(4 * d);  // the row's gradient as the update sees it, its squares,
  float* sq = gi + d;                 // the row as float32 (16-bit tables), its new value
  float* wbuf = sq + d;
  float* ow = wbuf + d;
  StepResult res;
  bool writing = __atomic_load_n(stop, __ATOMIC_RELAXED) == 0;
  v8f window[kRowwiseCheckRows];  // nonfinite_lanes of each new weight row the window wrote
  int64_t w0 = 0;                 // the window's first row
  for (int64_t i = 0; i < n && i < ahead; i++) {
    prefetch_row_w(w + rows[i] * d, wbytes);
    __builtin_prefetch(st.s1 + rows[i], 1);
  }
  for (int64_t p = 0; p < n; p++) {
    const int64_t r = rows[p];
    if (p + ahead < n) {
      prefetch_row_w(w + rows[p + ahead] * d, wbytes);
      __builtin_prefetch(st.s1 + rows[p + ahead], 1);
    }
    const float* wr = weight_row<S>(w, r, d, wbuf);
    grad_row<G>(grads + p * d, needs_w ? wr : nullptr, d, gscale, h, gi);
    // sum + grad.pow(2).mean(dim=1), in torch's order. (ivdep on the row loops: the scratch
    // rows, the gradient and the table row never overlap, and without it each loop would first
    // test that they do not: about 10% of the step at every row length measured.)
    if constexpr (kVectors > 0) {
      for (int64_t q = 0; q < kVectors; q++) {
        v8f g8;
        std::memcpy(&g8, gi + 8 * q, sizeof g8);
        g8 *= g8;
        std::memcpy(sq + 8 * q, &g8, sizeof g8);
      }
    } else {
#pragma GCC ivdep
      for (int64_t j = 0; j < d; j++) sq[j] = gi[j] * gi[j];
    }
    const float old = st.s1[r];
    const float a = old + torch_row_sum(sq, d, lanes) / static_cast<float>(d);
    const float denom = std::sqrt(a) + h.eps;
    if constexpr (kVectors > 0) {
      const v8f lr8 = v8f{} + neg_lr, denom8 = v8f{} + denom;
      for (int64_t q = 0; q < kVectors; q++) {
        v8f g8, w8;
        std::memcpy(&g8, gi + 8 * q, sizeof g8);
        std::memcpy(&w8, wr + 8 * q, sizeof w8);
        w8 += (lr8 * g8) / denom8;
        std::memcpy(ow + 8 * q, &w8, sizeof w8);
      }
    } else {
#pragma GCC ivdep
      for (int64_t j = 0; j < d; j++) ow[j] = wr[j] + (neg_lr * gi[j]) / denom;
    }
    if (!writing) {  // count the non-finite rows
      may_write(ow, d, p, res, writing, stop);
      continue;
    }
    nonfinite_lanes(ow, d, window[p - w0]);
    T* wd = w + r * d;
    if constexpr (kVectors > 0) {
      for (int64_t q = 0; q < kVectors; q++) {
        v8f o8, n8;
        std::memcpy(&o8, wd + 8 * q, sizeof o8);
        std::memcpy(&n8, ow + 8 * q, sizeof n8);
        std::memcpy(undo_w + p * d + 8 * q, &o8, sizeof o8);
        std::memcpy(wd + 8 * q, &n8, sizeof n8);
      }
    } else {
      std::memcpy(undo_w + p * d, wd, static_cast<size_t>(wbytes));
#pragma GCC ivdep
      for (int64_t j = 0; j < d; j++) wd[j] = S::store(ow[j]);
    }
    undo.s1[p] = old;
    st.s1[r] = a;
    res.committed = p + 1;
    if (p + 1 - w0 == kRowwiseCheckRows || p + 1 == n) {
      v8f all = window[0];
      for (int64_t k = 1; k <= p - w0; k++) all += window[k];
      if (any_nan(all)) {
        for (int64_t k = 0; k <= p - w0; k++)
          if (any_nan(window[k]) && res.bad++ == 0) res.first_bad = w0 + k;
        __atomic_store_n(stop, 1, __ATOMIC_RELAXED);
        writing = false;
      } else if (__atomic_load_n(stop, __ATOMIC_RELAXED) != 0) {
        writing = false;
      }
      w0 = p + 1;
    }
  }
  return res;
}

StepResult step_inplace(Optim kind, const Table& weight, const State& state, int64_t n,
                        const int64_t* rows, const void* grads, DType grad_dtype, float grad_scale,
                        const Hyper& h, const FromTorch& t, const Undo& undo, int* stop) {
  return with_dtype(weight.dtype, [&](auto s) {
    using S = decltype(s);
    return with_dtype(grad_dtype, [&](auto gd) {
      using G = decltype(gd);
      const auto* g = static_cast<const typename G::T*>(grads);
      if (kind == Optim::rowwise_adagrad)
        return with_dim(weight.dim, [&](auto dim) {
          return step_rowwise_t<S, G, decltype(dim)::value>(weight, state, n, rows, g, grad_scale,
                                                           h, t, undo, stop);
        });
      return step_inplace_t<S, G>(kind, weight, state, n, rows, g, grad_scale, h, t, undo, stop);
    });
  });
}

// -- writing rows back ------------------------------------------------------------------------

template <typename D, typename Src>
void scatter_t(typename D::T* dst, int64_t width, const int64_t* rows, int64_t n,
               const typename Src::T* src) {
  const int64_t bytes = width * static_cast<int64_t>(sizeof(typename D::T));
  const int64_t ahead = rows_ahead(bytes);
  for (int64_t i = 0; i < n && i < ahead; i++) prefetch_row_w(dst + rows[i] * width, bytes);
  for (int64_t i = 0; i < n; i++) {
    if (i + ahead < n) prefetch_row_w(dst + rows[i + ahead] * width, bytes);
    typename D::T* o = dst + rows[i] * width;
    const typename Src::T* s = src + i * width;
    if constexpr (D::dtype == Src::dtype) {
      copy_row(o, s, bytes);
    } else {
      for (int64_t j = 0; j < width; j++) o[j] = D::store(Src::load(s[j]));
    }
  }
}

void scatter(void* dst, DType dst_dtype, int64_t width, const int64_t* rows, int64_t n,
             const void* src, DType src_dtype) {
  with_dtype(dst_dtype, [&](auto dd) {
    using D = decltype(dd);
    with_dtype(src_dtype, [&](auto sd) {
      using Src = decltype(sd);
      scatter_t<D, Src>(static_cast<typename D::T*>(dst), width, rows, n,
                        static_cast<const typename Src::T*>(src));
    });
  });
}

template <typename D>
void initial_rows_t(typename D::T* out, int64_t dim, const int64_t* ids, const int64_t* at, int64_t n,
                    uint32_t key, float bound) {
  const int64_t bytes = dim * static_cast<int64_t>(sizeof(typename D::T));
  const int64_t ahead = rows_ahead(bytes);
  for (int64_t i = 0; at && i < n && i < ahead; i++) prefetch_row_w(out + at[i] * dim, bytes);
  for (int64_t i = 0; i < n; i++) {
    if (at && i + ahead < n) prefetch_row_w(out + at[i + ahead] * dim, bytes);
    typename D::T* o = out + (at ? at[i] : i) * dim;
    const uint32_t h = hash::row_hash(static_cast<uint64_t>(ids[i]), key);
    for (int64_t c = 0; c < dim; c++) o[c] = D::store(hash::initial_value(h, c, bound));
  }
}

void initial_rows(void* out, DType out_dtype, int64_t dim, const int64_t* ids, const int64_t* at, int64_t n,
                  uint32_t key, float bound) {
  with_dtype(out_dtype, [&](auto d) {
    using D = decltype(d);
    initial_rows_t<D>(static_cast<typename D::T*>(out), dim, ids, at, n, key, bound);
  });
}

// -- checks -----------------------------------------------------------------------------------

// Whether every one of the n values at x is finite: float32 through finite_row, 16-bit values by
// their exponent bits; branch-free either way.
template <typename S>
inline bool finite_values(const typename S::T* x, int64_t n) {
  if constexpr (S::dtype == DType::f32) {
    return finite_row(x, n);
  } else {
    uint32_t bad = 0;
    for (int64_t i = 0; i < n; i++) bad |= S::finite(x[i]) ? 0u : 1u;
    return bad == 0;
  }
}

// The largest magnitude among n float32 values, or +infinity if one of them is not finite.
float max_abs(const float* x, int64_t n) {
  if (!finite_row(x, n)) return __builtin_inff();
  v8f most = {};
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    v8f v;
    std::memcpy(&v, x + j, sizeof v);
    v = v < 0 ? -v : v;
    most = v > most ? v : most;
  }
  float m = 0.0f;
  for (int i = 0; i < 8; i++) m = most[i] > m ? most[i] : m;
  for (; j < n; j++) {
    const float v = x[j] < 0 ? -x[j] : x[j];
    m = v > m ? v : m;
  }
  return m;
}

// Rows of a gradient with a non-finite value: one scan of the whole buffer, and only when it
// finds something, a scan row by row to count them.
template <typename S>
int64_t nonfinite_rows_t(const typename S::T* x, int64_t nrows, int64_t d, int64_t* first) {
  *first = -1;
  if (finite_values<S>(x, nrows * d)) return 0;
  int64_t count = 0;
  for (int64_t r = 0; r < nrows; r++)
    if (!finite_values<S>(x + r * d, d) && count++ == 0) *first = r;
  return count;
}

int64_t nonfinite_rows(const void* x, DType dtype, int64_t nrows, int64_t d, int64_t* first) {
  return with_dtype(dtype, [&](auto s) {
    using S = decltype(s);
    return nonfinite_rows_t<S>(static_cast<const typename S::T*>(x), nrows, d, first);
  });
}

}  // namespace HY_ISA

const RowKernels HY_KERNELS = {
    HY_ISA_NAME,         HY_ISA::gather,      HY_ISA::sgd,          HY_ISA::sgd_bags,     HY_ISA::nonfinite_bags,
    HY_ISA::max_abs,     HY_ISA::pool,         HY_ISA::sum_rows,
    HY_ISA::state_step, HY_ISA::weight_step, HY_ISA::step_inplace, HY_ISA::scatter,
    HY_ISA::initial_rows, HY_ISA::nonfinite_rows,
};

}  // namespace kernels
}  // namespace hybrid
