// The row kernels' element type of a float tensor, for the sources that take torch tensors (it
// includes ATen, so never the row kernels' own sources).
#pragma once

#include <ATen/ATen.h>

#include <string>

#include "kernels.h"

namespace hybrid {

inline kernels::DType float_dtype(const at::Tensor& t, const std::string& what) {
  switch (t.scalar_type()) {
    case at::kFloat:
      return kernels::DType::f32;
    case at::kBFloat16:
      return kernels::DType::bf16;
    case at::kHalf:
      return kernels::DType::f16;
    default:
      TORCH_CHECK_TYPE(false, what, " must be float32, bfloat16 or float16, got ", t.scalar_type());
  }
}

}  // namespace hybrid
