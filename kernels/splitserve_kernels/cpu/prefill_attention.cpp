// Prefill attention read straight from the layer-major paged KV cache, for CPUs: causal (queries
// aligned to the end of their keys, so a cached prefix comes first), GQA-aware and tiled in the
// manner of flash attention, without gathering a sequence's keys first.
//
// A work item is one sequence, one kv head and a tile of up to kTile of its new tokens; its rows
// are the tile's tokens times the query heads that share the kv head, so each key is read once
// for the whole group. Keys and values come kKeys at a time (a key block), packed from their
// cache blocks into per-thread tiles. Rows go through each key block kRows at a time, in one
// pass whose scores never leave registers:
// - scores of the rows against the keys they can see (a block that crosses the rows' positions
//   is cut at the last one). With AVX512-BF16, bfloat16 queries and keys (packed as pairs of
//   dims per key) are multiplied in pairs without widening; otherwise float32 FMAs on widened
//   keys;
// - an online softmax per row: a running max and sum, the row's output rescaled as it is next
//   accumulated; the mask runs only on blocks that reach past a row's position or its window;
// - values: the probabilities (rounded to bfloat16 pairs with AVX512-BF16, as the eager
//   bfloat16 attention rounds them, else float32) times the packed values, into float32
//   outputs.
// Each row's output is divided by its sum at the end. Items go to threads in contiguous runs of
// about equal work. The pure-torch reference is
// splitserve_kernels.reference.attention.paged_prefill_attention.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <immintrin.h>

#include <vector>

#include "dtypes.h"
#include "scratch.h"
#include "vec.h"

using namespace splitserve;

namespace {

constexpr int64_t kKeys = 4 * W;  // keys per key block: four vectors of scores per row
constexpr int64_t kTile = 64;     // new tokens per work item
constexpr int kRows = 4;          // rows taken together: 16 accumulators of scores or outputs

#ifdef __AVX512BF16__
constexpr bool kBf16Dot = true;
#else
constexpr bool kBf16Dot = false;
#endif

// Whether products run on bfloat16 pairs (AVX512-BF16) rather than on widened floats.
template <typename scalar_t>
constexpr bool pairs() {
  return kBf16Dot && std::is_same_v<scalar_t, c10::BFloat16>;
}

struct Geometry {
  int64_t heads, kv_heads, group, dim, token_stride, half_stride, block_stride, layer_offset;
  int64_t block_size;
};

struct Item {
  int64_t seq, kv_head, first, count;  // new tokens [first, first + count) of the sequence
};

using Scratch = splitserve::Scratch<4>;

// The rows of one work item and where they live: row r is token r / group of the tile, query
// head kv_head * group + r % group.
template <typename scalar_t>
struct Rows {
  const scalar_t* q;  // the tile's first token's first query head of this kv head
  scalar_t* out;      // the same place in the output
  int64_t group, token_stride, dim;

