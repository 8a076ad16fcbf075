// Decode attention read straight from the layer-major paged KV cache, for CPUs.
//
// One query token per sequence; a work item is a run of sequences with about equal numbers of
// keys. Its tokens are taken 16 at a time (a chunk, never crossing a block), one token per
// vector lane:
// - scores: for each query head, the chunk's keys on its kv head (GQA/MQA) are dotted with the
//   query into 16 vectors of partial sums, which one transposing reduction (vec.h) turns into the
//   chunk's 16 scores; with AVX512-BF16, bfloat16 keys and queries are multiplied in pairs by one
//   instruction, without widening. The chunk's keys stay in L1 while every head reads them;
// - softmax over each head's scores, with a vectorized exp;
// - values: each value row is widened once and accumulated into up to 256 floats of output
//   (four heads of dim 64, two of 128) held in registers across the chunk.
// A sequence's blocks need not be adjacent in its layer: the next block is prefetched into L2 in
// small parts spread over the work on the current one. Head dims 32, 64 and 128 are compiled
// with their loops unrolled.
// The pure-torch reference is splitserve_kernels.reference.attention.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <immintrin.h>

#include <vector>

#include "dtypes.h"
#include "scratch.h"
#include "vec.h"

using namespace splitserve;

namespace {

struct Shape {
  int64_t heads, kv_heads, dim, token_stride, half_stride, block_stride, layer_offset;
  int64_t block_size, max_blocks;
};

// Prefetches a block into L2 in parts, spread over the work on the block before it: a burst of a
// whole block's prefetches would stall the loads of the current one.
struct Prefetch {
  const char* next = nullptr;
  int64_t bytes = 0;

