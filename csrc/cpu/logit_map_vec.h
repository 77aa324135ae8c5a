// The logit map of the CPU kernels on SIMD vectors and scalars: z = cap * tanh(scale * x)
// (or scale * x without a soft-cap), -inf below the row's kept-set minimum, and dz/dx.
#pragma once
#include <cmath>
#include <limits>

#include "../gspo_math.h"
#include "row_vec.h"

namespace gspo::cpu {

// tanh(y) and 1 - tanh(y)^2 from one exp: with e = exp(-2|y|) in (0, 1],
// tanh(y) = sign(y) (1 - e) / (1 + e) and 1 - tanh^2 = 4e / (1 + e)^2. No overflow (the exp's
// argument is <= 0); +-inf give +-1 with slope 0; NaN stays NaN; near +-1 the slope keeps its
// relative precision where 1 - t * t would cancel. Below |y| = kTanhSeries, where 1 - e
// cancels, the odd series y - y^3/3 + 2y^5/15 - 17y^7/315 (its next term is under 1e-9 of t
// there). About 2x faster than at::vec's tanh (Sleef, 1 ulp) in the soft-cap kernels on a
// 2-core AMX Xeon (torch 2.14.1). The scalar twin serves the tails and the target, so that
// every element of a row takes the same map.
constexpr float kTanhSeries = 0.0625f;

inline Vec tanh_and_slope(const Vec& y, Vec* one_minus_t2) {
  const Vec a = y.abs();
  const Vec e = (a * Vec(-2.f)).exp();
  const Vec r = reciprocal(Vec(1.f) + e);
  const Vec y2 = y * y;
  const Vec series = a * at::vec::fmadd(y2, at::vec::fmadd(y2, at::vec::fmadd(y2, Vec(-17.f / 315.f), Vec(2.f / 15.f)),
                                                          Vec(-1.f / 3.f)), Vec(1.f));
  const Vec small = a < Vec(kTanhSeries);
  const Vec magnitude = Vec::blendv((Vec(1.f) - e) * r, series, small);
  if (one_minus_t2 != nullptr) {
    *one_minus_t2 = Vec::blendv(Vec(4.f) * e * r * r, Vec(1.f) - magnitude * magnitude, small);
  }
  // sign(y) * magnitude, by the sign bit: -0 and +0 alike give +-0, NaN stays NaN.
  return magnitude | (y & Vec(-0.f));
}

inline float tanh_and_slope(float y, float* one_minus_t2) {
  const float a = std::fabs(y);
  float magnitude, slope;
  if (a < kTanhSeries) {
    const float y2 = y * y;
    magnitude = a * std::fma(y2, std::fma(y2, std::fma(y2, -17.f / 315.f, 2.f / 15.f), -1.f / 3.f), 1.f);
    slope = 1.f - magnitude * magnitude;
  } else {
    const float e = std::exp(-2.f * a);
    const float r = 1.f / (1.f + e);
    magnitude = (1.f - e) * r;
    slope = 4.f * e * r * r;
  }
  if (one_minus_t2 != nullptr) *one_minus_t2 = slope;
  return std::copysign(magnitude, y);  // NaN stays NaN
}

// The logit map of one SIMD vector: z, and dz/dx when `slope` is given; -inf (and any slope)
// below `kept`, the row's kept-set minimum (-inf: every logit kept).
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
