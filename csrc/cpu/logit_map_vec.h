// The logit map of the CPU kernels on SIMD vectors and scalars: z = cap * tanh(scale * x)
// (or scale * x without a soft-cap), -inf below the row's kept-set minimum, and dz/dx.
#pragma once
#include <cmath>
#include <limits>

#include "../gspo_math.h"
#include "row_vec.h"

namespace gspo::cpu {

// tanh(y) and its slope 1 - tanh(y)^2, in two forms by |y|:
// - |y| < kTanhPoly: tanh(y) = y + y^3 P(y^2), P of degree 6 fitted for relative error on
//   [0, 1] (within 1.06 ulp of float64 there, evaluated in float32, and increasing; the exp form
//   below is within 2.0 ulp on [1, 9]); slope 1 - t^2 (t <= 0.762 there: no cancellation).
//   Logits within the soft-cap (|x| < cap) take this form, and a SIMD vector whose lanes all do
//   skips the exp: the soft-capped kernels then cost about one exp a logit, as plain ones do.
// - elsewhere, from one exp: with e = exp(-2|y|) in (0, 1], tanh(y) = sign(y) (1 - e) / (1 + e)
//   and 1 - tanh^2 = 4e / (1 + e)^2. No overflow (the exp's argument is <= 0); +-inf give +-1
//   with slope 0; NaN stays NaN; near +-1 the slope keeps its relative precision where
//   1 - t * t would cancel.
// The form is chosen per logit, never per vector, so a logit maps alike wherever it lies; the
// scalar twin serves the tails and the target with the same operations.
constexpr float kTanhPoly = 1.0f;
constexpr float kTanhP[7] = {-3.333329558e-01f, 1.333234459e-01f, -5.387979746e-02f, 2.148663811e-02f,
                             -7.946076803e-03f, 2.301343251e-03f, -3.584458900e-04f};

// The polynomial, odd in y, so it takes y itself: no sign to strip and restore (-0 gives +0,
// which no softmax tells apart).
inline Vec tanh_poly(const Vec& y, const Vec& y2) {
  Vec p(kTanhP[6]);
  for (int j = 5; j >= 0; --j) p = at::vec::fmadd(p, y2, Vec(kTanhP[j]));
  return at::vec::fmadd(y * y2, p, y);
}

inline float tanh_poly(float y, float y2) {
  float p = kTanhP[6];
  for (int j = 5; j >= 0; --j) p = std::fma(p, y2, kTanhP[j]);
  return std::fma(y * y2, p, y);
}

inline Vec tanh_and_slope(const Vec& y, Vec* one_minus_t2) {
  const Vec y2 = y * y;
  const Vec small = y2 < Vec(kTanhPoly * kTanhPoly);  // |y| < 1 exactly: y^2 rounds below 1 for every |y| < 1
  Vec t = tanh_poly(y, y2);
  Vec slope;
  if (one_minus_t2 != nullptr) slope = Vec(1.f) - t * t;
  if (small.zero_mask() != 0) {  // a lane at or past kTanhPoly (or NaN): the exp form there
    const Vec a = y.abs();
    const Vec e = (a * Vec(-2.f)).exp();
    const Vec r = reciprocal(Vec(1.f) + e);
    // sign(y) * (1 - e) r, by the sign bit: NaN stays NaN.
    t = Vec::blendv(((Vec(1.f) - e) * r) | (y & Vec(-0.f)), t, small);
    if (one_minus_t2 != nullptr) slope = Vec::blendv(Vec(4.f) * e * r * r, slope, small);
  }
  if (one_minus_t2 != nullptr) *one_minus_t2 = slope;
  return t;
}

inline float tanh_and_slope(float y, float* one_minus_t2) {
  const float y2 = y * y;
  float t, slope;
  if (y2 < kTanhPoly * kTanhPoly) {
    t = tanh_poly(y, y2);
    slope = 1.f - t * t;
  } else {
    const float e = std::exp(-2.f * std::fabs(y));
    const float r = 1.f / (1.f + e);
    t = std::copysign((1.f - e) * r, y);  // NaN stays NaN
    slope = 4.f * e * r * r;
  }
  if (one_minus_t2 != nullptr) *one_minus_t2 = slope;
  return t;
}

// The logit map of one SIMD vector: z, and dz/dx when `slope` is given; -inf (and any slope)
// below `kept`, the row's kept-set minimum. kMasked false: a row that keeps every logit (kept
// -inf), whose compare and blend are skipped (8% of a soft-capped forward row, rows in L2, one
// thread, AVX-512 Xeon without BF16).
template <bool kMasked = true>
inline Vec map_vec(const Vec& x, const LogitMap& map, const Vec& kept, Vec* slope = nullptr) {
  const Vec y = x * Vec(map.scale);
  Vec z = y;
  if (map.capped()) {
    Vec one_minus_t2;
    const Vec t = tanh_and_slope(y, slope != nullptr ? &one_minus_t2 : nullptr);
    z = Vec(map.cap) * t;
    if (slope != nullptr) *slope = Vec(map.scale * map.cap) * one_minus_t2;  // 0 where e = 0
  } else if (slope != nullptr) {
    *slope = Vec(map.scale);
  }
  if constexpr (!kMasked) return z;
  return Vec::blendv(z, Vec(-std::numeric_limits<float>::infinity()), x < kept);
}

// One logit's z (and dz/dx when `slope` is given) as map_vec maps it: a row's tail and its
// target take the same soft-cap as its SIMD lanes.
inline float map_scalar(float x, const LogitMap& map, float kept, float* slope = nullptr) {
  const float y = x * map.scale;
  float z = y;
  if (map.capped()) {
    float one_minus_t2;
    z = map.cap * tanh_and_slope(y, &one_minus_t2);
    if (slope != nullptr) *slope = map.scale * map.cap * one_minus_t2;
  } else if (slope != nullptr) {
    *slope = map.scale;
  }
  return x < kept ? -std::numeric_limits<float>::infinity() : z;
}

}  // namespace gspo::cpu
