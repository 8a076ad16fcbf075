// Decode attention read straight from the block-major paged KV cache, for CPUs.
//
// One query token per sequence. Work items are (sequence, kv head) pairs; each reads the keys
// and values of its head once, block by block, and serves the query heads grouped on that kv head
// (GQA/MQA). Scores go to a per-item buffer, then softmax, then one pass over the values. This
// reads the cache exactly once, with no gathered copy and no repeated kv heads; the pure-torch
// reference is splitserve_kernels.reference.attention.paged_decode_attention.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

template <typename scalar_t>
void decode_kernel(
    const scalar_t* q, const scalar_t* cache, scalar_t* out, const int64_t* tables,
    const int64_t* seq_lens, int64_t batch, int64_t heads, int64_t kv_heads, int64_t dim,
    int64_t layers, int64_t layer, int64_t block_size, int64_t max_blocks, float scale,
    int64_t window) {
  const int64_t group = heads / kv_heads;
  const int64_t token_stride = kv_heads * dim;
  const int64_t half_stride = block_size * token_stride;   // K or V of one block and layer
  const int64_t block_stride = layers * 2 * half_stride;   // one block, all layers
  at::parallel_for(0, batch * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * dim);
    std::vector<float> acc(group * dim);
    std::vector<float> scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / kv_heads;
      const int64_t kh = item % kv_heads;
      const int64_t len = seq_lens[b];
      const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      const int64_t n = len - first;
      if (n <= 0) {
        continue;
      }
      for (int64_t j = 0; j < group; ++j) {
        const scalar_t* qh = q + (b * heads + kh * group + j) * dim;
        for (int64_t x = 0; x < dim; ++x) {
          qf[j * dim + x] = static_cast<float>(qh[x]) * scale;
        }
      }
      scores.assign(group * n, 0.0f);
      const int64_t* table = tables + b * max_blocks;
      for (int64_t t = first; t < len; ++t) {
        const scalar_t* k = cache + table[t / block_size] * block_stride +
                            layer * 2 * half_stride + (t % block_size) * token_stride + kh * dim;
        for (int64_t j = 0; j < group; ++j) {
          const float* qj = qf.data() + j * dim;
          float s = 0.0f;
#pragma omp simd reduction(+ : s)
          for (int64_t x = 0; x < dim; ++x) {
            s += qj[x] * static_cast<float>(k[x]);
          }
          scores[j * n + (t - first)] = s;
        }
      }
      for (int64_t j = 0; j < group; ++j) {
        float* sj = scores.data() + j * n;
        const float top = *std::max_element(sj, sj + n);
        float total = 0.0f;
        for (int64_t i = 0; i < n; ++i) {
          sj[i] = std::exp(sj[i] - top);
          total += sj[i];
        }
        const float inv = 1.0f / total;
        for (int64_t i = 0; i < n; ++i) {
          sj[i] *= inv;
        }
      }
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t t = first; t < len; ++t) {
        const scalar_t* v = cache + table[t / block_size] * block_stride +
                            (layer * 2 + 1) * half_stride + (t % block_size) * token_stride +
                            kh * dim;
        for (int64_t j = 0; j < group; ++j) {
          const float p = scores[j * n + (t - first)];
          float* aj = acc.data() + j * dim;
#pragma omp simd
          for (int64_t x = 0; x < dim; ++x) {
            aj[x] += p * static_cast<float>(v[x]);
          }
        }
      }
      for (int64_t j = 0; j < group; ++j) {
        scalar_t* oh = out + (b * heads + kh * group + j) * dim;
        for (int64_t x = 0; x < dim; ++x) {
          oh[x] = static_cast<scalar_t>(acc[j * dim + x]);
        }
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
