// Greedy decoding's choice of token: the index of each row's largest logit, the first one where
// several tie, read in the logits' own dtype (no float32 copy of [batch, vocab] first), for CPUs.
// Same answer as the pure-torch reference (splitserve_kernels.reference.sampling.greedy_tokens,
// torch.max(dim=-1).indices), NaN included: a row holding a NaN gives its first NaN.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <cmath>

#include "dtypes.h"
#include "vec.h"

using namespace splitserve;

namespace {

template <typename scalar_t>
int64_t first_nan(const scalar_t* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    if (std::isnan(load1(x, i))) {
      return i;
    }
  }
  return -1;
}

// Two passes over the row (the second from cache): its maximum, then where it first occurs.
template <typename scalar_t>
int64_t row_argmax(const scalar_t* x, int64_t n) {
  const int64_t vec_n = n - n % W;
  vf best = splat(-INFINITY);
  vi unordered = vi{};
  for (int64_t i = 0; i < vec_n; i += W) {
    const vf v = load16(x + i);
    unordered |= v != v;
    best = v > best ? v : best;
  }
  float top = hmax(best);
  bool nan = false;
  for (int64_t j = 0; j < W; ++j) {
    nan |= unordered[j] != 0;
  }
  for (int64_t i = vec_n; i < n; ++i) {
    const float v = load1(x, i);
    nan |= std::isnan(v);
    top = v > top ? v : top;
  }
  if (nan) {
    return first_nan(x, n);
  }
  const vf target = splat(top);
  for (int64_t i = 0; i < vec_n; i += W) {
    const vi hit = load16(x + i) == target;
    for (int64_t j = 0; j < W; ++j) {
      if (hit[j]) {
        return i + j;
      }
    }
  }
  for (int64_t i = vec_n; i < n; ++i) {
    if (load1(x, i) == top) {
      return i;
    }
  }
  return 0;  // not reached: top is one of the entries
}

}  // namespace

torch::Tensor greedy_tokens(torch::Tensor logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.size(1) > 0, "logits must be [batch, vocab], vocab > 0");
  auto x = logits.contiguous();
  auto out = torch::empty({x.size(0)}, x.options().dtype(torch::kLong));
  int64_t* tokens = out.data_ptr<int64_t>();
  const int64_t vocab = x.size(1);
  by_dtype(x, "greedy_tokens", [&](auto zero) {
    using scalar_t = decltype(zero);
    const scalar_t* rows = x.data_ptr<scalar_t>();
    at::parallel_for(0, x.size(0), 1, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        tokens[r] = row_argmax(rows + r * vocab, vocab);
      }
    });
  });
  return out;
}
