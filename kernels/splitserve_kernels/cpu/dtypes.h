// Calls a kernel template for a tensor's dtype: the dtypes every CPU kernel takes.
#pragma once

#include <torch/extension.h>

namespace splitserve {

// fn(scalar_t{}) for x's dtype (float32, bfloat16 or float16); a Triton-facing error otherwise.
template <typename Fn>
void by_dtype(const torch::Tensor& x, const char* name, Fn&& fn) {
  switch (x.scalar_type()) {
    case at::kFloat:
      fn(float{});
      break;
    case at::kBFloat16:
      fn(c10::BFloat16{});
      break;
    case at::kHalf:
      fn(c10::Half{});
      break;
    default:
      TORCH_CHECK(false, name, ": float32, bfloat16 or float16, got ", x.scalar_type());
  }
}

}  // namespace splitserve