  int64_t offset(int64_t r) const { return (r / group) * token_stride + (r % group) * dim; }
};

// Keys (or values, `half` 1) of tokens [k0, k0 + n) of one kv head of a sequence, packed:
// pairs(): keys as uint32 [dim / 2][kKeys] (a pair of dims per key, keys along a vector), values
// as uint32 [kKeys / 2][dim] (a pair of keys per dim); else float32 keys [dim][kKeys] and
// values [kKeys][dim]. Keys past n are zero.
template <typename scalar_t, int64_t kDim>
void pack_block(
    const scalar_t* layer, const int64_t* table, int64_t kv_head, int64_t k0, int64_t n,
    const Geometry& g, float* keys, float* values) {
  const auto row = [&](int64_t t, int64_t half) {
    return layer + half * g.half_stride + table[t / g.block_size] * g.block_stride +
           (t % g.block_size) * g.token_stride + kv_head * kDim;
  };
  if constexpr (pairs<scalar_t>()) {
    auto* kp = reinterpret_cast<uint32_t*>(keys);
    auto* vp = reinterpret_cast<uint32_t*>(values);
    for (int64_t j = 0; j < kKeys; ++j) {
      const auto* k = j < n ? reinterpret_cast<const uint32_t*>(row(k0 + j, 0)) : nullptr;
      for (int64_t p = 0; p < kDim / 2; ++p) {
        kp[p * kKeys + j] = k ? k[p] : 0u;
      }
    }
    const vh zero{};
    for (int64_t j = 0; j < kKeys; j += 2) {
      const scalar_t* a = j < n ? row(k0 + j, 1) : nullptr;
      const scalar_t* b = j + 1 < n ? row(k0 + j + 1, 1) : nullptr;
      for (int64_t x = 0; x < kDim; x += W) {
        vh lo = zero, hi = zero;
        if (a) std::memcpy(&lo, a + x, sizeof(lo));
        if (b) std::memcpy(&hi, b + x, sizeof(hi));
        const vu both = __builtin_convertvector(lo, vu) | (__builtin_convertvector(hi, vu) << 16);
        std::memcpy(vp + (j / 2) * kDim + x, &both, sizeof(both));
      }
    }
  } else {
    for (int64_t j = 0; j < kKeys; ++j) {
      const scalar_t* k = j < n ? row(k0 + j, 0) : nullptr;
      const scalar_t* v = j < n ? row(k0 + j, 1) : nullptr;
      for (int64_t x = 0; x < kDim; ++x) {
        keys[x * kKeys + j] = k ? load1(k, x) : 0.0f;
      }
      for (int64_t x = 0; x < kDim; x += W) {
        store(values + j * kDim + x, v ? load16(v + x) : splat(0.0f));
      }
    }
  }
}

// Scores of rows [r0, r0 + R) against the first NV vectors of keys of a packed block, times
// `scale`, into registers. `qf` is the float rows (scaled already) where !pairs().
template <typename scalar_t, int64_t kDim, int R, int NV>
inline void scores(
    const Rows<scalar_t>& rows, const float* qf, int64_t r0, const float* keys, float scale,
    vf (&s)[R][4]) {
  if constexpr (pairs<scalar_t>()) {
#ifdef __AVX512BF16__
    __m512 acc[R][NV];
    const uint32_t* q[R];
    for (int r = 0; r < R; ++r) {
      q[r] = reinterpret_cast<const uint32_t*>(rows.q + rows.offset(r0 + r));
      for (int c = 0; c < NV; ++c) acc[r][c] = _mm512_setzero_ps();
    }
    const auto* kp = reinterpret_cast<const uint32_t*>(keys);
    for (int64_t p = 0; p < kDim / 2; ++p) {
      __m512bh k[NV];
      for (int c = 0; c < NV; ++c) {
        k[c] = (__m512bh)_mm512_loadu_si512(kp + p * kKeys + c * W);
      }
      for (int r = 0; r < R; ++r) {
        const auto qb = (__m512bh)_mm512_set1_epi32(static_cast<int>(q[r][p]));
        for (int c = 0; c < NV; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], qb, k[c]);
      }
    }
    for (int r = 0; r < R; ++r) {
      for (int c = 0; c < NV; ++c) s[r][c] = (vf)acc[r][c] * scale;
    }
#endif
  } else {
    vf acc[R][NV];
    for (int r = 0; r < R; ++r) {
      for (int c = 0; c < NV; ++c) acc[r][c] = splat(0.0f);
    }
    for (int64_t x = 0; x < kDim; ++x) {
      vf k[NV];
      for (int c = 0; c < NV; ++c) k[c] = load(keys + x * kKeys + c * W);
      for (int r = 0; r < R; ++r) {
        const vf qx = splat(qf[(r0 + r) * kDim + x]);
        for (int c = 0; c < NV; ++c) acc[r][c] += qx * k[c];
      }
    }
    for (int r = 0; r < R; ++r) {
      for (int c = 0; c < NV; ++c) s[r][c] = acc[r][c];
    }
  }
}

