// SIMD pieces the CPU kernels share: float32 vectors (at::vec, at the build's capability), 16-bit
// loads widened to two of them, and reductions of one vector's lanes.
#pragma once
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

namespace gspo::cpu {

using Vec = at::vec::Vectorized<float>;

inline void load_pair(const at::BFloat16* p, Vec& a, Vec& b) { at::vec::load_fp32_from_bf16(p, a, b); }
inline void load_pair(const at::Half* p, Vec& a, Vec& b) { at::vec::load_fp32_from_fp16(p, a, b); }

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
