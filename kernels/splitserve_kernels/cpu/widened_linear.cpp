// Linear layers with bfloat16 or float16 weights for CPUs without matmul instructions for those
// types (no AVX512-BF16, AMX or AVX512-FP16), where oneDNN's half-precision matmuls run far below
// float32's rate. The weights stay half precision in memory (half of float32's bytes for a
// memory-bound decode step) and widen to float in registers; products accumulate in float, the
// bias is added in float and the result rounds once to the dtype, as the reference (a float32
// matmul of the widened operands) rounds.
//
// The weight comes packed in panels of 32 output features, [ceil(N / 32), K, 32] (the
// reference's pack_panels), so that each k step loads 32 consecutive weights. The microkernel
// holds a block of up to MR rows by 32 outputs in registers. x is widened to float once per call;
// a panel is widened in registers where a few row blocks read it (decode's rows, bound by
// memory) and once into an L2-resident float copy where many do (prefill, bound by FLOPs).
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <array>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "dtypes.h"
#include "vec.h"

using namespace splitserve;

namespace {

constexpr int64_t NR = 32;  // outputs per panel
constexpr int MR = 12;      // rows per register block: 2 * MR accumulators, 2 weight vectors
constexpr int64_t PREFETCH_K = 16;  // k steps (64-byte lines of a panel) fetched ahead
constexpr int64_t COPY_ROW_BLOCKS = 4;  // row blocks from which a panel is widened once

// The generic vector code widens bfloat16 in 128-bit pieces and broadcasts through an add of
// zero; with AVX-512 one instruction does each.
template <typename w_t>
inline vf widen16(const w_t* p) {
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<w_t, c10::BFloat16>) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return reinterpret_cast<vf>(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
  }
#endif
  return load16(p);
}

inline vf broadcast(float x) {
#if defined(__AVX512F__)
  return reinterpret_cast<vf>(_mm512_set1_ps(x));
#else
  return splat(x);
#endif
}

// tile[r][0:32] = sum over k of x[r][k] * panel[k][0:32], for R rows of x (row stride ldx).
template <int R, typename w_t>
void block(const float* x, int64_t ldx, const w_t* panel, int64_t K, float* tile) {
  vf lo[R], hi[R];
  for (int r = 0; r < R; ++r) lo[r] = hi[r] = vf{};
  for (int64_t k = 0; k < K; ++k) {
    // A panel streams from memory: ask for its lines ahead of use (distances of 16 to 128 steps
    // measured alike, BENCHMARKS.md).
    __builtin_prefetch(panel + (k + PREFETCH_K) * NR);
    const vf w0 = widen16(panel + k * NR);
    const vf w1 = widen16(panel + k * NR + W);
    for (int r = 0; r < R; ++r) {
      const vf xr = broadcast(x[r * ldx + k]);
      lo[r] += xr * w0;
      hi[r] += xr * w1;
    }
  }
  for (int r = 0; r < R; ++r) {
    store(tile + r * NR, lo[r]);
    store(tile + r * NR + W, hi[r]);
  }
}

template <typename w_t, int... Rs>
constexpr auto block_table(std::integer_sequence<int, Rs...>) {
  using Fn = void (*)(const float*, int64_t, const w_t*, int64_t, float*);
  return std::array<Fn, sizeof...(Rs)>{&block<Rs + 1, w_t>...};
}

