// initial_rows_: the layout-independent initial value of table rows (hybrid/ps/init.py), filled
// in place. Element (row, col) is a 32-bit hash of (key, row, col) -- the lowbias32 finalizer
// chained over the row's two 32-bit halves, then the column -- whose top 24 bits give a uniform
// float in [-1, 1), times the table's bound: exactly what hybrid.ops.reference.initial_rows_
// computes with torch's integer and float32 arithmetic, bit for bit, and rounded into a 16-bit
// table as torch's .to() rounds.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#include "convert.h"
#include "hash.h"

namespace {

using at::Tensor;
namespace k = hybrid::kernels;

template <typename Store>
void fill(int64_t begin, int64_t end, const int64_t* rows, int64_t dim, uint32_t key, float bound,
          Store store) {
  for (int64_t i = begin; i < end; i++) {
    const uint32_t h = hybrid::hash::row_hash(static_cast<uint64_t>(rows[i]), key);
    for (int64_t c = 0; c < dim; c++) store(i * dim + c, hybrid::hash::initial_value(h, c, bound));
  }
}

void initial_rows_(const Tensor& out, const Tensor& rows, int64_t key, double bound) {
  TORCH_CHECK_VALUE(out.device().is_cpu() && out.is_contiguous() && out.dim() == 2,
                    "out must be a contiguous 2-D CPU tensor (rows x dim), got shape ", out.sizes());
  TORCH_CHECK_VALUE(rows.device().is_cpu() && rows.is_contiguous() && rows.dim() == 1,
                    "rows must be a contiguous 1-D CPU tensor");
  TORCH_CHECK_TYPE(rows.scalar_type() == at::kLong, "rows must be int64, got ", rows.scalar_type());
  TORCH_CHECK_VALUE(rows.numel() == out.size(0), "out must have len(rows) = ", rows.numel(),
                    " rows, got shape ", out.sizes());
  TORCH_CHECK_VALUE(0 <= key && key <= 0xFFFFFFFFll, "key must be a 32-bit value, got ", key);
  const int64_t n = rows.numel(), dim = out.size(1);
  const int64_t* rp = rows.data_ptr<int64_t>();
  const uint32_t k32 = static_cast<uint32_t>(key);
  const float b = static_cast<float>(bound);  // as torch converts a Python float for float32 math
  const int64_t grain = std::max<int64_t>(64, 32768 / std::max<int64_t>(dim, 1));
  switch (out.scalar_type()) {
    case at::kFloat: {
      float* o = out.data_ptr<float>();
      at::parallel_for(0, n, grain, [&](int64_t lo, int64_t hi) {
        fill(lo, hi, rp, dim, k32, b, [o](int64_t j, float v) { o[j] = v; });
      });
      break;
    }
    case at::kBFloat16: {
      auto* o = reinterpret_cast<uint16_t*>(out.data_ptr());
      at::parallel_for(0, n, grain, [&](int64_t lo, int64_t hi) {
        fill(lo, hi, rp, dim, k32, b, [o](int64_t j, float v) { o[j] = k::f32_to_bf16(v); });
      });
      break;
    }
    case at::kHalf: {
      auto* o = reinterpret_cast<uint16_t*>(out.data_ptr());
      at::parallel_for(0, n, grain, [&](int64_t lo, int64_t hi) {
        fill(lo, hi, rp, dim, k32, b, [o](int64_t j, float v) { o[j] = k::f32_to_f16(v); });
      });
      break;
    }
    default:
      TORCH_CHECK_TYPE(false, "out must be float32, bfloat16 or float16, got ", out.scalar_type());
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(hybrid, m) {
  m.def("initial_rows_(Tensor(a!) out, Tensor rows, int key, float bound) -> ()");
}

TORCH_LIBRARY_IMPL(hybrid, CompositeExplicitAutograd, m) { m.impl("initial_rows_", initial_rows_); }
