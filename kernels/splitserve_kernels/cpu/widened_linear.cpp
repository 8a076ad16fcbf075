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
// memory) and once into an L2-resident float copy where many do (prefill, bound by FLOPs). Up to
// MULTI_ROWS rows read several panels in one pass: one core pulls weights from memory faster
// with several streams in flight than with one.
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
constexpr int64_t MULTI_ROWS = 8;  // rows up to which panels are read several at a time ...
constexpr int64_t MULTI_BLOCK = 4;  // ... by row blocks of up to this many

// Panels read at once by row blocks of `rows` rows (1..MULTI_BLOCK): 2 * rows * panels
// accumulators, at most 24 (8 panels at one row measured faster than 4 and 2).
constexpr int multi_panels(int64_t rows) { return rows == 1 ? 8 : rows <= 3 ? 4 : 3; }
static_assert(2 * multi_panels(2) <= MR && 4 * multi_panels(4) <= MR,
              "the row blocks of a multi-panel pass fit in a tile of MR rows of 32");

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

// tile[(q * R + r) * 32 + 0:32] = sum over k of x[r][k] * panel_q[k][0:32], for R rows of x (row
// stride ldx) and P panels (panel q at panel + q * stride), their weight streams in flight
// together.
template <int R, int P, typename w_t>
void multi_block(const float* x, int64_t ldx, const w_t* panel, int64_t stride, int64_t K,
                 float* tile) {
  vf acc[P][R][2];
  for (int q = 0; q < P; ++q) {
    for (int r = 0; r < R; ++r) acc[q][r][0] = acc[q][r][1] = vf{};
  }
  for (int64_t k = 0; k < K; ++k) {
    // Panels stream from memory: ask for their lines ahead of use (distances of 16 to 128 steps
    // measured alike, BENCHMARKS.md).
    for (int q = 0; q < P; ++q) __builtin_prefetch(panel + q * stride + (k + PREFETCH_K) * NR);
    for (int q = 0; q < P; ++q) {
      const vf w0 = widen16(panel + q * stride + k * NR);
      const vf w1 = widen16(panel + q * stride + k * NR + W);
      for (int r = 0; r < R; ++r) {
        const vf xr = broadcast(x[r * ldx + k]);
        acc[q][r][0] += xr * w0;
        acc[q][r][1] += xr * w1;
      }
    }
  }
  for (int q = 0; q < P; ++q) {
    for (int r = 0; r < R; ++r) {
      store(tile + (q * R + r) * NR, acc[q][r][0]);
      store(tile + (q * R + r) * NR + W, acc[q][r][1]);
    }
  }
}

// One panel: tile[r][0:32] for R rows.
template <int R, typename w_t>
void block(const float* x, int64_t ldx, const w_t* panel, int64_t K, float* tile) {
  multi_block<R, 1>(x, ldx, panel, 0, K, tile);
}

template <typename w_t, int... Rs>
constexpr auto block_table(std::integer_sequence<int, Rs...>) {
  using Fn = void (*)(const float*, int64_t, const w_t*, int64_t, float*);
  return std::array<Fn, sizeof...(Rs)>{&block<Rs + 1, w_t>...};
}