// The online softmax step of one row over NV vectors of scores of a key block starting at key
// k0: masks keys past `pos` (and at or before pos - window) where `masked`, updates the row's
// max m and sum l, returns the rescale factor of its earlier output, and writes the
// probabilities to p: bfloat16 where pairs() (as the eager bfloat16 attention rounds them),
// else float32.
template <typename scalar_t, int NV>
inline float softmax_step(
    vf (&v)[4], int64_t k0, int64_t pos, int64_t window, bool masked, float& m, float& l,
    float* p) {
  if (masked) {
    const vi lanes{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    const vi newest = vi{} + static_cast<int32_t>(pos);
    const vi oldest = vi{} + static_cast<int32_t>(window > 0 ? pos - window : -1);
    for (int c = 0; c < NV; ++c) {
      const vi key = lanes + static_cast<int32_t>(k0 + c * W);
      v[c] = (key <= newest) & (key > oldest) ? v[c] : splat(-INFINITY);
    }
  }
  vf top = v[0];
  for (int c = 1; c < NV; ++c) top = v[c] > top ? v[c] : top;
  const float m_new = std::max(m, hmax(top));
  float alpha = 1.0f;
  if (m_new == -INFINITY) {  // no key of this row yet
    for (int c = 0; c < NV; ++c) v[c] = splat(0.0f);
  } else {
    alpha = m == -INFINITY ? 0.0f : std::exp(m - m_new);
    vf sum = splat(0.0f);
    for (int c = 0; c < NV; ++c) {
      v[c] = v[c] == splat(-INFINITY) ? splat(0.0f) : vexp(v[c] - m_new);
      sum += v[c];
    }
    l = l * alpha + hsum(sum);
    m = m_new;
  }
  if constexpr (pairs<scalar_t>()) {
#ifdef __AVX512BF16__
    for (int c = 0; c < NV; c += 2) {
      const __m512 hi = c + 1 < NV ? (__m512)v[c + 1] : _mm512_setzero_ps();
      _mm512_storeu_si512(p + c * W / 2, (__m512i)_mm512_cvtne2ps_pbh(hi, (__m512)v[c]));
    }
#endif
  } else {
    for (int c = 0; c < NV; ++c) store(p + c * W, v[c]);
  }
  return alpha;
}

// o[r] = o[r] * alpha[r] + p[r] . values for R rows of outputs (`o` the first), over the
// first n keys of a block: dims [x0, x0 + X) of the head. p's rows are kKeys floats apart and
// hold bfloat16 probabilities where pairs(), float32 otherwise.
template <typename scalar_t, int64_t kDim, int R, int X>
inline void accumulate(
    const float* p, const float* values, const float (&alpha)[R], int64_t n, int64_t x0,
    float* o) {
  if constexpr (pairs<scalar_t>()) {
#ifdef __AVX512BF16__
    __m512 acc[R][X];
    for (int r = 0; r < R; ++r) {
      const __m512 a = _mm512_set1_ps(alpha[r]);
      for (int x = 0; x < X; ++x) {
        acc[r][x] = _mm512_mul_ps(_mm512_loadu_ps(o + r * kDim + x0 + x * W), a);
      }
    }
    const auto* vp = reinterpret_cast<const uint32_t*>(values) + x0;
    const auto* pp = reinterpret_cast<const uint32_t*>(p);
    for (int64_t j = 0; j < (n + 1) / 2; ++j) {
      __m512bh v[X];
      for (int x = 0; x < X; ++x) v[x] = (__m512bh)_mm512_loadu_si512(vp + j * kDim + x * W);
      for (int r = 0; r < R; ++r) {
        const auto pb = (__m512bh)_mm512_set1_epi32(static_cast<int>(pp[r * kKeys + j]));
        for (int x = 0; x < X; ++x) acc[r][x] = _mm512_dpbf16_ps(acc[r][x], pb, v[x]);
      }
    }
    for (int r = 0; r < R; ++r) {
      for (int x = 0; x < X; ++x) _mm512_storeu_ps(o + r * kDim + x0 + x * W, acc[r][x]);
    }
#endif
  } else {
    vf acc[R][X];
    for (int r = 0; r < R; ++r) {
      for (int x = 0; x < X; ++x) acc[r][x] = load(o + r * kDim + x0 + x * W) * alpha[r];
    }
    for (int64_t j = 0; j < n; ++j) {
      vf v[X];
      for (int x = 0; x < X; ++x) v[x] = load(values + j * kDim + x0 + x * W);
      for (int r = 0; r < R; ++r) {
        const vf w = splat(p[r * kKeys + j]);
        for (int x = 0; x < X; ++x) acc[r][x] += w * v[x];
      }
    }
    for (int r = 0; r < R; ++r) {
      for (int x = 0; x < X; ++x) store(o + r * kDim + x0 + x * W, acc[r][x]);
    }
  }
}

// What one work item keeps across its key blocks.
struct State {
  float* o;  // [rows][dim] float32 outputs, not yet divided by l
  float* m;  // [rows] running max of each row's scores
  float* l;  // [rows] running sum of each row's exp(score - m)
};

// One key block (first n keys of the packed tiles, starting at key k0) for rows [r0, r0 + R):
// scores, softmax and values in one pass, the scores in registers. Only the first NV vectors
// of keys are computed: on a block that crosses the rows' positions the later ones are masked.
template <typename scalar_t, int64_t kDim, int R, int NV>
inline void row_group(
    const Rows<scalar_t>& rows, const float* qf, int64_t r0, const float* keys,
    const float* values, int64_t k0, int64_t n, int64_t first_pos, int64_t window, bool masked,
    float scale, const State& st) {
  vf s[R][4];
  scores<scalar_t, kDim, R, NV>(rows, qf, r0, keys, scale, s);
  alignas(64) float p[R * kKeys];
  float alpha[R];
  for (int r = 0; r < R; ++r) {
    const int64_t row = r0 + r;
    alpha[r] = softmax_step<scalar_t, NV>(s[r], k0, first_pos + row / rows.group, window, masked,
                                          st.m[row], st.l[row], p + r * kKeys);
  }
  const int64_t keys_used = std::min<int64_t>(n, NV * W);
  constexpr int X = std::min<int>(4, kDim / W);
  for (int64_t x0 = 0; x0 < kDim; x0 += X * W) {
    accumulate<scalar_t, kDim, R, X>(p, values, alpha, keys_used, x0, st.o + r0 * kDim);
  }
}

// row_group for the number of key vectors the group reaches (1 to 4).
template <typename scalar_t, int64_t kDim, int R>
inline void row_group_of(
    int nv, const Rows<scalar_t>& rows, const float* qf, int64_t r0, const float* keys,
    const float* values, int64_t k0, int64_t n, int64_t first_pos, int64_t window, bool masked,
    float scale, const State& st) {
#define SPLITSERVE_ROW_GROUP(NV)                                                            \
  row_group<scalar_t, kDim, R, NV>(rows, qf, r0, keys, values, k0, n, first_pos, window, \
                                   masked, scale, st)
  switch (nv) {
    case 1:
      SPLITSERVE_ROW_GROUP(1);
      break;
    case 2:
      SPLITSERVE_ROW_GROUP(2);
      break;
    case 3:
      SPLITSERVE_ROW_GROUP(3);
      break;
    default:
      SPLITSERVE_ROW_GROUP(4);
  }
#undef SPLITSERVE_ROW_GROUP
}

template <typename scalar_t, int64_t kDim>
void attend(
    const Item& it, const scalar_t* q, scalar_t* out, const scalar_t* layer, const int64_t* table,
    int64_t n_q, int64_t n_k, int64_t window, float scale, const Geometry& g, Scratch& scratch) {
  const int64_t ctx = n_k - n_q;  // cached keys before the first new token
  const int64_t rows = it.count * g.group;
  const int64_t head0 = it.kv_head * g.group;
  const Rows<scalar_t> rr{q + it.first * g.heads * kDim + head0 * kDim,
                          out + it.first * g.heads * kDim + head0 * kDim, g.group,
                          g.heads * kDim, kDim};
  float* keys = scratch.floats(0, kKeys * kDim);
  float* values = scratch.floats(1, kKeys * kDim);
  float* o = scratch.floats(2, rows * kDim + 2 * rows);
  const State st{o, o + rows * kDim, o + rows * kDim + rows};
  float* qf = nullptr;
  if constexpr (!pairs<scalar_t>()) {
    qf = scratch.floats(3, rows * kDim);
    for (int64_t r = 0; r < rows; ++r) {
      const scalar_t* src = rr.q + rr.offset(r);
      for (int64_t x = 0; x < kDim; x += W) store(qf + r * kDim + x, load16(src + x) * scale);
    }
  }
  std::fill(st.o, st.o + rows * kDim, 0.0f);
  std::fill(st.m, st.m + rows, -INFINITY);
  std::fill(st.l, st.l + rows, 0.0f);
  const int64_t first_pos = ctx + it.first;  // positions of the tile's first and last tokens
  const int64_t last_pos = first_pos + it.count - 1;
  const int64_t lo = window > 0 ? std::max<int64_t>(0, first_pos - window + 1) : 0;
  for (int64_t k0 = lo / kKeys * kKeys; k0 <= last_pos; k0 += kKeys) {
    const int64_t n = std::min(kKeys, last_pos + 1 - k0);
    pack_block<scalar_t, kDim>(layer, table, it.kv_head, k0, n, g, keys, values);
    const bool masked = k0 + kKeys - 1 > first_pos || (window > 0 && k0 <= last_pos - window);
    const auto group = [&](auto r_tag, int64_t r0) {
      constexpr int R = decltype(r_tag)::value;
      // Keys this group reaches: up to its last row's position.
      const int64_t reach = std::min(n, first_pos + (r0 + R - 1) / g.group + 1 - k0);
      if (reach <= 0) return;  // every key of the block is past every row of the group
      const int nv = static_cast<int>((reach + W - 1) / W);
      row_group_of<scalar_t, kDim, R>(nv, rr, qf, r0, keys, values, k0, n, first_pos, window,
                                      masked, scale, st);
    };
    int64_t r = 0;
    for (; r + kRows <= rows; r += kRows) group(std::integral_constant<int, kRows>{}, r);
    for (; r < rows; ++r) group(std::integral_constant<int, 1>{}, r);
  }
  for (int64_t r = 0; r < rows; ++r) {
    const float inv = st.l[r] > 0.0f ? 1.0f / st.l[r] : 0.0f;
    scalar_t* dst = rr.out + rr.offset(r);
    for (int64_t x = 0; x < kDim; x += W) store16(dst + x, load(st.o + r * kDim + x) * inv);
  }
}

// Cuts the items into one contiguous run per thread with about equal work (rows times keys).
std::vector<int64_t> balanced(const std::vector<Item>& items, const std::vector<int64_t>& work) {
  const int64_t parts =
      std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), items.size()));
  int64_t total = 0;
  for (const int64_t w : work) total += w;
  std::vector<int64_t> bounds{0};
  int64_t done = 0;
  for (size_t i = 0; i < items.size(); ++i) {
    done += work[i];
    for (int64_t k = bounds.size(); k < parts && done * parts >= total * k; ++k) {
      bounds.push_back(i + 1);
    }
  }
  while (static_cast<int64_t>(bounds.size()) <= parts) bounds.push_back(items.size());
  return bounds;
}

