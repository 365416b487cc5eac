// Argument checks the compiled functions share.
#pragma once

#include <torch/extension.h>

namespace verispec {

// t must be a contiguous [n] int64 tensor; `name` is the argument's, for the error.
inline void check_int64s(const torch::Tensor& t, int64_t n, const char* name) {
  TORCH_CHECK(t.dim() == 1 && t.scalar_type() == torch::kInt64 && t.is_contiguous() &&
                  t.numel() == n,
              name, " must be a contiguous [", n, "] int64 tensor");
}

}  // namespace verispec
