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

#include "dtype.h"
#include "kernels.h"

namespace {

using at::Tensor;
namespace k = hybrid::kernels;

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
  const k::DType dtype = hybrid::float_dtype(out, "out");
  auto* o = static_cast<char*>(out.data_ptr());
  const int64_t row_bytes = dim * static_cast<int64_t>(out.element_size());
  const auto init = k::dispatch().initial_rows;
  at::parallel_for(0, n, grain, [&](int64_t lo, int64_t hi) {
    init(o + lo * row_bytes, dtype, dim, rp + lo, nullptr, hi - lo, k32, b);
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(hybrid, m) {
  m.def("initial_rows_(Tensor(a!) out, Tensor rows, int key, float bound) -> ()");
}

TORCH_LIBRARY_IMPL(hybrid, CompositeExplicitAutograd, m) { m.impl("initial_rows_", initial_rows_); }
