// FP8 (e4m3) transfer encoding of KV blocks for CPUs: per layer, block, K/V and head, a scale
// that maps the head's largest magnitude to 448, and e4m3 bytes of the scaled values. Same bits
// as the pure-torch reference (splitserve_kernels.reference.fp8): float32 arithmetic throughout,
// e4m3 rounding to nearest even as torch's float8_e4m3fn cast rounds (NaN past 464, the largest
// finite value 448), decoding rounded to the pool's dtype as torch rounds.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <array>
#include <cmath>
#include <cstring>

#include "dtypes.h"
#include "vec.h"

using namespace splitserve;

namespace {

constexpr float kFp8Max = 448.0f;
typedef uint8_t vb __attribute__((vector_size(W)));

// The e4m3 bits of |value| (in bits, sign cleared) below the NaN range, one lane each. Normal
// values round the mantissa to 3 bits at bit 20 and rebias the exponent (127 -> 7); values
// under 2^-6 are multiples of 2^-9, rounded by the float adder (the 1.5 * 2^23 trick).
inline vu e4m3_magnitude(vu a) {
  const vu normal = ((a + 0x7FFFFu + ((a >> 20) & 1u)) >> 20) - (120u << 3);
  vf scaled;
  std::memcpy(&scaled, &a, sizeof(scaled));
  scaled = scaled * 512.0f + 12582912.0f;
  vu sub;
  std::memcpy(&sub, &scaled, sizeof(sub));
  sub -= 0x4B400000u;
  vu out = (a >= 0x3C800000u) ? normal : sub;
  return (a > 0x43F00000u) ? vu{} + 0x7Fu : out;  // past 480 (and NaN): NaN
}

inline vb to_e4m3(vf y) {
  vu bits;
  std::memcpy(&bits, &y, sizeof(bits));
  const vu sign = (bits >> 24) & 0x80u;
  return __builtin_convertvector(e4m3_magnitude(bits & 0x7FFFFFFFu) | sign, vb);
}

inline uint8_t to_e4m3(float y) {
  vf v = splat(y);
  return to_e4m3(v)[0];
}

std::array<float, 256> make_table() {
  std::array<float, 256> table{};
  for (int b = 0; b < 256; ++b) {
    const int exp = (b >> 3) & 15;
    const int mant = b & 7;
    float v = exp == 0 ? std::ldexp(static_cast<float>(mant), -9)
                       : std::ldexp(1.0f + mant / 8.0f, exp - 7);
    if (exp == 15 && mant == 7) {
      v = NAN;
    }
    table[b] = (b & 0x80) ? -v : v;
  }
  return table;
}

const std::array<float, 256> kTable = make_table();

struct Geometry {
  int64_t block_size, heads, dim;
  int64_t slot() const { return block_size * heads * dim; }  // one K or V of one block
};

template <typename scalar_t>
void encode_one(const scalar_t* x, uint8_t* q, float* scales, const Geometry& g) {
  const int64_t vec_d = g.dim - g.dim % W;
  for (int64_t h = 0; h < g.heads; ++h) {
    vf top = vf{};
    float tail = 0.0f;
    for (int64_t t = 0; t < g.block_size; ++t) {
      const scalar_t* row = x + (t * g.heads + h) * g.dim;
      for (int64_t d = 0; d < vec_d; d += W) {
        const vf v = load16(row + d);
        const vf a = v < 0 ? -v : v;
        top = a > top ? a : top;
      }
      for (int64_t d = vec_d; d < g.dim; ++d) {
        tail = std::max(tail, std::fabs(load1(row, d)));
      }
    }
    const float amax = std::max(hmax(top), tail);
    const float factor = amax == 0.0f ? 1.0f : kFp8Max / amax;
    scales[h] = amax / kFp8Max;
    for (int64_t t = 0; t < g.block_size; ++t) {
      const int64_t at = (t * g.heads + h) * g.dim;
      for (int64_t d = 0; d < vec_d; d += W) {
        const vb bytes = to_e4m3(load16(x + at + d) * factor);
        std::memcpy(q + at + d, &bytes, sizeof(bytes));
      }
      for (int64_t d = vec_d; d < g.dim; ++d) {
        q[at + d] = to_e4m3(load1(x, at + d) * factor);
      }
    }
  }
}

template <typename scalar_t>
void decode_one(const uint8_t* q, const float* scales, scalar_t* x, const Geometry& g) {
  const int64_t vec_d = g.dim - g.dim % W;
  for (int64_t t = 0; t < g.block_size; ++t) {
    for (int64_t h = 0; h < g.heads; ++h) {
      const int64_t at = (t * g.heads + h) * g.dim;
      const float scale = scales[h];
      for (int64_t d = 0; d < vec_d; d += W) {
        vf v;
        for (int64_t j = 0; j < W; ++j) {
          v[j] = kTable[q[at + d + j]];
        }
        store16(x + at + d, v * scale);
      }
      for (int64_t d = vec_d; d < g.dim; ++d) {
        x[at + d] = static_cast<scalar_t>(kTable[q[at + d]] * scale);
      }
    }
  }
}

struct Plan {
  Geometry g;
  int64_t layers, n, pool_blocks, wire_blocks;
  const int64_t* pool_ids;
  const int64_t* wire_ids;