template <typename scalar_t, int64_t kDim>
void prefill_kernel(
    const scalar_t* q, scalar_t* out, const scalar_t* cache,
    const std::vector<const int64_t*>& tables, const int64_t* cu_q, const int64_t* cu_k, int64_t seqs, int64_t window, float scale,
    const Geometry& g) {
  std::vector<Item> items;
  std::vector<int64_t> work;
  for (int64_t i = 0; i < seqs; ++i) {
    const int64_t n_q = cu_q[i + 1] - cu_q[i];
    const int64_t ctx = cu_k[i + 1] - cu_k[i] - n_q;
    for (int64_t h = 0; h < g.kv_heads; ++h) {
      for (int64_t t = 0; t < n_q; t += kTile) {
        const int64_t count = std::min(kTile, n_q - t);
        const int64_t keys = ctx + t + count;
        const int64_t read = window > 0 ? std::min(keys, window + count) : keys;
        items.push_back({i, h, t, count});
        work.push_back(count * (read + kKeys));
      }
    }
  }
  const std::vector<int64_t> bounds = balanced(items, work);
  const scalar_t* layer = cache + g.layer_offset;
  at::parallel_for(0, static_cast<int64_t>(bounds.size()) - 1, 1, [&](int64_t first, int64_t last) {
    Scratch scratch;
    for (int64_t k = bounds[first]; k < bounds[last]; ++k) {
      const Item& it = items[k];
      const int64_t i = it.seq;
      attend<scalar_t, kDim>(it, q + cu_q[i] * g.heads * kDim, out + cu_q[i] * g.heads * kDim,
                             layer, tables[i], cu_q[i + 1] - cu_q[i], cu_k[i + 1] - cu_k[i],
                             window, scale, g, scratch);
    }
  });
}

}  // namespace

