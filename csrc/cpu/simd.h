// Vectorisable building blocks of the CPU kernels. Inner loops are written over fixed lane arrays so
// that gcc vectorises them without -ffast-math; the hot ones get an AVX2/FMA clone picked at load time
// (target_clones), because the extension is built for the baseline x86-64 ISA.
#pragma once

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>

#pragma GCC diagnostic ignored "-Wpsabi"  // 32-byte vector helpers are always inlined

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define MEGAGSPO_SIMD_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define MEGAGSPO_SIMD_CLONES
#endif

namespace megagspo::cpu {

constexpr int64_t kChunk = 2048;  // floats per staging chunk: 8 KiB, stays in L1

// exp(d) for d <= ~88, exactly 0 for d < -87 (so exp(-inf) = 0); Cephes expf polynomial, rel. error
// ~1e-7. Branch-free and vectorisable. The caller clamps d >= -100 so that d * 0 stays finite.
// max(a, b) for finite b; b when a is NaN (x - m with x = m = -inf: an all -inf row contributes nothing).
inline float fmax_(float a, float b) { return b < a ? a : b; }
inline float fmin_(float a, float b) { return b < a ? b : a; }

inline float exp_f32(float d) {
  const float dc = fmin_(fmax_(d, -87.0f), 88.0f);
  const float t = dc * 1.44269504088896341f;
  const float n = (t + 12582912.0f) - 12582912.0f;  // round to nearest (|t| < 2^22)
  const float r = (dc - n * 0.693359375f) - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t ni = static_cast<int32_t>(n);
  const float scale = std::bit_cast<float>(static_cast<uint32_t>(ni + 127) << 23);
  const float e = p * scale;  // computed unconditionally: a pure select below (no -ffast-math needed)
  return d < -87.0f ? 0.0f : e;
}

// bfloat16 <-> float32 by bits (round to nearest even on the way down; inputs are finite).
inline float bf16_bits_to_f32(uint16_t u) { return std::bit_cast<float>(static_cast<uint32_t>(u) << 16); }
inline uint16_t f32_to_bf16_bits(float f) {
  uint32_t u = std::bit_cast<uint32_t>(f);
  if (std::isnan(f)) return static_cast<uint16_t>((u >> 16) | 0x40);
  u += ((u >> 16) & 1u) + 0x7FFFu;
  return static_cast<uint16_t>(u >> 16);
}

MEGAGSPO_SIMD_CLONES
static void bf16_to_f32(const uint16_t* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = std::bit_cast<float>(static_cast<uint32_t>(src[i]) << 16);
}

MEGAGSPO_SIMD_CLONES
static void f32_to_bf16(const float* src, uint16_t* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    uint32_t u = std::bit_cast<uint32_t>(src[i]);
    u += ((u >> 16) & 1u) + 0x7FFFu;
    dst[i] = static_cast<uint16_t>(u >> 16);
  }
}

// ---- 8-wide blocks in GCC vector extensions (AVX2 registers in the x86-64-v3 clone, SSE pairs otherwise).
// Plain loops with selects do not vectorise here without -fno-trapping-math, which setup.py does not set.
typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

__attribute__((always_inline)) inline v8f load8(const float* p) {
  v8f v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
__attribute__((always_inline)) inline void store8(float* p, v8f v) { std::memcpy(p, &v, sizeof(v)); }
__attribute__((always_inline)) inline v8f splat8(float x) { return v8f{x, x, x, x, x, x, x, x}; }
__attribute__((always_inline)) inline v8f vmax8(v8f a, v8f b) { return b < a ? a : b; }  // b if a is NaN
__attribute__((always_inline)) inline v8f vmin8(v8f a, v8f b) { return b < a ? b : a; }

// exp_f32 on 8 lanes (same polynomial, same results).
__attribute__((always_inline)) inline v8f exp8(v8f d) {
  const v8f dc = vmin8(vmax8(d, splat8(-87.0f)), splat8(88.0f));
  const v8f t = dc * 1.44269504088896341f;
  const v8f n = (t + 12582912.0f) - 12582912.0f;
  const v8f r = (dc - n * 0.693359375f) - n * -2.12194440e-4f;
  v8f p = splat8(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const v8i ni = __builtin_convertvector(n, v8i);
  const v8f scale = (v8f)((ni + 127) << 23);
  return d < -87.0f ? splat8(0.0f) : p * scale;
}

MEGAGSPO_SIMD_CLONES
static float chunk_max(const float* x, int64_t n) {
  v8f a0 = splat8(-INFINITY), a1 = a0;
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    a0 = vmax8(a0, load8(x + i));
    a1 = vmax8(a1, load8(x + i + 8));
  }
  a0 = vmax8(a0, a1);
  float m = -INFINITY;
  for (int j = 0; j < 8; ++j) m = m < a0[j] ? a0[j] : m;
  for (; i < n; ++i) m = m < x[i] ? x[i] : m;
  return m;
}

// s = sum exp(x - m); q = sum exp(x - m) * (x - m)   (q feeds the entropy: H = log s - q / s)
MEGAGSPO_SIMD_CLONES
static void chunk_sumexp(const float* x, int64_t n, float m, float& s_out, float& q_out) {
  v8f s0 = splat8(0.0f), s1 = s0, q0 = s0, q1 = s0;
  const v8f mv = splat8(m), lo = splat8(-100.0f);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const v8f d0 = vmax8(load8(x + i) - mv, lo), d1 = vmax8(load8(x + i + 8) - mv, lo);
    const v8f e0 = exp8(d0), e1 = exp8(d1);
    s0 += e0;
    s1 += e1;
    q0 += e0 * d0;
    q1 += e1 * d1;
  }
  s0 += s1;
  q0 += q1;
  float st = 0.0f, qt = 0.0f;
  for (int j = 0; j < 8; ++j) {
    st += s0[j];
    qt += q0[j];
  }
  for (; i < n; ++i) {
    const float d = fmax_(x[i] - m, -100.0f);
    const float e = exp_f32(d);
    st += e;
    qt += e * d;
  }
  s_out = st;
  q_out = qt;
}

// out = -p * (k + b * c), c = max(x - lse, -100), p = exp(c)   (out may alias x)
MEGAGSPO_SIMD_CLONES
static void chunk_grad(const float* x, float* out, int64_t n, float lse, float k, float b) {
  const v8f lv = splat8(lse), kv = splat8(k), bv = splat8(b), lo = splat8(-100.0f);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const v8f c = vmax8(load8(x + i) - lv, lo);
    store8(out + i, -exp8(c) * (kv + bv * c));
  }
  for (; i < n; ++i) {
    const float c = fmax_(x[i] - lse, -100.0f);
    out[i] = -exp_f32(c) * (k + b * c);
  }
}

}  // namespace megagspo::cpu
