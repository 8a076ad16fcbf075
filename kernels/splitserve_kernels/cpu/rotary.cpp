// Rotary position embedding of the queries and keys of a fused qkv projection, with the keys and
// values written straight into their slots of the layer-major paged KV cache, for CPUs. Rounds
// where the pure-torch reference (reference.rope.apply_rotary, then reference.attention.write_kv)
// rounds: x * cos and rotate_half(x) * sin, then their sum.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include "dtypes.h"
#include "vec.h"

using namespace splitserve;

namespace {

// out = x * cos + rotate_half(x) * sin for one head of dim d (halves of cos/sin repeat).
template <typename scalar_t>
inline void rotate(const scalar_t* x, const scalar_t* cos, const scalar_t* sin, scalar_t* out,
                   int64_t d) {
  const int64_t half = d / 2;
  if (half % W == 0) {
    for (int64_t i = 0; i < half; i += W) {
      const vf lo = load16(x + i), hi = load16(x + half + i);
      const vf c_lo = load16(cos + i), c_hi = load16(cos + half + i);
      const vf s_lo = load16(sin + i), s_hi = load16(sin + half + i);
      store16(out + i, round_to<scalar_t>(lo * c_lo) + round_to<scalar_t>(-hi * s_lo));
      store16(out + half + i, round_to<scalar_t>(hi * c_hi) + round_to<scalar_t>(lo * s_hi));
    }
    return;
  }
  for (int64_t i = 0; i < d; ++i) {
    const float rotated = i < half ? -load1(x, i + half) : load1(x, i - half);
    const float a = static_cast<float>(static_cast<scalar_t>(load1(x, i) * load1(cos, i)));
    const float b = static_cast<float>(static_cast<scalar_t>(rotated * load1(sin, i)));
    out[i] = static_cast<scalar_t>(a + b);
  }
}

struct Sizes {
  int64_t tokens, heads, kv_heads, dim, row, token_stride, half_stride, block_stride, layer_offset;
};

template <typename scalar_t>
void rotary_rows(
    const scalar_t* qkv, const scalar_t* cos, const scalar_t* sin, scalar_t* q_out,
    scalar_t* cache, const int64_t* blocks, const int64_t* offsets, const Sizes& z) {
  at::parallel_for(0, z.tokens, 8, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const scalar_t* row = qkv + t * z.row;
      const scalar_t* c = cos + t * z.dim;
      const scalar_t* s = sin + t * z.dim;
      for (int64_t h = 0; h < z.heads; ++h) {
        rotate(row + h * z.dim, c, s, q_out + (t * z.heads + h) * z.dim, z.dim);
      }
      scalar_t* slot = cache + blocks[t] * z.block_stride + z.layer_offset + offsets[t] * z.token_stride;
      const scalar_t* k = row + z.heads * z.dim;
      for (int64_t g = 0; g < z.kv_heads; ++g) {
        rotate(k + g * z.dim, c, s, slot + g * z.dim, z.dim);
      }
      std::memcpy(slot + z.half_stride, k + z.token_stride, z.token_stride * sizeof(scalar_t));
    }
  });
}

}  // namespace

torch::Tensor rotary_write_kv(
    torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, int64_t heads, torch::Tensor cache,
    int64_t layer, torch::Tensor slot_blocks, torch::Tensor slot_offsets) {
  TORCH_CHECK(cache.dim() == 6 && cache.is_contiguous(), "cache [L, N, 2, bs, kvh, D], contiguous");
  const int64_t kv_heads = cache.size(4), dim = cache.size(5), tokens = qkv.size(0);
  TORCH_CHECK(qkv.dim() == 2 && qkv.is_contiguous() && qkv.size(1) == (heads + 2 * kv_heads) * dim,
              "qkv must be a contiguous [T, (heads + 2 * kv_heads) * head_dim] tensor");
  TORCH_CHECK(qkv.scalar_type() == cache.scalar_type(), "qkv and cache dtypes differ");
  auto c = cos.reshape({tokens, dim}).to(qkv.scalar_type()).contiguous();
  auto s = sin.reshape({tokens, dim}).to(qkv.scalar_type()).contiguous();
  auto blocks = slot_blocks.to(torch::kLong).contiguous();
  auto offsets = slot_offsets.to(torch::kLong).contiguous();
  TORCH_CHECK(blocks.numel() == tokens && offsets.numel() == tokens, "one slot per token");
  auto q = torch::empty({tokens, heads, dim}, qkv.options());
  const int64_t token_stride = kv_heads * dim, half_stride = cache.size(3) * token_stride;
  const Sizes z{tokens,       heads,       kv_heads,
                dim,          qkv.size(1), token_stride,
                half_stride,  2 * half_stride,
                layer * cache.stride(0)};
  by_dtype(qkv, "rotary_write_kv", [&](auto zero) {
    using scalar_t = decltype(zero);
    rotary_rows<scalar_t>(qkv.data_ptr<scalar_t>(), c.data_ptr<scalar_t>(), s.data_ptr<scalar_t>(),
                          q.data_ptr<scalar_t>(), cache.data_ptr<scalar_t>(),
                          blocks.data_ptr<int64_t>(), offsets.data_ptr<int64_t>(), z);
  });
  return q;
}