template <typename scalar_t>
void run(const float* x, const scalar_t* panels, const scalar_t* bias, scalar_t* out, int64_t M,
         int64_t N, int64_t K) {
  static constexpr auto blocks = block_table<scalar_t>(std::make_integer_sequence<int, MR>{});
  static constexpr auto wide_blocks = block_table<float>(std::make_integer_sequence<int, MR>{});
  const int64_t num_panels = (N + NR - 1) / NR;
  // Rows per pass over the panels: their widened x (about 512 KiB) stays in the core's L2 while
  // every panel streams past it once.
  const int64_t chunk = std::max<int64_t>(MR, (int64_t{1} << 19) / (4 * K) / MR * MR);
  for (int64_t m0 = 0; m0 < M; m0 += chunk) {
    const int64_t rows = std::min(chunk, M - m0);
    // Row blocks of even size (16 rows: two of 8, not 12 and 4): a short block does as many
    // loads and widenings per k step as a full one for fewer multiply-adds.
    const int64_t row_blocks = (rows + MR - 1) / MR;
    const int64_t step = (rows + row_blocks - 1) / row_blocks;
    at::parallel_for(0, num_panels, 1, [&](int64_t p0, int64_t p1) {
      alignas(64) float tile[MR * NR];
      // Many row blocks read each panel: widen it once, into a float copy that stays in L2. For
      // two or three the copy's stores cost more than the widening they save.
      std::vector<float> widened(row_blocks >= COPY_ROW_BLOCKS ? K * NR : 0);
      for (int64_t p = p0; p < p1; ++p) {
        const int64_t n0 = p * NR, width = std::min(NR, N - n0);
        const scalar_t* panel = panels + p * K * NR;
        if (!widened.empty()) {
          for (int64_t i = 0; i < K * NR; i += W) store(widened.data() + i, widen16(panel + i));
        }
        for (int64_t r0 = 0; r0 < rows; r0 += step) {
          const int64_t r = std::min(step, rows - r0);
          const float* xr = x + (m0 + r0) * K;
          if (widened.empty()) {
            blocks[r - 1](xr, K, panel, K, tile);
          } else {
            wide_blocks[r - 1](xr, K, widened.data(), K, tile);
          }
          for (int64_t i = 0; i < r; ++i) {
            scalar_t* dst = out + (m0 + r0 + i) * N + n0;
            const float* acc = tile + i * NR;
            if (width == NR && bias == nullptr) {
              store16(dst, load(acc));
              store16(dst + W, load(acc + W));
              continue;
            }
            for (int64_t j = 0; j < width; ++j) {
              const float b = bias == nullptr ? 0.0f : static_cast<float>(bias[n0 + j]);
              dst[j] = static_cast<scalar_t>(acc[j] + b);
            }
          }
        }
      }
    });
  }
}

}  // namespace

torch::Tensor widened_linear(torch::Tensor x, torch::Tensor panels, c10::optional<torch::Tensor> bias,
                             int64_t out_features) {
  TORCH_CHECK(x.dim() == 2 && panels.dim() == 3 && panels.size(2) == NR &&
                  panels.size(1) == x.size(1) && panels.is_contiguous(),
              "widened_linear: x [M, K] and contiguous panels [ceil(N / 32), K, 32]");
  TORCH_CHECK(panels.size(0) == (out_features + NR - 1) / NR,
              "widened_linear: panels hold ", panels.size(0) * NR, " outputs, not ", out_features);
  TORCH_CHECK(x.scalar_type() == panels.scalar_type() &&
                  (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf),
              "widened_linear: x and panels of one dtype, bfloat16 or float16");
  const torch::Tensor b = bias.has_value() ? bias->contiguous() : torch::Tensor();
  TORCH_CHECK(!b.defined() || (b.numel() == out_features && b.scalar_type() == x.scalar_type()),
              "widened_linear: bias [N] of x's dtype");
  const int64_t M = x.size(0), K = x.size(1);
  const torch::Tensor xf = x.to(at::kFloat).contiguous();
  torch::Tensor out = torch::empty({M, out_features}, x.options());
  by_dtype(x, "widened_linear", [&](auto zero) {
    using scalar_t = decltype(zero);
    if constexpr (!std::is_same_v<scalar_t, float>) {
      run<scalar_t>(xf.data_ptr<float>(), panels.data_ptr<scalar_t>(),
                    b.defined() ? b.data_ptr<scalar_t>() : nullptr, out.data_ptr<scalar_t>(), M,
                    out_features, K);
    }
  });
  return out;
}
