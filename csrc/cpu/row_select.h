// Selection among a few hundred or thousand float32 values of a row, with no sort and no
// comparison branch per element: the kept set's top-k and top-p (kept_set.cpp, top_p_cut.cpp)
// pick their bounds and thresholds with these.
//
// A radix select over the order-preserving integer form of the values, 8 bits a level,
// counting (or weighing) every value into 256 bins and keeping only the bin that holds the
// answer. std::nth_element, whose partition mispredicts a branch for about every other
// element, took 6.9 us for rank 9 of 1024 normal floats and 2.5 us for rank 49 of 306 (a 2-core
// AVX-512 + AMX Xeon, GCC 13): a third of top-k's selection time at V = 32768.
#pragma once
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>

#include "row_vec.h"

namespace gspo::cpu {

// Larger floats give larger keys; -0 and +0 one key (the value +0); NaN never reaches here
// (rows with a NaN keep every token before any selection).
inline uint32_t order_key(float f) {
  const float canonical = f + 0.f;  // -0 + 0 = +0 in round-to-nearest
  uint32_t u;
  std::memcpy(&u, &canonical, sizeof(u));
  return u ^ ((0u - (u >> 31)) | 0x80000000u);  // negative: all bits flipped; else the sign bit set
}

// The bin of a key at a level (shift 24, 16, 8, 0).
inline uint32_t key_bin(float f, int shift) { return (order_key(f) >> shift) & 255u; }

// Keeps the entries of v (and of w, when given) whose key falls in `bin` at `shift`, in order,
// branch-free; returns how many.
inline int64_t keep_bin(float* v, float* w, int64_t n, int shift, uint32_t bin) {
  int64_t kept = 0;
  for (int64_t i = 0; i < n; ++i) {
    const float x = v[i];
    const float m = w != nullptr ? w[i] : 0.f;
    v[kept] = x;
    if (w != nullptr) w[kept] = m;
    kept += key_bin(x, shift) == bin;
  }
  return kept;
}

// Ranks below this take nth_largest_by_max: r + 1 SIMD passes cost less than the radix's
// per-element count and keep loops there. Top-k 50 alone spent a third of its time in the radix
// (a sample of 1024 at rank 9, then rank 49 of about 300 candidates; N = 4096, V = 32768 bf16,
// one thread, AVX-512 Xeon without BF16).
constexpr int64_t kByMaxRank = 64;

// nth_largest for a small r, without reordering v: the largest value, then at each step the
// count of values equal to it and the largest below it, in one pass. Equal keys are equal floats
// but for -0 and +0: a zero answer is the first zero of v, as the radix's stable passes give.
inline float nth_largest_by_max(const float* v, int64_t n, int64_t r) {
  using V = at::vec::Vectorized<float>;
  constexpr float kInf = std::numeric_limits<float>::infinity();
  const int64_t n_vec = n - n % V::size();
  V vmax(-kInf);
  for (int64_t i = 0; i < n_vec; i += V::size()) vmax = at::vec::clamp_min(vmax, V::loadu(v + i));
  float m = max_lanes(vmax);
  for (int64_t i = n_vec; i < n; ++i) m = std::max(m, v[i]);
  for (;;) {
    const V vm(m), one(1.f), zero(0.f), ninf(-kInf);
    V count(0.f), next(-kInf);
    for (int64_t i = 0; i < n_vec; i += V::size()) {
      const V x = V::loadu(v + i);
      count = count + V::blendv(zero, one, x == vm);
      next = at::vec::clamp_min(next, V::blendv(ninf, x, x < vm));
    }
    int64_t equal = static_cast<int64_t>(sum_lanes(count));
    float below = max_lanes(next);
    for (int64_t i = n_vec; i < n; ++i) {
      equal += v[i] == m;
      if (v[i] < m) below = std::max(below, v[i]);
    }
    if (r < equal || equal == 0) break;  // equal is 0 only past the last value (r >= n)
    r -= equal;
    m = below;
  }
  if (m == 0.f) {
    for (int64_t i = 0; i < n; ++i) {
      if (v[i] == 0.f) return v[i];
    }
  }
  return m;
}

// The r-th largest of v[0:n] (r = 0: the largest; r < n), as std::nth_element with
// std::greater would place at r. Reorders v (keeps a subset of it in front) unless r is small.
inline float nth_largest(float* v, int64_t n, int64_t r) {
  if (r < kByMaxRank) return nth_largest_by_max(v, n, r);
  for (int shift = 24; shift >= 0 && n > 1; shift -= 8) {
    // Four count tables, so that runs of values in one bin (most values of a row share their
    // exponent) do not wait on each other's increments.
    uint32_t counts[4][256];
    std::memset(counts, 0, sizeof(counts));
    for (int64_t i = 0; i < n; ++i) ++counts[i & 3][key_bin(v[i], shift)];
    uint32_t bin = 255;
    int64_t in_bin = 0;
    for (;; --bin) {
      in_bin = counts[0][bin] + counts[1][bin] + counts[2][bin] + counts[3][bin];
      if (r < in_bin) break;
      r -= in_bin;
    }
    if (in_bin < n) n = keep_bin(v, nullptr, n, shift, bin);
  }
  return v[0];  // every value left shares all 32 bits of its key: one value
}

// Top-p's cut among the values xs[0:n] with masses es[0:n], given `above`, the mass of the
// values above all of them, and target: the value u with above + mass(> u) < target <=
// above + mass(>= u) (`reached`), or, when above + all their mass stays short of target,
// `reached` false, their smallest value (+inf for none) and their mass in `mass`. above < target
// on entry. Reorders xs and es.
struct MassCut {
  float value;
  bool reached;
  double mass;
};

inline MassCut mass_cut(float* xs, float* es, int64_t n, double above, double target) {
  double all = 0.0;
  float smallest = std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < n; ++i) {
    all += es[i];
    smallest = std::min(smallest, xs[i]);
  }
  if (above + all < target) return {smallest, false, all};
  for (int shift = 24; shift >= 0; shift -= 8) {
    double mass[256];
    uint32_t counts[256];
    std::fill_n(mass, 256, 0.0);
    std::fill_n(counts, 256, 0u);
    for (int64_t i = 0; i < n; ++i) {
      const uint32_t bin = key_bin(xs[i], shift);
      mass[bin] += es[i];
      ++counts[bin];
    }
    int bin = 255;
    for (; bin > 0; --bin) {
      if (counts[bin] == 0) continue;
      if (above + mass[bin] >= target) break;
      above += mass[bin];
    }
    // bin 0 when no higher bin reached: the total reaches target (checked above), so the
    // lowest occupied bin holds the cut, a rounding of the bins' sums aside.
    while (counts[bin] == 0 && bin < 255) ++bin;
    n = keep_bin(xs, es, n, shift, static_cast<uint32_t>(bin));
  }
  return {xs[0], true, all};
}