torch::Tensor paged_prefill_attention(
    torch::Tensor q, torch::Tensor cache, int64_t layer, std::vector<torch::Tensor> block_tables,
    torch::Tensor cu_seqlens_q, torch::Tensor cu_seqlens_k, double scale, int64_t window) {
  TORCH_CHECK(q.dim() == 3 && cache.dim() == 6, "q [T, H, D] and cache [L, N, 2, bs, kvh, D]");
  TORCH_CHECK(q.scalar_type() == cache.scalar_type(), "q and cache dtypes differ");
  TORCH_CHECK(cache.is_contiguous(), "cache must be contiguous");
  const int64_t heads = q.size(1), kv_heads = cache.size(4), dim = q.size(2);
  TORCH_CHECK(heads % kv_heads == 0, "heads must be a multiple of kv heads");
  TORCH_CHECK(dim == cache.size(5), "head dims differ");
  TORCH_CHECK(dim == 32 || dim == 64 || dim == 128, "head dim 32, 64 or 128, got ", dim);
  const int64_t seqs = static_cast<int64_t>(block_tables.size());
  auto cu_q = cu_seqlens_q.to(torch::kLong).contiguous();
  auto cu_k = cu_seqlens_k.to(torch::kLong).contiguous();
  TORCH_CHECK(cu_q.numel() == seqs + 1 && cu_k.numel() == seqs + 1, "one table per sequence");
  const int64_t* q_bounds = cu_q.data_ptr<int64_t>();
  const int64_t* k_bounds = cu_k.data_ptr<int64_t>();
  std::vector<torch::Tensor> held;
  std::vector<const int64_t*> tables;
  for (int64_t i = 0; i < seqs; ++i) {
    held.push_back(block_tables[i].to(torch::kLong).contiguous());
    const torch::Tensor& table = held.back();
    const int64_t n_q = q_bounds[i + 1] - q_bounds[i], n_k = k_bounds[i + 1] - k_bounds[i];
    TORCH_CHECK(0 <= n_q && n_q <= n_k, "sequence ", i, ": ", n_q, " queries, ", n_k, " keys");
    TORCH_CHECK(table.numel() * cache.size(3) >= n_k, "sequence ", i, ": ", n_k,
                " keys, block table of ", table.numel());
    const int64_t used = (n_k + cache.size(3) - 1) / cache.size(3);
    const int64_t* ids = table.data_ptr<int64_t>();
    for (int64_t b = 0; b < used; ++b) {
      TORCH_CHECK(0 <= ids[b] && ids[b] < cache.size(1), "block id ", ids[b], " out of range");
    }
    tables.push_back(ids);
  }
  TORCH_CHECK(q_bounds[seqs] == q.size(0), "cu_seqlens_q ends at ", q_bounds[seqs], ", not ",
              q.size(0));
  auto qc = q.contiguous();
  auto out = torch::empty_like(qc);
  const int64_t token_stride = kv_heads * dim;
  const int64_t half_stride = cache.size(3) * token_stride;
  const Geometry g{heads,       kv_heads,    heads / kv_heads,         dim, token_stride,
                   half_stride, 2 * half_stride, layer * cache.stride(0), cache.size(3)};
  by_dtype(q, "paged_prefill_attention", [&](auto zero) {
    using scalar_t = decltype(zero);
    const auto kernel = dim == 32   ? prefill_kernel<scalar_t, 32>
                        : dim == 64 ? prefill_kernel<scalar_t, 64>
                                    : prefill_kernel<scalar_t, 128>;
    kernel(qc.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), cache.data_ptr<scalar_t>(), tables,
           q_bounds, k_bounds, seqs, window,
           static_cast<float>(scale), g);
  });
  return out;
}
