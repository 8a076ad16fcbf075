// RMSNorm, alone or after the residual add, one row per token, for CPUs. Rounds where the
// pure-torch reference (splitserve_kernels.reference.norm) rounds: the sum x + residual, the
// normalized row before the weight, and the product; only the order of the sum of squares differs.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <vector>

#include "dtypes.h"
#include "vec.h"

using namespace splitserve;

namespace {

// out = weight * round(x / rms(x)) for one row of n; x already rounded to scalar_t.
template <typename scalar_t>
void normalize_row(const float* x, const scalar_t* weight, scalar_t* out, int64_t n, float eps) {
  const int64_t vec_n = n - n % W;
  vf squares = splat(0.0f);
  for (int64_t i = 0; i < vec_n; i += W) {
    const vf v = load(x + i);
    squares += v * v;
  }
  float sum = hsum(squares);
  for (int64_t i = vec_n; i < n; ++i) {
    sum += x[i] * x[i];
  }
  const float inv = 1.0f / std::sqrt(sum / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < vec_n; i += W) {
    store16(out + i, load16(weight + i) * round_to<scalar_t>(load(x + i) * inv));
  }
  for (int64_t i = vec_n; i < n; ++i) {
    const float h = static_cast<float>(static_cast<scalar_t>(x[i] * inv));
    out[i] = static_cast<scalar_t>(load1(weight, i) * h);
  }
}

// x (+ residual, stored into sum_out) normalized into out, rows in parallel.
template <typename scalar_t>
void norm_rows(
    const scalar_t* x, const scalar_t* residual, const scalar_t* weight, scalar_t* out,
    scalar_t* sum_out, int64_t rows, int64_t n, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<vf> buf((n + W - 1) / W);
    float* h = reinterpret_cast<float*>(buf.data());
    const int64_t vec_n = n - n % W;
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* xr = x + r * n;
      if (residual == nullptr) {
        for (int64_t i = 0; i < vec_n; i += W) {
          store(h + i, load16(xr + i));
        }
        for (int64_t i = vec_n; i < n; ++i) {
          h[i] = load1(xr, i);
        }
      } else {
        const scalar_t* rr = residual + r * n;
        scalar_t* sr = sum_out + r * n;
        for (int64_t i = 0; i < vec_n; i += W) {
          const vf v = round_to<scalar_t>(load16(xr + i) + load16(rr + i));
          store(h + i, v);
          store16(sr + i, v);
        }
        for (int64_t i = vec_n; i < n; ++i) {
          sr[i] = static_cast<scalar_t>(load1(xr, i) + load1(rr, i));
          h[i] = static_cast<float>(sr[i]);
        }
      }
      normalize_row(h, weight, out + r * n, n, eps);
    }
  });
}

void check(const torch::Tensor& x, const torch::Tensor& weight) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous [T, hidden] tensor");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1), "weight must be [hidden]");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "x and weight dtypes differ");
}

}  // namespace

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  check(x, weight);
  auto w = weight.contiguous();
  auto out = torch::empty_like(x);
  by_dtype(x, "rms_norm", [&](auto zero) {
    using scalar_t = decltype(zero);
    norm_rows<scalar_t>(x.data_ptr<scalar_t>(), nullptr, w.data_ptr<scalar_t>(),
                        out.data_ptr<scalar_t>(), nullptr, x.size(0), x.size(1),
                        static_cast<float>(eps));
  });
  return out;
}

std::tuple<torch::Tensor, torch::Tensor> add_rms_norm(
    torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps) {
  check(x, weight);
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.is_contiguous() &&
                  residual.scalar_type() == x.scalar_type(),
              "residual must be contiguous, with x's shape and dtype");
  auto w = weight.contiguous();
  auto out = torch::empty_like(x);
  auto sum = torch::empty_like(x);
  by_dtype(x, "add_rms_norm", [&](auto zero) {
    using scalar_t = decltype(zero);
    norm_rows<scalar_t>(x.data_ptr<scalar_t>(), residual.data_ptr<scalar_t>(),
                        w.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
                        sum.data_ptr<scalar_t>(), x.size(0), x.size(1), static_cast<float>(eps));
  });
  return {out, sum};
}
