// Decode attention read straight from the block-major paged KV cache, for CPUs.
//
// One query token per sequence. Work items are sequences; each reads its keys and values once,
// token row by token row, and serves the query heads grouped on each kv head (GQA/MQA). Scores go to a per-item buffer, then softmax, then one pass over the values. This
// reads the cache exactly once, with no gathered copy and no repeated kv heads; the pure-torch
// reference is splitserve_kernels.reference.attention.paged_decode_attention.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

// Loads one element as float. bfloat16 widens by a shift of its bits, which the compiler
// vectorizes; c10's conversion operator does not.
template <typename scalar_t>
inline float load(const scalar_t* p, int64_t i) {
  return static_cast<float>(p[i]);
}

template <>
inline float load<c10::BFloat16>(const c10::BFloat16* p, int64_t i) {
  const uint32_t bits = static_cast<uint32_t>(reinterpret_cast<const uint16_t*>(p)[i]) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

template <typename scalar_t>
void decode_kernel(
    const scalar_t* q, const scalar_t* cache, scalar_t* out, const int64_t* tables,
    const int64_t* seq_lens, int64_t batch, int64_t heads, int64_t kv_heads, int64_t dim,
    int64_t layers, int64_t layer, int64_t block_size, int64_t max_blocks, float scale,
    int64_t window) {
  const int64_t group = heads / kv_heads;
  const int64_t token_stride = kv_heads * dim;
  const int64_t half_stride = block_size * token_stride;  // K or V of one block and layer
  const int64_t block_stride = layers * 2 * half_stride;  // one block, all layers
  // One work item per sequence: each token's keys (and values) of all heads are one contiguous
  // row, read front to back.
  at::parallel_for(0, batch, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(heads * dim);
    std::vector<float> acc(heads * dim);
    std::vector<float> scores;
    for (int64_t b = begin; b < end; ++b) {
      const int64_t len = seq_lens[b];
      const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      const int64_t n = len - first;
      if (n <= 0) {
        continue;
      }
      for (int64_t i = 0; i < heads * dim; ++i) {
        qf[i] = load(q + b * heads * dim, i) * scale;
      }
      scores.assign(heads * n, 0.0f);
      const int64_t* table = tables + b * max_blocks;
      for (int64_t t = first; t < len; ++t) {
        const scalar_t* row = cache + table[t / block_size] * block_stride +
                              layer * 2 * half_stride + (t % block_size) * token_stride;
        for (int64_t h = 0; h < heads; ++h) {
          const scalar_t* k = row + (h / group) * dim;
          const float* qh = qf.data() + h * dim;
          float s = 0.0f;
#pragma omp simd reduction(+ : s)
          for (int64_t x = 0; x < dim; ++x) {
            s += qh[x] * load(k, x);
          }
          scores[h * n + (t - first)] = s;
        }
      }
      for (int64_t h = 0; h < heads; ++h) {
        float* sh = scores.data() + h * n;
        const float top = *std::max_element(sh, sh + n);
        float total = 0.0f;
        for (int64_t i = 0; i < n; ++i) {
          sh[i] = std::exp(sh[i] - top);
          total += sh[i];
        }
        const float inv = 1.0f / total;
        for (int64_t i = 0; i < n; ++i) {
          sh[i] *= inv;
        }
      }
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t t = first; t < len; ++t) {
        const scalar_t* row = cache + table[t / block_size] * block_stride +
                              (layer * 2 + 1) * half_stride + (t % block_size) * token_stride;
        for (int64_t h = 0; h < heads; ++h) {
          const scalar_t* v = row + (h / group) * dim;
          const float p = scores[h * n + (t - first)];
          float* ah = acc.data() + h * dim;
#pragma omp simd
          for (int64_t x = 0; x < dim; ++x) {
            ah[x] += p * load(v, x);
          }
        }
      }
      for (int64_t i = 0; i < heads * dim; ++i) {
        out[b * heads * dim + i] = static_cast<scalar_t>(acc[i]);
      }
    }
  });
}

}  // namespace

torch::Tensor paged_decode_attention(
    torch::Tensor q, torch::Tensor cache, int64_t layer, torch::Tensor block_tables,
    torch::Tensor seq_lens, double scale, int64_t window) {
  TORCH_CHECK(q.dim() == 3 && cache.dim() == 6, "q [B, H, D] and cache [N, L, 2, bs, kvh, D]");
  TORCH_CHECK(q.scalar_type() == cache.scalar_type(), "q and cache dtypes differ");
  TORCH_CHECK(cache.is_contiguous(), "cache must be contiguous");
  const int64_t heads = q.size(1);
  const int64_t kv_heads = cache.size(4);
  TORCH_CHECK(heads % kv_heads == 0, "heads must be a multiple of kv heads");
  TORCH_CHECK(q.size(2) == cache.size(5), "head dims differ");
  auto qc = q.contiguous();
  auto tables = block_tables.to(torch::kLong).contiguous();
  auto lens = seq_lens.to(torch::kLong).contiguous();
  auto out = torch::empty_like(qc);
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::ScalarType::BFloat16, at::ScalarType::Half, q.scalar_type(), "paged_decode", [&] {
        decode_kernel<scalar_t>(
            qc.data_ptr<scalar_t>(), cache.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
            tables.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), qc.size(0), heads, kv_heads,
            qc.size(2), cache.size(1), layer, cache.size(3), tables.size(1),
            static_cast<float>(scale), window);
      });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention);
}