  // fn(pool slot, wire slot) for every layer, block pair and K/V, in parallel; a slot is one
  // K or V of one layer and block (``g.slot()`` values).
  template <typename Fn>
  void for_each_slot(Fn&& fn) const {
    at::parallel_for(0, layers * n * 2, 1, [&](int64_t begin, int64_t end) {
      for (int64_t item = begin; item < end; ++item) {
        const int64_t kv = item % 2, i = item / 2 % n, layer = item / 2 / n;
        const int64_t pool_slot = (layer * pool_blocks + pool_ids[i]) * 2 + kv;
        fn(pool_slot, (layer * wire_blocks + wire_ids[i]) * 2 + kv);
      }
    });
  }
};

// Checks the tensors; pool_ids and wire_ids must stay alive (contiguous int64) while the plan is.
Plan check(const torch::Tensor& pool, const torch::Tensor& q, const torch::Tensor& scales,
           const torch::Tensor& pool_ids, const torch::Tensor& wire_ids, const char* name) {
  TORCH_CHECK(pool.dim() == 6 && q.dim() == 6, name, ": pool and wire blocks are 6-d");
  TORCH_CHECK(pool.sizes().slice(2) == q.sizes().slice(2), name, ": pool and wire blocks differ");
  TORCH_CHECK(pool.size(0) == q.size(0) && pool.size(2) == 2, name, ": layers or K/V differ");
  TORCH_CHECK(q.scalar_type() == at::kByte && scales.scalar_type() == at::kFloat, name,
              ": wire blocks are uint8, scales float32");
  TORCH_CHECK(scales.dim() == 4 && scales.size(0) == q.size(0) && scales.size(1) == q.size(1) &&
                  scales.size(2) == 2 && scales.size(3) == q.size(4),
              name, ": scales do not fit the wire blocks");
  TORCH_CHECK(pool.is_contiguous() && q.is_contiguous() && scales.is_contiguous(), name,
              ": contiguous tensors only");
  TORCH_CHECK(pool_ids.scalar_type() == at::kLong && wire_ids.scalar_type() == at::kLong &&
                  pool_ids.is_contiguous() && wire_ids.is_contiguous() &&
                  pool_ids.numel() == wire_ids.numel(),
              name, ": block ids are contiguous int64 lists of one length");
  Plan p{{pool.size(3), pool.size(4), pool.size(5)}, pool.size(0), pool_ids.numel(),
         pool.size(1), q.size(1), pool_ids.data_ptr<int64_t>(), wire_ids.data_ptr<int64_t>()};
  for (int64_t i = 0; i < p.n; ++i) {
    TORCH_CHECK(p.pool_ids[i] >= 0 && p.pool_ids[i] < p.pool_blocks && p.wire_ids[i] >= 0 &&
                    p.wire_ids[i] < p.wire_blocks,
                name, ": block id out of range");
  }
  return p;
}

}  // namespace

void fp8_encode_blocks(torch::Tensor pool, torch::Tensor src_ids, torch::Tensor q,
                       torch::Tensor scales, torch::Tensor dst_ids) {
  src_ids = src_ids.contiguous();
  dst_ids = dst_ids.contiguous();
  const Plan p = check(pool, q, scales, src_ids, dst_ids, "fp8_encode_blocks");
  const int64_t slot = p.g.slot();
  by_dtype(pool, "fp8_encode_blocks", [&](auto zero) {
    using scalar_t = decltype(zero);
    const scalar_t* x = pool.data_ptr<scalar_t>();
    uint8_t* out = q.data_ptr<uint8_t>();
    float* s = scales.data_ptr<float>();
    p.for_each_slot([&](int64_t from, int64_t to) {
      encode_one(x + from * slot, out + to * slot, s + to * p.g.heads, p.g);
    });
  });
}

void fp8_decode_blocks(torch::Tensor q, torch::Tensor scales, torch::Tensor src_ids,
                       torch::Tensor pool, torch::Tensor dst_ids) {
  src_ids = src_ids.contiguous();
  dst_ids = dst_ids.contiguous();
  const Plan p = check(pool, q, scales, dst_ids, src_ids, "fp8_decode_blocks");
  const int64_t slot = p.g.slot();
  by_dtype(pool, "fp8_decode_blocks", [&](auto zero) {
    using scalar_t = decltype(zero);
    scalar_t* x = pool.data_ptr<scalar_t>();
    const uint8_t* in = q.data_ptr<uint8_t>();
    const float* s = scales.data_ptr<float>();
    p.for_each_slot([&](int64_t to, int64_t from) {
      decode_one(in + from * slot, s + from * p.g.heads, x + to * slot, p.g);
    });
  });
}