// A float64 sum of float32 SIMD vectors: each vector widened and added in lanes, the lanes
// added in a fixed order at the end (the same bits every call). The sums that decide top-p's
// cut: float32 lanes of about 60 masses each drifted by 5e-7 of a row's mass, enough to move
// the boundary at top-p 0.999 on a flat row of 4099 tokens.
class WideSum {
 public:
  void add(const Vec& v) {
#if defined(CPU_CAPABILITY_AVX512)
    const __m512 f = v;
    low_ = _mm512_add_pd(low_, _mm512_cvtps_pd(_mm512_castps512_ps256(f)));
    high_ = _mm512_add_pd(high_, _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(f), 1))));
#elif defined(CPU_CAPABILITY_AVX2)
    const __m256 f = v;
    low_ = _mm256_add_pd(low_, _mm256_cvtps_pd(_mm256_castps256_ps128(f)));
    high_ = _mm256_add_pd(high_, _mm256_cvtps_pd(_mm256_extractf128_ps(f, 1)));
#else
    float lanes[Vec::size()];
    v.store(lanes);
    for (int j = 0; j < Vec::size(); ++j) lanes_[j] += lanes[j];
#endif
  }

  double total() const {
#if defined(CPU_CAPABILITY_AVX512)
    return _mm512_reduce_add_pd(_mm512_add_pd(low_, high_));
#elif defined(CPU_CAPABILITY_AVX2)
    alignas(32) double lanes[4];
    _mm256_store_pd(lanes, _mm256_add_pd(low_, high_));
    return (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
#else
    double sum = 0.0;
    for (int j = 0; j < Vec::size(); ++j) sum += lanes_[j];
    return sum;
#endif
  }

 private:
#if defined(CPU_CAPABILITY_AVX512)
  __m512d low_ = _mm512_setzero_pd(), high_ = _mm512_setzero_pd();
#elif defined(CPU_CAPABILITY_AVX2)
  __m256d low_ = _mm256_setzero_pd(), high_ = _mm256_setzero_pd();
#else
  double lanes_[Vec::size()] = {};
#endif
};

// The mass (e) of the logits x >= bound, summed in float64.
inline double mass_at_least_f64(const float* x, const float* e, int64_t n, float bound) {
  const Vec vbound(bound), zero(0.f);
  WideSum sum;
  int64_t i = 0;
  for (; i + Vec::size() <= n; i += Vec::size()) {
    sum.add(Vec::blendv(zero, Vec::loadu(e + i), Vec::loadu(x + i) >= vbound));
  }
  double total = sum.total();
  for (; i < n; ++i) total += x[i] >= bound ? static_cast<double>(e[i]) : 0.0;
  return total;
}

// A range of keys: [lo, hi), or [lo, +inf] when open_top.
struct KeyRange {
  float lo, hi;
  bool open_top;
};

