// Vectors of 16 floats for the CPU kernels: GCC vector extensions, so -march=native makes them
// AVX-512 where the CPU has it and narrower registers elsewhere, with one code path.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace splitserve {

constexpr int64_t W = 16;  // floats per vector
typedef float vf __attribute__((vector_size(W * sizeof(float))));
typedef int32_t vi __attribute__((vector_size(W * sizeof(int32_t))));
typedef uint32_t vu __attribute__((vector_size(W * sizeof(uint32_t))));
typedef uint16_t vh __attribute__((vector_size(W * sizeof(uint16_t))));
typedef _Float16 vhf __attribute__((vector_size(W * sizeof(_Float16))));
typedef float vf8 __attribute__((vector_size(8 * sizeof(float))));
typedef float vf4 __attribute__((vector_size(4 * sizeof(float))));

inline vf splat(float x) { return vf{} + x; }

inline vf load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void store(float* p, vf v) { std::memcpy(p, &v, sizeof(v)); }

// 16 consecutive elements as float32. bfloat16 widens by a shift of its bits.
template <typename scalar_t>
inline vf load16(const scalar_t* p);

template <>
inline vf load16<float>(const float* p) {
  return load(p);
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

template <typename scalar_t>
inline float load1(const scalar_t* p, int64_t i) {
  return static_cast<float>(p[i]);
}

// Rounds each lane to scalar_t's precision, to nearest even, as torch rounds an op's float
// result (NaN aside): chained ops then round where torch's eager ops round.
template <typename scalar_t>
inline vf round_to(vf v);

template <>
inline vf round_to<float>(vf v) {
  return v;
}

template <>
inline vf round_to<c10::BFloat16>(vf v) {
  vu bits;
  std::memcpy(&bits, &v, sizeof(bits));
  bits = (bits + 0x7FFFu + ((bits >> 16) & 1u)) & 0xFFFF0000u;
  std::memcpy(&v, &bits, sizeof(v));
  return v;
}

template <>
inline vf round_to<c10::Half>(vf v) {
  return __builtin_convertvector(__builtin_convertvector(v, vhf), vf);
}

// Stores 16 floats as scalar_t, rounded to nearest even.
template <typename scalar_t>
inline void store16(scalar_t* p, vf v);

template <>
inline void store16<float>(float* p, vf v) {
  store(p, v);
}

template <>
inline void store16<c10::BFloat16>(c10::BFloat16* p, vf v) {
  v = round_to<c10::BFloat16>(v);
  vu bits;
  std::memcpy(&bits, &v, sizeof(bits));
  const vh raw = __builtin_convertvector(bits >> 16, vh);
  std::memcpy(p, &raw, sizeof(raw));
}

template <>
inline void store16<c10::Half>(c10::Half* p, vf v) {
  const vhf raw = __builtin_convertvector(v, vhf);
  std::memcpy(p, &raw, sizeof(raw));
}

inline float hsum(vf v) {
  const vf8 h = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const vf4 f = __builtin_shufflevector(h, h, 0, 1, 2, 3) + __builtin_shufflevector(h, h, 4, 5, 6, 7);
  return (f[0] + f[2]) + (f[1] + f[3]);
}

inline float hmax(vf v) {
  const vf8 h = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7);
  const vf8 g = __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const vf8 m8 = h > g ? h : g;
  const vf4 a = __builtin_shufflevector(m8, m8, 0, 1, 2, 3);
  const vf4 b = __builtin_shufflevector(m8, m8, 4, 5, 6, 7);
  const vf4 m4 = a > b ? a : b;
  return std::max(std::max(m4[0], m4[1]), std::max(m4[2], m4[3]));
}

// Lane j of the result is the sum of the lanes of p[j]: 16 horizontal sums in 15 folds, each
// halving the lanes that belong to one input (8, 4, 2, then 1 per input).
inline vf transpose_sum(const vf (&p)[W]) {
  vf q[8], r[4], s[2];
  for (int i = 0; i < 8; ++i) {
    const vf a = p[2 * i], b = p[2 * i + 1];
    q[i] = __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  }
  for (int i = 0; i < 4; ++i) {
    const vf a = q[2 * i], b = q[2 * i + 1];
    r[i] = __builtin_shufflevector(a, b, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           __builtin_shufflevector(a, b, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  }
  for (int i = 0; i < 2; ++i) {
    const vf a = r[2 * i], b = r[2 * i + 1];
    s[i] = __builtin_shufflevector(a, b, 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
           __builtin_shufflevector(a, b, 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  }
  const vf a = s[0], b = s[1];
  return __builtin_shufflevector(a, b, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         __builtin_shufflevector(a, b, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

// exp to about 2 ulp, x clamped to [-87, 88] (below, about 1.6e-38 instead of 0): 2^n * p(r) with
// r = x - n ln 2, the range reduction and polynomial of Cephes' expf.
inline vf vexp(vf x) {
  x = x < -87.0f ? splat(-87.0f) : x;
  x = x > 88.0f ? splat(88.0f) : x;
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

}  // namespace splitserve