  // Part k of n.
  void part(int64_t k, int64_t n) const {
    if (next == nullptr) {
      return;
    }
    const int64_t end = bytes * (k + 1) / n;
    for (int64_t line = bytes * k / n / 64 * 64; line < end; line += 64) {
      __builtin_prefetch(next + line, 0, 1);
    }
  }
};

// Calls fn(rows, i, count, prefetch, c, chunks) for each chunk of up to W tokens of
// [first, len) inside one block: `rows` points at the chunk's first token row, `i` is that
// token's index from `first`, `c` the chunk's index among the block's `chunks`; fn calls
// prefetch.part for the next block as it works. `base` is the layer's K (or V) slice in block 0.
template <typename scalar_t, typename Fn>
inline void for_each_chunk(
    const scalar_t* base, const int64_t* table, int64_t first, int64_t len, const Shape& s,
    Fn&& fn) {
  const int64_t bs = s.block_size;
  const int64_t block_bytes = s.half_stride * static_cast<int64_t>(sizeof(scalar_t));
  const auto block = [&](int64_t blk) {
    return Prefetch{reinterpret_cast<const char*>(base + table[blk] * s.block_stride), block_bytes};
  };
  const int64_t last = (len - 1) / bs;
  block(first / bs).part(0, 1);
  for (int64_t blk = first / bs; blk <= last; ++blk) {
    const Prefetch next = blk < last ? block(blk + 1) : Prefetch{};
    const scalar_t* rows = base + table[blk] * s.block_stride;
    const int64_t begin = std::max(first, blk * bs);
    const int64_t end = std::min(len, (blk + 1) * bs);
    const int64_t chunks = (end - begin + W - 1) / W;
    for (int64_t t = begin, c = 0; t < end; t += W, ++c) {
      fn(rows + (t - blk * bs) * s.token_stride, t - first, std::min(W, end - t), next, c, chunks);
    }
  }
}

#ifdef __AVX512BF16__
constexpr bool kBf16Dot = true;
#else
constexpr bool kBf16Dot = false;
#endif

// Whether q.k runs on bfloat16 pairs (AVX512-BF16) rather than on widened floats.
template <typename scalar_t, int64_t kDim>
constexpr bool pair_dot() {
  return kBf16Dot && std::is_same_v<scalar_t, c10::BFloat16> && kDim > 0 && kDim % 32 == 0;
}

// A vector whose lanes sum to q.k for one head: `q` is the head's query, float32 or (pair_dot)
// the raw bfloat16 row.
template <typename scalar_t, int64_t kDim>
inline vf partial_dot(const void* q, const scalar_t* k, int64_t dim) {
  vf acc = splat(0.0f);
  if constexpr (pair_dot<scalar_t, kDim>()) {
#ifdef __AVX512BF16__
    __m512 a = _mm512_setzero_ps();
    for (int64_t x = 0; x < kDim; x += 2 * W) {
      const auto qv = (__m512bh)_mm512_loadu_si512(static_cast<const scalar_t*>(q) + x);
      const auto kv = (__m512bh)_mm512_loadu_si512(k + x);
      a = _mm512_dpbf16_ps(a, qv, kv);
    }
    acc = (vf)a;
#endif
  } else {
    const float* qf = static_cast<const float*>(q);
    const int64_t d = kDim ? kDim : dim;
    const int64_t vec_dim = d - d % W;
    for (int64_t x = 0; x < vec_dim; x += W) {
      acc += load(qf + x) * load16(k + x);
    }
    for (int64_t x = vec_dim; x < d; ++x) {
      acc[0] += qf[x] * load1(k, x);
    }
  }
  return acc;
}

// Scores of query head `q` against a chunk of `count` key rows (`stride` elements apart), scaled,
// as one vector (lanes past `count` are zero).
template <typename scalar_t, int64_t kDim>
inline vf chunk_scores(
    const void* q, const scalar_t* k, int64_t stride, int64_t count, int64_t dim, float scale) {
  vf p[W];
#pragma GCC unroll 16
  for (int64_t j = 0; j < W; ++j) {
    p[j] = j < count ? partial_dot<scalar_t, kDim>(q, k + j * stride, dim) : splat(0.0f);
  }
  return transpose_sum(p) * scale;
}

// acc[h][:] += sum_j p[h][j] * v[j][:] for kHeads heads of dim kDim (kDim > 0), the
// accumulators in registers: `p` holds each head's probabilities (`p_stride` apart).
template <typename scalar_t, int64_t kDim, int kHeads>
inline void accumulate(
    float* acc, const float* p, int64_t p_stride, const scalar_t* v, int64_t stride,
    int64_t count) {
  constexpr int64_t V = kDim / W;
  vf a[kHeads][V];
  for (int h = 0; h < kHeads; ++h) {
    for (int64_t x = 0; x < V; ++x) {
      a[h][x] = load(acc + h * kDim + x * W);
    }
  }
  for (int64_t j = 0; j < count; ++j) {
    vf row[V];
    for (int64_t x = 0; x < V; ++x) {
      row[x] = load16(v + j * stride + x * W);
    }
    for (int h = 0; h < kHeads; ++h) {
      const vf w = splat(p[h * p_stride + j]);
      for (int64_t x = 0; x < V; ++x) {
        a[h][x] += w * row[x];
      }
    }
  }
  for (int h = 0; h < kHeads; ++h) {
    for (int64_t x = 0; x < V; ++x) {
      store(acc + h * kDim + x * W, a[h][x]);
    }
  }
}

// The same for one head of any dim, the accumulator in memory.
template <typename scalar_t>
inline void accumulate_any(
    float* acc, const float* p, const scalar_t* v, int64_t stride, int64_t count, int64_t dim) {
  const int64_t vec_dim = dim - dim % W;
  for (int64_t j = 0; j < count; ++j) {
    const scalar_t* row = v + j * stride;
    const vf w = splat(p[j]);
    for (int64_t x = 0; x < vec_dim; x += W) {
      store(acc + x, load(acc + x) + w * load16(row + x));
    }
    for (int64_t x = vec_dim; x < dim; ++x) {
      acc[x] += p[j] * load1(row, x);
    }
  }
}

// Query heads accumulated together from one value row: up to 256 floats of accumulators, and
// no more heads than accumulate_heads has cases for.
template <int64_t kDim>
constexpr int64_t heads_per_pass() {
  return kDim == 0 ? 1 : std::clamp<int64_t>(256 / kDim, 1, 4);
}

template <typename scalar_t, int64_t kDim>
inline void accumulate_heads(
    int64_t heads, float* acc, const float* p, int64_t p_stride, const scalar_t* v,
    int64_t stride, int64_t count, int64_t dim) {
  if constexpr (kDim == 0) {
    accumulate_any(acc, p, v, stride, count, dim);
  } else {
    switch (heads) {
      case 4:
        if constexpr (heads_per_pass<kDim>() >= 4) {
          accumulate<scalar_t, kDim, 4>(acc, p, p_stride, v, stride, count);
          return;
        }
        break;
      case 3:
        if constexpr (heads_per_pass<kDim>() >= 3) {
          accumulate<scalar_t, kDim, 3>(acc, p, p_stride, v, stride, count);
          return;
        }
        break;
      case 2:
        if constexpr (heads_per_pass<kDim>() >= 2) {
          accumulate<scalar_t, kDim, 2>(acc, p, p_stride, v, stride, count);
          return;
        }
        break;
      default:
        break;
    }
    accumulate<scalar_t, kDim, 1>(acc, p, p_stride, v, stride, count);
  }
}

using Scratch = splitserve::Scratch<3>;

// exp(s - max) / sum over s[0, n), in place.
inline void softmax(float* s, int64_t n) {
  vf top = splat(-INFINITY);
  int64_t i = 0;
  for (; i + W <= n; i += W) {
    const vf v = load(s + i);
    top = v > top ? v : top;
  }
  float m = hmax(top);
  for (; i < n; ++i) {
    m = std::max(m, s[i]);
  }
  vf total = splat(0.0f);
  for (i = 0; i + W <= n; i += W) {
    const vf e = vexp(load(s + i) - m);
    store(s + i, e);
    total += e;
  }
  float sum = hsum(total);
  for (; i < n; ++i) {
    s[i] = std::exp(s[i] - m);
    sum += s[i];
  }
  const float inv = 1.0f / sum;
  for (i = 0; i < n; ++i) {
    s[i] *= inv;
  }
}

template <typename scalar_t, int64_t kDim>
void attend(
    const scalar_t* q, const scalar_t* cache, scalar_t* out, const int64_t* table, int64_t len,
    int64_t window, float scale, const Shape& s, int64_t b, Scratch& scratch) {
  const int64_t group = s.heads / s.kv_heads;
  const int64_t dim = kDim ? kDim : s.dim;
  const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
  const int64_t n = len - first;
  if (n <= 0) {
    return;  // no keys: the output stays zero
  }
  // Scores of one head, padded so that a chunk's whole vector fits past the last token.
  const int64_t stride = (n + W - 1) / W * W + W;
  float* acc = scratch.floats(0, s.heads * dim);
  float* scores = scratch.floats(1, s.heads * stride);
  const scalar_t* qb = q + b * s.heads * dim;
  const void* qh = qb;
  if constexpr (!pair_dot<scalar_t, kDim>()) {
    float* qf = scratch.floats(2, s.heads * dim);
    for (int64_t i = 0; i < s.heads * dim; ++i) {
      qf[i] = load1(qb, i);
    }
    qh = qf;
  }
  const int64_t q_bytes = dim * static_cast<int64_t>(pair_dot<scalar_t, kDim>() ? sizeof(scalar_t)
                                                                                  : sizeof(float));
  const scalar_t* k_base = cache + s.layer_offset;
  const auto scores_of = [&](const scalar_t* rows, int64_t i, int64_t count, const Prefetch& next,
                            int64_t c, int64_t chunks) {
    for (int64_t h = 0; h < s.heads; ++h) {
      next.part(c * s.heads + h, chunks * s.heads);
      const void* qrow = static_cast<const char*>(qh) + h * q_bytes;
      const scalar_t* k = rows + (h / group) * dim;
      store(scores + h * stride + i,
            chunk_scores<scalar_t, kDim>(qrow, k, s.token_stride, count, dim, scale));
    }
  };
  for_each_chunk(k_base, table, first, len, s, scores_of);
  for (int64_t h = 0; h < s.heads; ++h) {
    softmax(scores + h * stride, n);
  }
  std::fill(acc, acc + s.heads * dim, 0.0f);
  constexpr int64_t pass = heads_per_pass<kDim>();
  const auto values_of = [&](const scalar_t* rows, int64_t i, int64_t count, const Prefetch& next,
                            int64_t c, int64_t chunks) {
    for (int64_t g = 0; g < s.kv_heads; ++g) {
      next.part(c * s.kv_heads + g, chunks * s.kv_heads);
      for (int64_t h = g * group; h < (g + 1) * group; h += pass) {
        const int64_t heads = std::min(pass, (g + 1) * group - h);
        accumulate_heads<scalar_t, kDim>(heads, acc + h * dim, scores + h * stride + i, stride,
                                         rows + g * dim, s.token_stride, count, dim);
      }
    }
  };
  for_each_chunk(k_base + s.half_stride, table, first, len, s, values_of);
  scalar_t* ob = out + b * s.heads * dim;
  for (int64_t i = 0; i < s.heads * dim; ++i) {
    ob[i] = static_cast<scalar_t>(acc[i]);
  }
}

// Splits the batch into one contiguous run of sequences per thread with about equal numbers of
// keys to read (a static split by count leaves one thread idle behind a long sequence).
std::vector<int64_t> balanced_runs(const int64_t* seq_lens, int64_t batch, int64_t window) {
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), batch));
  const auto work = [&](int64_t b) {
    return (window > 0 ? std::min(seq_lens[b], window) : seq_lens[b]) + W;  // W: fixed costs
  };
  int64_t total = 0;
  for (int64_t b = 0; b < batch; ++b) {
    total += work(b);
  }
  std::vector<int64_t> bounds{0};
  int64_t done = 0;
  for (int64_t b = 0; b < batch; ++b) {
    done += work(b);
    for (int64_t k = bounds.size(); k < parts && done * parts >= total * k; ++k) {
      bounds.push_back(b + 1);
    }
  }
  while (static_cast<int64_t>(bounds.size()) <= parts) {
    bounds.push_back(batch);
  }
  return bounds;
}