// out[r][n0 : n0 + width] = tile[r] (+ bias), rounded once, for `rows` rows of a tile.
template <typename scalar_t>
void write_tile(const float* tile, int64_t rows, const scalar_t* bias, scalar_t* out, int64_t N,
                int64_t n0) {
  const int64_t width = std::min(NR, N - n0);
  for (int64_t i = 0; i < rows; ++i) {
    scalar_t* dst = out + i * N + n0;
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

// R rows (at most `step` rows, a multi_panels(step) group's row block) against P panels.
template <typename w_t>
void multi_dispatch(int64_t r, int P, const float* x, int64_t K, const w_t* panel, float* tile) {
  const int64_t stride = K * NR;
  if (P == 8) {
    multi_block<1, 8>(x, K, panel, stride, K, tile);
  } else if (P == 4) {
    switch (r) {
      case 1: multi_block<1, 4>(x, K, panel, stride, K, tile); break;
      case 2: multi_block<2, 4>(x, K, panel, stride, K, tile); break;
      default: multi_block<3, 4>(x, K, panel, stride, K, tile); break;
    }
  } else {
    switch (r) {
      case 1: multi_block<1, 3>(x, K, panel, stride, K, tile); break;
      case 2: multi_block<2, 3>(x, K, panel, stride, K, tile); break;
      case 3: multi_block<3, 3>(x, K, panel, stride, K, tile); break;
      default: multi_block<4, 3>(x, K, panel, stride, K, tile); break;
    }
  }
}

// Up to MULTI_ROWS rows: panels [p0, p1) P at a time, each group by row blocks of even size up
// to MULTI_BLOCK (the later blocks read the group from L2); the panels left over one at a time.
template <typename scalar_t>
void few_rows(const float* x, const scalar_t* panels, const scalar_t* bias, scalar_t* out,
              int64_t rows, int64_t N, int64_t K, int64_t p0, int64_t p1) {
  static constexpr auto blocks = block_table<scalar_t>(std::make_integer_sequence<int, MR>{});
  alignas(64) float tile[MR * NR];
  const int64_t row_blocks = (rows + MULTI_BLOCK - 1) / MULTI_BLOCK;
  const int64_t step = (rows + row_blocks - 1) / row_blocks;
  const int P = multi_panels(step);
  int64_t p = p0;
  for (; p + P <= p1; p += P) {
    for (int64_t r0 = 0; r0 < rows; r0 += step) {
      const int64_t r = std::min(step, rows - r0);
      multi_dispatch(r, P, x + r0 * K, K, panels + p * K * NR, tile);
      for (int q = 0; q < P; ++q) {
        write_tile(tile + q * r * NR, r, bias, out + r0 * N, N, (p + q) * NR);
      }
    }
  }
  for (; p < p1; ++p) {
    blocks[rows - 1](x, K, panels + p * K * NR, K, tile);
    write_tile(tile, rows, bias, out, N, p * NR);
  }
}

template <typename scalar_t>
void run(const float* x, const scalar_t* panels, const scalar_t* bias, scalar_t* out, int64_t M,
         int64_t N, int64_t K) {
  static constexpr auto blocks = block_table<scalar_t>(std::make_integer_sequence<int, MR>{});
  static constexpr auto wide_blocks = block_table<float>(std::make_integer_sequence<int, MR>{});
  const int64_t num_panels = (N + NR - 1) / NR;
  // Rows per pass over the panels: their widened x (at most about 512 KiB) stays in the core's
  // L2 while every panel streams past it once. The passes share the rows evenly (64 rows at
  // K = 2048: two of 32, not 60 and 4): each pass reads every panel again, and a short one does
  // so for few rows.
  const int64_t max_chunk = std::max<int64_t>(MR, (int64_t{1} << 19) / (4 * K) / MR * MR);
  const int64_t passes = (M + max_chunk - 1) / max_chunk;
  const int64_t chunk = (M + passes - 1) / passes;
  for (int64_t m0 = 0; m0 < M; m0 += chunk) {
    const int64_t rows = std::min(chunk, M - m0);
    // Row blocks of even size (16 rows: two of 8, not 12 and 4): a short block does as many
    // loads and widenings per k step as a full one for fewer multiply-adds.
    const int64_t row_blocks = (rows + MR - 1) / MR;
    const int64_t step = (rows + row_blocks - 1) / row_blocks;
    at::parallel_for(0, num_panels, 1, [&](int64_t p0, int64_t p1) {
      if (rows <= MULTI_ROWS) {
        few_rows(x + m0 * K, panels, bias, out + m0 * N, rows, N, K, p0, p1);
        return;
      }
      alignas(64) float tile[MR * NR];
      // Many row blocks read each panel: widen it once, into a float copy that stays in L2. For
      // two or three the copy's stores cost more than the widening they save.
      std::vector<float> widened(row_blocks >= COPY_ROW_BLOCKS ? K * NR : 0);
      for (int64_t p = p0; p < p1; ++p) {
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
          write_tile(tile, r, bias, out + (m0 + r0) * N, N, p * NR);
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
