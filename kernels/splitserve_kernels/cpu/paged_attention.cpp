// Decode attention read straight from the block-major paged KV cache, for CPUs.
//
// One query token per sequence; a work item is one sequence. Its keys are read once, token row
// by token row (all kv heads of a token are one contiguous row), each row widened to float32 once
// and dotted with the query heads grouped on each kv head (GQA/MQA); softmax runs over the scores
// with a vectorized exp; then its values are read once the same way and accumulate in float32.
// Blocks lie far apart in the pool, so each next block is prefetched while one is read. Vectors
// are GCC vector extensions of 16 floats: -march=native makes them AVX-512 here and narrower
// registers elsewhere, with one code path; head dims 64 and 128 are compiled with their loops
// unrolled. The pure-torch reference is splitserve_kernels.reference.attention.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t W = 16;  // floats per vector
typedef float vf __attribute__((vector_size(W * sizeof(float))));
typedef int32_t vi __attribute__((vector_size(W * sizeof(int32_t))));
typedef uint32_t vu __attribute__((vector_size(W * sizeof(uint32_t))));
typedef uint16_t vh __attribute__((vector_size(W * sizeof(uint16_t))));
typedef _Float16 vhf __attribute__((vector_size(W * sizeof(_Float16))));
typedef float vf8 __attribute__((vector_size(8 * sizeof(float))));
typedef float vf4 __attribute__((vector_size(4 * sizeof(float))));

inline vf splat(float x) { return vf{} + x; }

// 16 consecutive elements as float32. bfloat16 widens by a shift of its bits.
template <typename scalar_t>
inline vf load16(const scalar_t* p);

