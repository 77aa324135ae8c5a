// A row's scratch and the small pieces the kept-set selections share: kept_set.cpp's filters and
// top_p_cut.cpp's search. One per thread (KeptSelector), reused row after row.
#pragma once
#include <cstdint>
#include <utility>
#include <vector>

#include "../gspo_math.h"
#include "mass_bracket.h"
#include "row_select.h"
#include "row_vec.h"

namespace gspo::cpu {

// About how many logits of a row (every stride-th) the selections guess their bounds from.
constexpr int64_t kSample = 1024;

// Some logits of a row and (for top-p) their masses, gathered by compress_in_range.
struct Candidates {
  std::vector<float> x, e;  // n + 16: compress_in_range's slack

  // The entries of (x, e) whose key lies in r (e taken only when `masses`); how many.
  int64_t gather(const float* key, const float* from_x, const float* from_e, int64_t n, KeyRange r, bool masses) {
    const size_t room = static_cast<size_t>(n + 16);
    if (x.size() < room) x.resize(room);
    if (masses && e.size() < room) e.resize(room);
    return compress_in_range(key, from_x, from_e, n, r, x.data(), masses ? e.data() : nullptr);
  }
};

// A thread's room for one row at a time: its float32 copy (x), its z or masses (e), and the
// selections' samples, candidates and bins.
struct RowScratch {
  std::vector<float> x, e, sample, sample_e;
  Candidates near, slice;  // top-k's logits above its bound, top-p's narrowed row; top-p's heavy logits, then its slice
  std::vector<std::pair<float, float>> pairs;
  std::vector<double> buckets;
  BracketScratch bracket;
};

// z = map(x) of one SIMD vector and of one logit: the same float32 operations as the
// reference's map (x * scale, then tanh and * cap), tanh at::vec's.
inline Vec map_reference(const Vec& x, const LogitMap& map) {
  const Vec y = x * Vec(map.scale);
  return map.capped() ? y.tanh() * Vec(map.cap) : y;
}

// Halfway between the smallest kept logit and the largest dropped one (in float64, then
// float32, never at or below the dropped one): kept_set.py's margin for logits formed again.
inline float margin_between(float smallest_kept, float largest_dropped) {
  const double middle = (static_cast<double>(smallest_kept) + static_cast<double>(largest_dropped)) / 2.0;
  const float rounded = static_cast<float>(middle);
  return rounded > largest_dropped ? rounded : smallest_kept;
}

}  // namespace gspo::cpu
