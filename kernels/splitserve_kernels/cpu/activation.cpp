// SwiGLU's activation, silu(gate) * up, in place into gate, for CPUs. Rounds where the pure-torch
// reference (splitserve_kernels.reference.activation) rounds: silu(gate), then the product.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include "dtypes.h"
#include "vec.h"

using namespace splitserve;

namespace {

template <typename scalar_t>
void silu_mul_range(scalar_t* gate, const scalar_t* up, int64_t begin, int64_t end) {
  int64_t i = begin;
  for (; i + W <= end; i += W) {
    const vf g = load16(gate + i);
    const vf silu = round_to<scalar_t>(g / (vexp(-g) + 1.0f));
    store16(gate + i, silu * load16(up + i));
  }
  for (; i < end; ++i) {
    const float g = load1(gate, i);
    const float silu = static_cast<float>(static_cast<scalar_t>(g / (std::exp(-g) + 1.0f)));
    gate[i] = static_cast<scalar_t>(silu * load1(up, i));
  }
}

}  // namespace

torch::Tensor silu_mul_(torch::Tensor gate, torch::Tensor up) {
  TORCH_CHECK(gate.is_contiguous() && up.is_contiguous() && gate.sizes() == up.sizes() &&
                  gate.scalar_type() == up.scalar_type(),
              "gate and up must be contiguous, of one shape and dtype");
  by_dtype(gate, "silu_mul_", [&](auto zero) {
    using scalar_t = decltype(zero);
    scalar_t* g = gate.data_ptr<scalar_t>();
    const scalar_t* u = up.data_ptr<scalar_t>();
    at::parallel_for(0, gate.numel(), 4096, [&](int64_t begin, int64_t end) {
      silu_mul_range(g, u, begin, end);
    });
  });
  return gate;
}