template <>
inline vf load16<float>(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

template <>
inline vf load16<c10::BFloat16>(const c10::BFloat16* p) {
  vh raw;
  std::memcpy(&raw, p, sizeof(raw));
  const vu bits = __builtin_convertvector(raw, vu) << 16;
  vf v;
  std::memcpy(&v, &bits, sizeof(v));
  return v;
}

template <>
inline vf load16<c10::Half>(const c10::Half* p) {
  vhf raw;
  std::memcpy(&raw, p, sizeof(raw));
  return __builtin_convertvector(raw, vf);
}

inline float hsum(vf v) {
  const vf8 h = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const vf4 f = __builtin_shufflevector(h, h, 0, 1, 2, 3) + __builtin_shufflevector(h, h, 4, 5, 6, 7);
  return (f[0] + f[2]) + (f[1] + f[3]);
}

inline float hmax(vf v) {
  float m = v[0];
  for (int64_t i = 1; i < W; ++i) {
    m = std::max(m, v[i]);
  }
  return m;
}

// exp for x <= 0 (scores minus their maximum), to about 2 ulp: 2^n * p(r) with r = x - n ln 2,
// the range reduction and polynomial of Cephes' expf.
inline vf exp_nonpositive(vf x) {
  x = x < -87.0f ? splat(-87.0f) : x;
  const vf fx = x * 1.44269504088896341f + 0.5f;
  vf n = __builtin_convertvector(__builtin_convertvector(fx, vi), vf);
  n -= n > fx ? splat(1.0f) : splat(0.0f);  // floor: the conversion truncates toward zero
  const vf r = x - n * 0.693359375f + n * 2.12194440e-4f;
  vf p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const vi scale = (__builtin_convertvector(n, vi) + 127) << 23;
  vf two_n;
  std::memcpy(&two_n, &scale, sizeof(two_n));
  return p * two_n;
}

// exp(x - top) over s[0, n), in place; returns their sum.
inline float softmax_numerators(float* s, int64_t n, float top) {
  vf total = splat(0.0f);
  int64_t i = 0;
  for (; i + W <= n; i += W) {
    vf v;
    std::memcpy(&v, s + i, sizeof(v));
    v = exp_nonpositive(v - top);
    std::memcpy(s + i, &v, sizeof(v));
    total += v;
  }
  float sum = hsum(total);
  for (; i < n; ++i) {
    s[i] = std::exp(s[i] - top);
    sum += s[i];
  }
  return sum;
}

template <typename scalar_t>
inline float load1(const scalar_t* p, int64_t i) {
  return static_cast<float>(p[i]);
}

// dst[0, n) = float(src[0, n)).
template <typename scalar_t>
inline void widen_row(const scalar_t* src, int64_t n, float* dst) {
  int64_t i = 0;
  for (; i + W <= n; i += W) {
    const vf v = load16(src + i);
    std::memcpy(dst + i, &v, sizeof(v));
  }
  for (; i < n; ++i) {
    dst[i] = load1(src, i);
  }
}

struct Shape {
  int64_t heads, kv_heads, dim, token_stride, half_stride, block_stride, layer_offset;
  int64_t block_size, max_blocks;
};

// Calls fn(row, i) for the i-th token of [first, len): `row` points at that token's slice in
// the block-major cache, given `base` (the slice in block 0). Block by block, each next block's
// slice prefetched while the current one is read: blocks lie far apart, and the hardware
// prefetcher stops at each jump.
template <typename scalar_t, typename Fn>
inline void for_each_token(
    const scalar_t* base, const int64_t* table, int64_t first, int64_t len, const Shape& s,
    Fn&& fn) {
  const int64_t bs = s.block_size;
  const int64_t block_bytes = bs * s.token_stride * static_cast<int64_t>(sizeof(scalar_t));
  const int64_t last = (len - 1) / bs;
  for (int64_t blk = first / bs; blk <= last; ++blk) {
    if (blk < last) {
      const char* next = reinterpret_cast<const char*>(base + table[blk + 1] * s.block_stride);
      for (int64_t line = 0; line < block_bytes; line += 64) {
        __builtin_prefetch(next + line, 0, 3);
      }
    }
    const scalar_t* rows = base + table[blk] * s.block_stride;
    const int64_t begin = std::max(first, blk * bs);
    const int64_t end = std::min(len, (blk + 1) * bs);
    for (int64_t t = begin; t < end; ++t) {
      fn(rows + (t - blk * bs) * s.token_stride, t - first);
    }
  }
}

// Per-thread scratch, 64-byte aligned (a vector of vf): loads and stores of whole vectors never
// straddle cache lines.
class Scratch {
 public:
  float* floats(size_t i, int64_t n) {
    auto& buf = bufs_[i];
    buf.resize((n + W - 1) / W);
    return reinterpret_cast<float*>(buf.data());
  }

 private:
  std::vector<vf> bufs_[4];
};

// Attention of every query head of sequence `b`: each token's keys (then values) of all kv heads
// are one contiguous row, and consecutive tokens of a block are consecutive rows. kDim is the head
// dim where it is known at compile time (the loops over it then unroll), else 0.
template <typename scalar_t, int64_t kDim>
void attend(
    const scalar_t* q, const scalar_t* cache, scalar_t* out, const int64_t* table, int64_t len,
    int64_t window, float scale, const Shape& s, int64_t b, Scratch& scratch) {
  const int64_t group = s.heads / s.kv_heads;
  const int64_t dim = kDim ? kDim : s.dim;
  const int64_t vec_dim = dim - dim % W;
  const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
  const int64_t n = len - first;
  if (n <= 0) {
    return;  // no keys: the output stays zero
  }
  const int64_t stride = (n + W - 1) / W * W;  // scores of one head, padded to whole vectors
  float* qf = scratch.floats(0, s.heads * dim);
  float* acc = scratch.floats(1, s.heads * dim);
  float* row = scratch.floats(2, s.token_stride);
  float* scores = scratch.floats(3, s.heads * stride);
  const scalar_t* qb = q + b * s.heads * dim;
  for (int64_t i = 0; i < s.heads * dim; ++i) {
    qf[i] = load1(qb, i) * scale;
  }
  const scalar_t* k_base = cache + s.layer_offset;
  for_each_token(k_base, table, first, len, s, [&](const scalar_t* k_row, int64_t i) {
    widen_row(k_row, s.token_stride, row);
    for (int64_t g = 0; g < s.kv_heads; ++g) {
      const float* k = row + g * dim;
      for (int64_t h = g * group; h < (g + 1) * group; ++h) {
        const float* qh = qf + h * dim;
        vf dot = splat(0.0f);
        for (int64_t x = 0; x < vec_dim; x += W) {
          vf qv, kv;
          std::memcpy(&qv, qh + x, sizeof(qv));
          std::memcpy(&kv, k + x, sizeof(kv));
          dot += qv * kv;
        }
        float sc = hsum(dot);
        for (int64_t x = vec_dim; x < dim; ++x) {
          sc += qh[x] * k[x];
        }
        scores[h * stride + i] = sc;
      }
    }
  });
  for (int64_t h = 0; h < s.heads; ++h) {
    float* sh = scores + h * stride;
    vf top = splat(-INFINITY);
    int64_t i = 0;
    for (; i + W <= n; i += W) {
      vf v;
      std::memcpy(&v, sh + i, sizeof(v));
      top = v > top ? v : top;
    }
    float m = hmax(top);
    for (; i < n; ++i) {
      m = std::max(m, sh[i]);
    }
    const float inv = 1.0f / softmax_numerators(sh, n, m);
    for (i = 0; i < n; ++i) {
      sh[i] *= inv;
    }
  }
  std::fill(acc, acc + s.heads * dim, 0.0f);
  for_each_token(k_base + s.half_stride, table, first, len, s, [&](const scalar_t* v_row, int64_t i) {
    widen_row(v_row, s.token_stride, row);
    for (int64_t g = 0; g < s.kv_heads; ++g) {
      const float* v = row + g * dim;
      for (int64_t h = g * group; h < (g + 1) * group; ++h) {
        const float p = scores[h * stride + i];
        float* a = acc + h * dim;
        for (int64_t x = 0; x < vec_dim; x += W) {
          vf av, vv;
          std::memcpy(&av, a + x, sizeof(av));
          std::memcpy(&vv, v + x, sizeof(vv));
          av += p * vv;
          std::memcpy(a + x, &av, sizeof(av));
        }
        for (int64_t x = vec_dim; x < dim; ++x) {
          a[x] += p * v[x];
        }
      }
    }
  });
  scalar_t* ob = out + b * s.heads * dim;
  for (int64_t i = 0; i < s.heads * dim; ++i) {
    ob[i] = static_cast<scalar_t>(acc[i]);
  }
}

template <typename scalar_t>
void decode_kernel(
    const scalar_t* q, const scalar_t* cache, scalar_t* out, const int64_t* tables,
    const int64_t* seq_lens, int64_t batch, const Shape& s, float scale, int64_t window) {
  at::parallel_for(0, batch, 1, [&](int64_t begin, int64_t end) {
    Scratch scratch;
    for (int64_t b = begin; b < end; ++b) {
      const int64_t len = seq_lens[b];
      const int64_t* table = tables + b * s.max_blocks;
      switch (s.dim) {
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
  auto out = torch::zeros_like(qc);
  const int64_t dim = qc.size(2);
  const int64_t token_stride = kv_heads * dim;
  const int64_t half_stride = cache.size(3) * token_stride;
  const Shape shape{heads,
                    kv_heads,
                    dim,
                    token_stride,
                    half_stride,
                    cache.size(1) * 2 * half_stride,
                    layer * 2 * half_stride,
                    cache.size(3),
                    tables.size(1)};
  auto run = [&](auto zero) {
    using scalar_t = decltype(zero);
    decode_kernel<scalar_t>(
        qc.data_ptr<scalar_t>(), cache.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
        tables.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), qc.size(0), shape,
        static_cast<float>(scale), window);
  };
  switch (q.scalar_type()) {
    case at::kFloat:
      run(float{});
      break;
    case at::kBFloat16:
      run(c10::BFloat16{});
      break;
    case at::kHalf:
      run(c10::Half{});
      break;
    default:
      TORCH_CHECK(false, "paged_decode_attention: float32, bfloat16 or float16, got ",
                  q.scalar_type());
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention);
}
