// SIMD pieces the CPU kernels share: float32 vectors (at::vec, at the build's capability), 16-bit
// loads widened to two of them, and reductions of one vector's lanes.
#pragma once
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <cmath>

// On the functions whose loops run per logit: every call inside them is inlined. Without it,
// GCC's unit-wide inlining budget decides whether at::vec's exp_u20 is inlined, and a change
// elsewhere in kernels.cpp once turned it into a call per vector (stage 1 went 48 -> 68 ms);
// built against torch 2.4's headers, kept_softmax.cpp's rows called it out of line.
#if defined(__GNUC__)
#define GSPO_HOT_LOOP __attribute__((flatten))
#else
#define GSPO_HOT_LOOP
#endif

namespace gspo::cpu {

// The loops that stream a row from memory ask for the line kPrefetchBytes ahead of the one they
// load. Without it the hardware prefetcher left them waiting on memory: the plain forward kernel
// took 1.13 ns a logit on rows from DRAM against 0.33 ns on rows already in L2 (one thread,
// N = 4096, V = 32768 bf16, a 2-core AVX-512 + AMX Xeon), and with it 0.37 ns; 1024 bytes ahead
// gave 10% less, 4096 the same as 2048. A prefetch past a row's end is harmless (it never faults).
#ifndef GSPO_PREFETCH_BYTES
#define GSPO_PREFETCH_BYTES 2048
#endif
constexpr int64_t kPrefetchBytes = GSPO_PREFETCH_BYTES;

template <typename T>
inline void prefetch_ahead(const T* p) {
#if defined(__GNUC__)
  __builtin_prefetch(reinterpret_cast<const char*>(p) + kPrefetchBytes, 0, 3);
#endif
}

using Vec = at::vec::Vectorized<float>;

inline void load_pair(const at::BFloat16* p, Vec& a, Vec& b) { at::vec::load_fp32_from_bf16(p, a, b); }
inline void load_pair(const at::Half* p, Vec& a, Vec& b) { at::vec::load_fp32_from_fp16(p, a, b); }

// The math policies of gspo_math.h's per-element functions, on SIMD vectors and on scalars.
struct VecOps {
  // exp_u20: a polynomial exp within ~4 ulp on [-87, 0] (the only arguments the kernels pass),
  // several times faster than Sleef's. It maps NaN to +inf, which is why NaN rows are
  // caught before it (kernels.cpp's file comment).
  static Vec exp(const Vec& x) { return x.exp_u20(); }
  static Vec max(const Vec& a, const Vec& b) { return at::vec::clamp_min(a, b); }
  static Vec fma(const Vec& a, const Vec& b, const Vec& c) { return at::vec::fmadd(a, b, c); }
};

struct ScalarOps {
  static float exp(float x) { return std::exp(x); }
  static float max(float a, float b) { return std::fmax(a, b); }
  static float fma(float a, float b, float c) { return std::fma(a, b, c); }
};

// 1 / a for a in [1, 2]: the hardware's 14-bit (AVX-512) or 12-bit (AVX2) estimate and one
// Newton step (about float32's 24 bits), in place of a division. A small gain: the soft-capped
// gradient went 116 -> 114 ms with it (N = 4096, V = 32768 bf16, a 2-core AVX-512 + AMX Xeon).
// NaN stays NaN.
inline Vec reciprocal(const Vec& a) {
#if defined(CPU_CAPABILITY_AVX512)
  const Vec r(_mm512_rcp14_ps(a));
#elif defined(CPU_CAPABILITY_AVX2)
  const Vec r(_mm256_rcp_ps(a));
#else
  return a.reciprocal();
#endif
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  return at::vec::fmadd(r, Vec(1.f) - a * r, r);  // r + r (1 - a r); no fnmadd in older torch's at::vec
#endif
}

// NaN-propagating (at::vec::maximum / minimum keep a NaN lane).
inline float max_lanes(const Vec& v) {
  return at::vec::vec_reduce_all<float>([](const Vec& a, const Vec& b) { return at::vec::maximum(a, b); }, v);
}
inline float min_lanes(const Vec& v) {
  return at::vec::vec_reduce_all<float>([](const Vec& a, const Vec& b) { return at::vec::minimum(a, b); }, v);
}
inline float sum_lanes(const Vec& v) {
  return at::vec::vec_reduce_all<float>([](const Vec& a, const Vec& b) { return a + b; }, v);
}

}  // namespace gspo::cpu