template <typename scalar_t>
void decode_kernel(
    const scalar_t* q, const scalar_t* cache, scalar_t* out, const int64_t* tables,
    const int64_t* seq_lens, int64_t batch, const Shape& s, float scale, int64_t window) {
  const std::vector<int64_t> bounds = balanced_runs(seq_lens, batch, window);
  at::parallel_for(0, static_cast<int64_t>(bounds.size()) - 1, 1, [&](int64_t first, int64_t last) {
    Scratch scratch;
    for (int64_t b = bounds[first]; b < bounds[last]; ++b) {
      const int64_t len = seq_lens[b];
      const int64_t* table = tables + b * s.max_blocks;
      switch (s.dim) {
        case 32:
          attend<scalar_t, 32>(q, cache, out, table, len, window, scale, s, b, scratch);
          break;
        case 64:
          attend<scalar_t, 64>(q, cache, out, table, len, window, scale, s, b, scratch);
          break;
        case 128:
          attend<scalar_t, 128>(q, cache, out, table, len, window, scale, s, b, scratch);
          break;
        default:
          attend<scalar_t, 0>(q, cache, out, table, len, window, scale, s, b, scratch);
      }
    }
  });
}

}  // namespace

torch::Tensor paged_decode_attention(
    torch::Tensor q, torch::Tensor cache, int64_t layer, torch::Tensor block_tables,
    torch::Tensor seq_lens, double scale, int64_t window) {
  TORCH_CHECK(q.dim() == 3 && cache.dim() == 6, "q [B, H, D] and cache [L, N, 2, bs, kvh, D]");
  TORCH_CHECK(q.scalar_type() == cache.scalar_type(), "q and cache dtypes differ");
  TORCH_CHECK(cache.is_contiguous(), "cache must be contiguous");
  const int64_t heads = q.size(1);
  const int64_t kv_heads = cache.size(4);
  TORCH_CHECK(heads % kv_heads == 0, "heads must be a multiple of kv heads");
  TORCH_CHECK(q.size(2) == cache.size(5), "head dims differ");
  auto qc = q.contiguous();
  auto tables = block_tables.to(torch::kLong).contiguous();
  auto lens = seq_lens.to(torch::kLong).contiguous();
  auto out = torch::zeros_like(qc);
  const int64_t dim = qc.size(2);
  const int64_t token_stride = kv_heads * dim;
  const int64_t half_stride = cache.size(3) * token_stride;
  const Shape shape{heads,
                    kv_heads,
                    dim,
                    token_stride,
                    half_stride,
                    2 * half_stride,
                    layer * cache.stride(0),
                    cache.size(3),
                    tables.size(1)};
  by_dtype(q, "paged_decode_attention", [&](auto zero) {
    using scalar_t = decltype(zero);
    decode_kernel<scalar_t>(
        qc.data_ptr<scalar_t>(), cache.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
        tables.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), qc.size(0), shape,
        static_cast<float>(scale), window);
  });
  return out;
}