// For each 8-bit mask, the lanes it holds, in order, then zeros: the permutation that packs
// an AVX2 vector's kept lanes to its front.
struct LeftPack {
  uint32_t lanes[256][8];
  LeftPack() {
    for (int mask = 0; mask < 256; ++mask) {
      int at = 0;
      for (int lane = 0; lane < 8; ++lane) {
        if (mask & (1 << lane)) lanes[mask][at++] = static_cast<uint32_t>(lane);
      }
      while (at < 8) lanes[mask][at++] = 0;
    }
  }
};

// The lanes of v at or above lo (NaN lanes fail), in order, stored at xo + out (a whole vector:
// xo needs Vec::size() floats of slack past the count); out advances by their number.
inline void compress_at_least(const at::vec::Vectorized<float>& v, float lo, float* xo, int64_t& out) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m512 x = v;
  const __mmask16 keep = _mm512_cmp_ps_mask(x, _mm512_set1_ps(lo), _CMP_GE_OQ);
  if (keep == 0) return;
  _mm512_storeu_ps(xo + out, _mm512_maskz_compress_ps(keep, x));
  out += __builtin_popcount(keep);
#elif defined(CPU_CAPABILITY_AVX2)
  static const LeftPack pack;
  const __m256 x = v;
  const int mask = _mm256_movemask_ps(_mm256_cmp_ps(x, _mm256_set1_ps(lo), _CMP_GE_OQ));
  if (mask == 0) return;
  const __m256i order = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pack.lanes[mask]));
  _mm256_storeu_ps(xo + out, _mm256_permutevar8x32_ps(x, order));
  out += __builtin_popcount(mask);
#else
  float lanes[at::vec::Vectorized<float>::size()];
  v.store(lanes);
  for (float x : lanes) {
    xo[out] = x;
    out += x >= lo;
  }
#endif
}

// The entries of x (and e, when eo is given) whose key (from `key`: x itself or e) lies in
// [lo, hi), or in [lo, +inf] when open_top, in order, into xo (and eo); returns how many.
// xo and eo need 16 floats of slack past the count: each vector is stored whole.
inline int64_t compress_in_range(const float* key, const float* x, const float* e, int64_t n, KeyRange r, float* xo,
                                 float* eo) {
  int64_t out = 0, i = 0;
#if defined(CPU_CAPABILITY_AVX512)
  // AVX-512's compress packs a vector's kept lanes in order, in a register, stored whole (not
  // by the compressing store, which Zen 4 runs in microcode): the loop with a branch per
  // vector and per lane took 14.7 us a row for top-k at V = 32768 (2-core AVX-512 + AMX Xeon).
  const __m512 vlo = _mm512_set1_ps(r.lo), vhi = _mm512_set1_ps(r.hi);
  for (; i + 16 <= n; i += 16) {
    prefetch_ahead(key + i);
    const __m512 k = _mm512_loadu_ps(key + i);
    __mmask16 keep = _mm512_cmp_ps_mask(k, vlo, _CMP_GE_OQ);
    if (!r.open_top) keep &= _mm512_cmp_ps_mask(k, vhi, _CMP_LT_OQ);
    if (keep == 0) continue;
    _mm512_storeu_ps(xo + out, _mm512_maskz_compress_ps(keep, _mm512_loadu_ps(x + i)));
    if (eo != nullptr) _mm512_storeu_ps(eo + out, _mm512_maskz_compress_ps(keep, _mm512_loadu_ps(e + i)));
    out += __builtin_popcount(keep);
  }
#elif defined(CPU_CAPABILITY_AVX2)
  // AVX2 has no compress: each vector's kept lanes move to its front by a permutation looked
  // up from the compare's 8-bit mask. The scalar loop below, run over the whole row, made
  // top-p 0.9 take 358 ms at N = 4096, V = 32768 bf16 (2 threads, this build on an AMX Xeon).
  static const LeftPack pack;
  const __m256 vlo = _mm256_set1_ps(r.lo), vhi = _mm256_set1_ps(r.hi);
  for (; i + 8 <= n; i += 8) {
    prefetch_ahead(key + i);
    const __m256 k = _mm256_loadu_ps(key + i);
    __m256 keep = _mm256_cmp_ps(k, vlo, _CMP_GE_OQ);
    if (!r.open_top) keep = _mm256_and_ps(keep, _mm256_cmp_ps(k, vhi, _CMP_LT_OQ));
    const int mask = _mm256_movemask_ps(keep);
    if (mask == 0) continue;
    const __m256i order = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pack.lanes[mask]));
    _mm256_storeu_ps(xo + out, _mm256_permutevar8x32_ps(_mm256_loadu_ps(x + i), order));
    if (eo != nullptr) _mm256_storeu_ps(eo + out, _mm256_permutevar8x32_ps(_mm256_loadu_ps(e + i), order));
    out += __builtin_popcount(mask);
  }
#endif
  for (; i < n; ++i) {
    xo[out] = x[i];
    if (eo != nullptr) eo[out] = e[i];
    out += key[i] >= r.lo && (r.open_top || key[i] < r.hi);
  }
  return out;
}

}  // namespace gspo::cpu
