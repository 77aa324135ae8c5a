// The sampler's kept set on the CPU: per row, the threshold t on the raw logits such that the
// tokens vLLM's sampler keeps (min-p, then top-k, then top-p) are exactly {x >= t}, with no sort
// of the row (token_stats/kept_set.py states the rules; its PyTorch pre-pass is the reference).
//
// Each filter keeps an upper set of the raw logits, so the kept set is always {x >= lower} and
// every filter only raises `lower`: min-p by one compare with the row's max z; top-k by a
// selection among the logits above a bound guessed from a strided sample of the row and checked
// by an exact SIMD pass (kth_largest); top-p by a search on the masses alone (mass_bracket.h)
// settled on the logits of the bracket it finds (top_p_from_bracket), or, when that bracket is
// not a range of logits too, by the search on the logits (top_p_bound). The selections
// themselves are radix selects with no branch per element, or for ranks below 64 a pass by max
// per rank (row_select.h). Min-p alone without a soft-cap, and top-k alone, read the row itself
// (min_p_alone, top_k_alone); the others a float32 copy of it. A first version, a
// 12/12/8-bit radix select of the whole row (a scalar scatter of every logit into bins), took
// 353 ms for top-k at N = 4096, V = 32768 bf16 against 79 ms for the plain forward kernel (2-core
// AVX-512 + AMX Xeon). The search on the masses took top-p 0.9 from 65-73 to 40-42 us a row on
// one thread (N(0, 2^2) bf16 logits, V = 32768; AVX-512 Xeon without BF16), 0.5 and 0.99 alike.
// Top-p's decisions are float64 sums of float32 masses, as the float64 sampler's are. Rows run
// in parallel; each thread holds a float32 copy of one row and its z or masses.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <utility>
#include <limits>
#include <vector>

#include "../gspo_math.h"
#include "../op_common.h"
#include "kept_set.h"
#include "mass_bracket.h"
#include "row_select.h"
#include "row_vec.h"

namespace gspo::cpu {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

// The row in float32 into x; returns its max (NaN if any logit is NaN).
template <typename scalar_t>
float load_row(const scalar_t* row, float* x, int64_t n) {
  Vec vmax(-kInf);
  int64_t i = 0;
  if constexpr (std::is_same_v<scalar_t, float>) {
    for (; i + Vec::size() <= n; i += Vec::size()) {
      prefetch_ahead(row + i);
      const Vec v = Vec::loadu(row + i);
      v.store(x + i);
      vmax = at::vec::maximum(vmax, v);
    }
  } else {
    for (; i + 2 * Vec::size() <= n; i += 2 * Vec::size()) {
      prefetch_ahead(row + i);
      Vec a, b;
      load_pair(row + i, a, b);
      a.store(x + i);
      b.store(x + i + Vec::size());
      vmax = at::vec::maximum(vmax, at::vec::maximum(a, b));
    }
  }
  float m = max_lanes(vmax);
  for (; i < n; ++i) {
    x[i] = static_cast<float>(row[i]);
    m = (x[i] > m || x[i] != x[i]) ? x[i] : m;
  }
  return m;
}

// Each float32 SIMD vector of row[0 : n - n % (2 Vec::size())] handed to f, in order (16-bit
// logits widened two vectors at a time); returns where the scalar tail starts.
template <typename scalar_t, typename F>
GSPO_HOT_LOOP int64_t for_each_vec(const scalar_t* row, int64_t n, F&& f) {
  constexpr int64_t kW = 2 * Vec::size();
  int64_t i = 0;
  for (; i + kW <= n; i += kW) {
    prefetch_ahead(row + i);
    Vec a, b;
    if constexpr (std::is_same_v<scalar_t, float>) {
      a = Vec::loadu(row + i);
      b = Vec::loadu(row + i + Vec::size());
    } else {
      load_pair(row + i, a, b);
    }
    f(a);
    f(b);
  }
  return i;
}

// The row's max, NaN if any logit is NaN.
template <typename scalar_t>
float row_max(const scalar_t* row, int64_t vocab) {
  Vec vmax(-kInf);
  int64_t i = for_each_vec(row, vocab, [&](const Vec& v) { vmax = at::vec::maximum(vmax, v); });
  float m = max_lanes(vmax);
  for (; i < vocab; ++i) {
    const float x = static_cast<float>(row[i]);
    m = (x > m || x != x) ? x : m;
  }
  return m;
}

// Whether a row has no finite softmax (a NaN, or +inf without a soft-cap: its results stay NaN)
// or holds only -inf: such a row keeps every token.
inline bool keeps_all(float x_max, const LogitMap& map) {
  return x_max != x_max || (x_max == kInf && !map.capped()) || x_max == -kInf;
}

// z = map(x) of one SIMD vector and of one logit: the same float32 operations as the
// reference's map (x * scale, then tanh and * cap), tanh at::vec's.
inline Vec map_reference(const Vec& x, const LogitMap& map) {
  const Vec y = x * Vec(map.scale);
  return map.capped() ? y.tanh() * Vec(map.cap) : y;
}

// z = map(x) over a row.
void map_row(const float* x, float* z, int64_t n, const LogitMap& map) {
  int64_t i = 0;
  for (; i + Vec::size() <= n; i += Vec::size()) {
    prefetch_ahead(x + i);
    map_reference(Vec::loadu(x + i), map).store(z + i);
  }
  for (; i < n; ++i) z[i] = map(x[i]);
}

// The smallest x whose z reaches z_min.
float smallest_reaching(const float* x, const float* z, int64_t n, float z_min) {
  const Vec vz_min(z_min), inf(kInf);
  Vec small(kInf);
  int64_t i = 0;
  for (; i + Vec::size() <= n; i += Vec::size()) {
    prefetch_ahead(x + i);
    prefetch_ahead(z + i);
    small = at::vec::minimum(small, Vec::blendv(inf, Vec::loadu(x + i), Vec::loadu(z + i) >= vz_min));
  }
  float s = min_lanes(small);
  for (; i < n; ++i) s = (z[i] >= z_min && x[i] < s) ? x[i] : s;
  return s;
}

// e = exp(z - z_max) where x >= lower, 0 elsewhere; returns the sum. z is read from e when
// z_in_e (min-p mapped the row already), else formed from x on the way (one pass, not two).
// The exp is the kernels' own (VecOps: exp_u20, ~4 ulp on [-87, 0]); Sleef's 1-ulp exp took
// this pass to 1.5x a whole plain forward row (AVX-512 Xeon without BF16).
GSPO_HOT_LOOP double masses_row(const float* x, float* e, int64_t n, const LogitMap& map, bool z_in_e, float z_max,
                                float lower) {
  const Vec shift(z_max), vlower(lower), zero(0.f);
  WideSum total;  // in float64: top-p's target is a fraction of it (row_select.h)
  int64_t i = 0;
  for (; i + Vec::size() <= n; i += Vec::size()) {
    prefetch_ahead(x + i);
    prefetch_ahead(e + i);
    const Vec v = Vec::loadu(x + i);
    const Vec z = z_in_e ? Vec::loadu(e + i) : map_reference(v, map);
    const Vec m = Vec::blendv(zero, VecOps::exp(z - shift), v >= vlower);
    m.store(e + i);
    total.add(m);
  }
  double sum = total.total();
  for (; i < n; ++i) {
    const float z = z_in_e ? e[i] : map(x[i]);
    e[i] = x[i] >= lower ? std::exp(z - z_max) : 0.f;
    sum += e[i];
  }
  return sum;
}

// The mass (e) of the logits x >= bound, summed in float32 lanes: top-p's search passes, which
// only pick a slice; the sums that decide the cut are row_select.h's mass_at_least_f64 (four
// float32 chains here, against two float64 ones there whose add latency would bound each pass).
double mass_at_least(const float* x, const float* e, int64_t n, float bound) {
  const Vec vbound(bound), zero(0.f);
  auto part = [&](int64_t i) { return Vec::blendv(zero, Vec::loadu(e + i), Vec::loadu(x + i) >= vbound); };
  Vec s0(0.f), s1(0.f), s2(0.f), s3(0.f);  // four chains: an add's latency, not its throughput, bounds one
  constexpr int64_t kStep = 4 * Vec::size();
  int64_t i = 0;
  for (; i + kStep <= n; i += kStep) {
    prefetch_ahead(x + i);
    prefetch_ahead(e + i);
    s0 = s0 + part(i);
    s1 = s1 + part(i + Vec::size());
    s2 = s2 + part(i + 2 * Vec::size());
    s3 = s3 + part(i + 3 * Vec::size());
  }
  for (; i + Vec::size() <= n; i += Vec::size()) s0 = s0 + part(i);
  double total = sum_lanes((s0 + s1) + (s2 + s3));
  for (; i < n; ++i) total += x[i] >= bound ? e[i] : 0.f;
  return total;
}

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

struct RowScratch {
  std::vector<float> x, e, sample, sample_e;
  Candidates near, slice;  // top-k's logits above its bound, top-p's narrowed row; top-p's heavy logits, then its slice
  std::vector<std::pair<float, float>> pairs;
  std::vector<double> buckets;
  BracketScratch bracket;
};

// The logits of the row at or above `lower`, widened to float32, into near.x; how many.
template <typename scalar_t>
int64_t gather_at_least(const scalar_t* row, int64_t vocab, float lower, Candidates& near) {
  const size_t room = static_cast<size_t>(vocab + 2 * Vec::size());
  if (near.x.size() < room) near.x.resize(room);
  float* out_x = near.x.data();
  int64_t out = 0;
  int64_t i = for_each_vec(row, vocab, [&](const Vec& v) { compress_at_least(v, lower, out_x, out); });
  for (; i < vocab; ++i) {
    const float x = static_cast<float>(row[i]);
    out_x[out] = x;
    out += x >= lower;
  }
  return out;
}

// Top-k's cut: the k-th largest logit among x >= lower (`value`; lower itself when fewer than k
// are, all staying kept), and the largest logit below it when the candidates hold one
// (`below`, -inf when they do not): every logit outside them lies under all of them, so it is
// then the row's largest dropped logit, with no pass over the row to find it.
struct TopK {
  float value, below;
};

template <typename scalar_t>
TopK kth_largest(const scalar_t* row, int64_t n, float lower, int64_t k, RowScratch& w) {
  // Guess a bound above which a little more than k logits lie, from a strided sample.
  const int64_t stride = std::max<int64_t>(1, n / kSample);
  w.sample.clear();
  for (int64_t i = 0; i < n; i += stride) {
    const float x = static_cast<float>(row[i]);
    if (x >= lower) w.sample.push_back(x);
  }
  const int64_t rank = k / stride + 8;  // ~8 strides of logits to spare
  float bound = lower;
  if (rank < static_cast<int64_t>(w.sample.size())) {
    bound = std::max(lower, nth_largest(w.sample.data(), static_cast<int64_t>(w.sample.size()), rank));
  }
  int64_t found = gather_at_least(row, n, bound, w.near);
  if (found < k) found = gather_at_least(row, n, lower, w.near);  // the guess was high
  if (found < k) return {lower, -kInf};
  const float* near = w.near.x.data();
  w.sample.assign(near, near + found);  // nth_largest reorders its input
  const float value = nth_largest(w.sample.data(), found, k - 1);
  float below = -kInf;
  for (int64_t i = 0; i < found; ++i) below = near[i] < value ? std::max(below, near[i]) : below;
  return {value, below};
}

// Top-p among x >= lower, with w.e holding each logit's mass exp(z - z_max) (0 below lower) and
// `target` = top_p * their sum: the smallest logit u with (mass of the logits > u) < target.
//
// The answer is bracketed between two values: hi, the mass at or above which is below target,
// and lo, the mass at or above which reaches it; then only the logits in [lo, hi) are searched.
// The bracket is one of kBuckets equal slices of the sampled logits' range, guessed from the heavy
// logits (mass >= target / kSample, taken exactly) and a strided sample of the others (each
// standing for `stride` logits), found by float32 SIMD passes over the row (narrowed below) and
// confirmed, or moved, by float64 sums.
constexpr int64_t kBuckets = 256;
constexpr int64_t kNarrowMargin = 16;  // slices below the guess the narrowed row keeps

float top_p_bound(RowScratch& w, int64_t n, float lower, double target) {
  const float* x = w.x.data();
  const float* e = w.e.data();
  const int64_t stride = std::max<int64_t>(1, n / kSample);
  const float heavy = static_cast<float>(target / kSample);
  w.pairs.clear();
  const int64_t heavies = w.slice.gather(e, x, e, n, {heavy, 0.f, true}, true);
  for (int64_t i = 0; i < heavies; ++i) w.pairs.emplace_back(w.slice.x[i], w.slice.e[i]);
  for (int64_t i = 0; i < n; i += stride) {
    if (x[i] >= lower && e[i] < heavy) w.pairs.emplace_back(x[i], e[i] * static_cast<float>(stride));
  }
  // The slices span the finite sampled logits (a soft-capped +inf, and -inf logits, fall in the
  // first and the last slice): edge(0) = +inf, edge(kBuckets) = lower.
  float high = -kInf, low = kInf;
  for (const auto& pr : w.pairs) {
    if (std::isfinite(pr.first)) {
      high = std::max(high, pr.first);
      low = std::min(low, pr.first);
    }
  }
  const float width = high > low ? (high - low) / static_cast<float>(kBuckets) : 0.f;
  auto edge = [&](int64_t i) {
    if (i <= 0) return kInf;
    if (i >= kBuckets || !(width > 0.f)) return lower;
    return std::max(lower, high - width * static_cast<float>(i));
  };
  std::vector<double>& guess = w.buckets;
  guess.assign(kBuckets, 0.0);
  for (const auto& pr : w.pairs) {
    const float above_high = high - pr.first;  // -inf for +inf, +inf for -inf, NaN never (no NaN rows)
    const int64_t i = width > 0.f ? static_cast<int64_t>(std::clamp(above_high / width, 0.f, float(kBuckets - 1))) : 0;
    guess[i] += pr.second;
  }
  int64_t guessed = kBuckets;  // the first edge at or above which the sample's mass reaches target
  double estimate = 0.0;
  for (int64_t i = 0; i < kBuckets; ++i) {
    estimate += guess[i];
    if (estimate >= target) {
      guessed = i + 1;
      break;
    }
  }
  // The row narrowed to the logits at or above edge(narrow), a little below the guess, once its
  // mass is checked to reach target: the search's passes then read only those (about half the
  // row at top-p 0.9 on N(0, 2^2) logits, V = 32768). When the check fails, the whole row.
  int64_t narrow = std::min(guessed + kNarrowMargin, kBuckets);
  const float* cx = x;
  const float* ce = e;
  int64_t cn = n;
  if (narrow < kBuckets) {
    const int64_t found = w.near.gather(x, x, e, n, {edge(narrow), 0.f, true}, true);
    if (mass_at_least_f64(w.near.x.data(), w.near.e.data(), found, edge(narrow)) >= target) {
      cx = w.near.x.data();
      ce = w.near.e.data();
      cn = found;
    } else {
      narrow = kBuckets;
    }
  }
  // The exact answer: the first edge i (1..narrow) whose mass at or above reaches target (the
  // mass at or above edge(i) grows with i; it reaches at edge(narrow), checked above, or at
  // edge(kBuckets) = lower, a rounding short at most). Gallop from the guess to a bracket, then
  // bisect; each step is one SIMD pass over the narrowed row.
  auto reaches = [&](int64_t i) { return i >= narrow || mass_at_least(cx, ce, cn, edge(i)) >= target; };
  int64_t hi = std::min(guessed, narrow), lo = 0;  // reaches(hi); !reaches(lo), as edge(0) holds none
  if (reaches(hi)) {
    for (int64_t step = 1; hi - step > 0; step *= 2) {
      if (!reaches(hi - step)) {
        lo = hi - step;
        break;
      }
      hi -= step;
    }
  } else {
    lo = hi;
    for (int64_t step = 1;; step *= 2) {
      hi = std::min(lo + step, narrow);
      if (reaches(hi)) break;
      lo = hi;
    }
  }
  while (hi - lo > 1) {
    const int64_t mid = lo + (hi - lo) / 2;
    (reaches(mid) ? hi : lo) = mid;
  }
  // The slice's logits, then the cut weighted by mass among them (row_select.h's mass_cut), with
  // the mass at or above its top summed in float64. The passes above sum in float32, so a target
  // within a rounding of a slice's edge may land in the slice above or below: step until the
  // float64 sums bracket it. The first slice has no top: it holds the +inf logits a soft-cap
  // makes finite.
  int64_t slice = hi - 1;
  auto mass_above = [&](int64_t s) { return s == 0 ? 0.0 : mass_at_least_f64(cx, ce, cn, edge(s)); };
  double at_top = mass_above(slice);
  while (slice > 0 && at_top >= target) at_top = mass_above(--slice);
  for (;; ++slice) {
    const int64_t inside = w.slice.gather(cx, cx, ce, cn, {edge(slice + 1), edge(slice), slice == 0}, true);
    const MassCut cut = mass_cut(w.slice.x.data(), w.slice.e.data(), inside, at_top, target);
    if (cut.reached) return cut.value;
    at_top += cut.mass;
    // The last slice (at or above edge(narrow), whose mass reaches target in float64, or the
    // row's last, whose edge is lower) short of target: the sums a rounding apart, every logit
    // of the slice kept.
    if (slice + 1 >= narrow) return cut.value < kInf ? cut.value : lower;
  }
}

// Halfway between the smallest kept logit and the largest dropped one (in float64, then
// float32, never at or below the dropped one): kept_set.py's margin for logits formed again.
float margin_between(float smallest_kept, float largest_dropped) {
  const double middle = (static_cast<double>(smallest_kept) + static_cast<double>(largest_dropped)) / 2.0;
  const float rounded = static_cast<float>(middle);
  return rounded > largest_dropped ? rounded : smallest_kept;
}

// Top-p's threshold from the range of masses holding its cut (mass_bracket.h): the logits whose
// masses lie in the range, widened by 2^-16 of itself each side, gathered; the mass above them
// summed in float64; the cut among them by mass_cut, exactly as top_p_bound settles it. The
// range is taken only when it is a range of the logits too (every logit above it larger than all
// in it, every one below smaller), which a mass rounding against the logits' order would break;
// false then, or when the float64 sums put the cut outside it. On success, the threshold
// row_threshold returns: the margin below the cut, or -inf when every token stays. kStats (no
// soft-cap): also the kept set's softmax stats at z_max, its masses and z - z_max summed in
// float64 on the way (z = x * scale, as masses_row formed the masses).
template <bool kStats>
bool top_p_from_bracket(RowScratch& w, int64_t n, const MassRange& range, double target, const LogitMap& map,
                        float z_max, KeptRow& out) {
  const float* x = w.x.data();
  const float* e = w.e.data();
  const float lo = std::max(range.lo * (1.f - 0x1p-16f), std::numeric_limits<float>::denorm_min());
  const float hi = range.hi * (1.f + 0x1p-16f);  // +inf stays +inf: no logit above
  // In the range: its logits and masses gathered. Past it: the mass at or above it and its
  // smallest logit; below it, the largest logit and whether any (a dropped token).
  Candidates& in = w.slice;
  if (in.x.size() < static_cast<size_t>(n + 16)) in.x.resize(static_cast<size_t>(n + 16));
  if (in.e.size() < static_cast<size_t>(n + 16)) in.e.resize(static_cast<size_t>(n + 16));
  float* xs_out = in.x.data();
  float* es_out = in.e.data();
  int64_t inside = 0, i = 0;
  WideSum above, above_shifted;  // the latter: sum of e (z - z_max) at or above the range
  float smallest_above = kInf, largest_below = -kInf;
  bool any_below = false;
#if defined(CPU_CAPABILITY_AVX512)
  // One pass; the compresses as in row_select.h's compress_in_range.
  const __m512 vlo = _mm512_set1_ps(lo), vhi = _mm512_set1_ps(hi);
  __m512 above_min = _mm512_set1_ps(kInf), below_max = _mm512_set1_ps(-kInf);
  __mmask16 below_seen = 0;
  for (; i + 16 <= n; i += 16) {
    prefetch_ahead(x + i);
    prefetch_ahead(e + i);
    const __m512 v = _mm512_loadu_ps(x + i), m = _mm512_loadu_ps(e + i);
    const __mmask16 at_hi = _mm512_cmp_ps_mask(m, vhi, _CMP_GE_OQ);
    const __mmask16 at_lo = _mm512_cmp_ps_mask(m, vlo, _CMP_GE_OQ);
    const __mmask16 mid = _kandn_mask16(at_hi, at_lo), under = _knot_mask16(at_lo);
    _mm512_storeu_ps(xs_out + inside, _mm512_maskz_compress_ps(mid, v));
    _mm512_storeu_ps(es_out + inside, _mm512_maskz_compress_ps(mid, m));
    inside += __builtin_popcount(mid);
    above.add(Vec(_mm512_maskz_mov_ps(at_hi, m)));
    if constexpr (kStats) {
      const __m512 d = _mm512_fmsub_ps(v, _mm512_set1_ps(map.scale), _mm512_set1_ps(z_max));
      above_shifted.add(Vec(_mm512_maskz_mul_ps(at_hi, m, d)));
    }
    above_min = _mm512_mask_min_ps(above_min, at_hi, above_min, v);
    below_max = _mm512_mask_max_ps(below_max, under, below_max, v);
    below_seen |= under;
  }
  smallest_above = _mm512_reduce_min_ps(above_min);
  largest_below = _mm512_reduce_max_ps(below_max);
  any_below = below_seen != 0;
#else
  {
    const Vec vlo(lo), vhi(hi), inf(kInf), ninf(-kInf), one(1.f), zero(0.f);
    Vec above_min(kInf), below_max(-kInf), below_count(0.f);
    for (; i + Vec::size() <= n; i += Vec::size()) {
      prefetch_ahead(x + i);
      prefetch_ahead(e + i);
      const Vec v = Vec::loadu(x + i), m = Vec::loadu(e + i);
      const Vec is_above = m >= vhi, is_below = m < vlo;
      above.add(Vec::blendv(zero, m, is_above));
      if constexpr (kStats) above_shifted.add(Vec::blendv(zero, m * (v * Vec(map.scale) - Vec(z_max)), is_above));
      above_min = at::vec::clamp_max(above_min, Vec::blendv(inf, v, is_above));
      below_max = at::vec::clamp_min(below_max, Vec::blendv(ninf, v, is_below));
      below_count = below_count + Vec::blendv(zero, one, is_below);
    }
    smallest_above = min_lanes(above_min);
    largest_below = max_lanes(below_max);
    any_below = sum_lanes(below_count) > 0.f;
  }
  inside = compress_in_range(e, x, e, i, {lo, hi, hi == kInf}, xs_out, es_out);  // the tail: below
#endif
  double mass_above = above.total(), shifted_above = kStats ? above_shifted.total() : 0.0;
  for (; i < n; ++i) {
    xs_out[inside] = x[i];
    es_out[inside] = e[i];
    if (e[i] >= hi) {
      mass_above += e[i];
      if constexpr (kStats) shifted_above += static_cast<double>(e[i]) * (x[i] * map.scale - z_max);
      smallest_above = std::min(smallest_above, x[i]);
    } else if (e[i] < lo) {
      largest_below = std::max(largest_below, x[i]);
      any_below = true;
    } else {
      ++inside;
    }
  }
  if (inside == 0) return false;
  const float* xs = w.slice.x.data();
  const auto [least, most] = std::minmax_element(xs, xs + inside);
  if (!(largest_below < *least) || !(*most < smallest_above) || mass_above >= target) return false;
  w.sample.assign(xs, xs + inside);  // mass_cut reorders the slice
  if constexpr (kStats) w.sample_e.assign(w.slice.e.data(), w.slice.e.data() + inside);
  const MassCut cut = mass_cut(w.slice.x.data(), w.slice.e.data(), inside, mass_above, target);
  if (!cut.reached) return false;
  double kept_mass = mass_above, kept_shifted = shifted_above;
  for (int64_t j = 0; j < inside; ++j) {
    const float v = w.sample[j];
    if (v < cut.value) {
      any_below = true;
      largest_below = std::max(largest_below, v);
    } else if constexpr (kStats) {
      kept_mass += w.sample_e[j];
      kept_shifted += static_cast<double>(w.sample_e[j]) * (v * map.scale - z_max);
    }
  }
  out.threshold = any_below ? margin_between(cut.value, largest_below) : -kInf;
  // A row that keeps every token takes the kernels' plain path (bitwise), not these sums.
  out.summed = kStats && any_below;
  if (out.summed) out.stats = {z_max, static_cast<float>(kept_mass), static_cast<float>(kept_shifted)};
  return true;
}

// The threshold of a kept set given by `kept` (a functor of a SIMD vector and of one logit, an
// upper set of the logits): halfway between the smallest kept logit and the largest dropped one,
// or -inf when none is dropped (the kernels' plain path, bitwise). One pass; the row holds no NaN.
template <typename scalar_t, typename Kept>
GSPO_HOT_LOOP KeptRow margin_pass(const scalar_t* row, int64_t vocab, const Kept& kept) {
  const Vec inf(kInf), ninf(-kInf), one(1.f), zero(0.f);
  Vec small(kInf), big(-kInf), dropped_v(0.f);
  int64_t i = for_each_vec(row, vocab, [&](const Vec& v) {
    const Vec in = kept(v);
    // Plain min and max: the row holds no NaN here.
    small = at::vec::clamp_max(small, Vec::blendv(inf, v, in));
    big = at::vec::clamp_min(big, Vec::blendv(v, ninf, in));
    dropped_v = dropped_v + Vec::blendv(one, zero, in);
  });
  float smallest = min_lanes(small), largest_out = max_lanes(big);
  bool dropped = sum_lanes(dropped_v) > 0.f;
  for (; i < vocab; ++i) {
    const float x = static_cast<float>(row[i]);
    if (kept(x)) {
      smallest = std::min(smallest, x);
    } else {
      dropped = true;
      largest_out = std::max(largest_out, x);
    }
  }
  if (!dropped) return KeptRow{-kInf, false, {}};
  return KeptRow{margin_between(smallest, largest_out), false, {}};
}

// The kept sets' tests in margin_pass: the raw logit at least a bound, or z = x * scale at least
// a bound on z (monotone in x: an upper set of the logits too).
struct AtLeast {
  float lower;
  Vec operator()(const Vec& v) const { return v >= Vec(lower); }
  bool operator()(float x) const { return x >= lower; }
};
struct ScaledAtLeast {
  float scale, z_min;
  Vec operator()(const Vec& v) const { return v * Vec(scale) >= Vec(z_min); }
  bool operator()(float x) const { return x * scale >= z_min; }
};

// The filters alone on the row itself, with no float32 copy of it: its max, then one pass (from
// L2) for min-p without a soft-cap (z >= max z + log(min_p), the general path's float32 compare)
// and two for top-k (the candidates above a bound guessed from a strided sample, packed; then,
// when no dropped logit is among them, the margin pass). The general path copied the row to
// float32 scratch and read it there; min-p also mapped it into a second copy: min-p 0.1 at
// N = 4096, V = 32768 bf16 took 42-47 ms on two threads, top-k 50 about 60 (AVX-512 Xeon without
// BF16). Same thresholds, bit for bit.
template <typename scalar_t>
KeptRow min_p_alone(const scalar_t* row, int64_t vocab, const LogitMap& map, double min_p) {
  const float x_max = row_max(row, vocab);
  if (keeps_all(x_max, map)) return KeptRow{-kInf, false, {}};
  return margin_pass(row, vocab, ScaledAtLeast{map.scale, map(x_max) + static_cast<float>(std::log(min_p))});
}

template <typename scalar_t>
KeptRow top_k_alone(const scalar_t* row, int64_t vocab, const LogitMap& map, int64_t k, RowScratch& w) {
  const float x_max = row_max(row, vocab);
  if (keeps_all(x_max, map)) return KeptRow{-kInf, false, {}};
  const TopK cut = kth_largest(row, vocab, -kInf, k, w);
  if (cut.below > -kInf) return KeptRow{margin_between(cut.value, cut.below), false, {}};
  return margin_pass(row, vocab, AtLeast{cut.value});  // -inf when fewer than k logits: every one kept
}

template <typename scalar_t>
KeptRow row_threshold(const scalar_t* row, int64_t vocab, const LogitMap& map, const SamplingFilter& s, bool with_stats,
                      RowScratch& w) {
  const auto only = [](float threshold) { return KeptRow{threshold, false, {}}; };
  const bool top_k = s.top_k > 0 && s.top_k < vocab;
  if (s.min_p > 0.0 && !top_k && s.top_p >= 1.0 && !map.capped()) return min_p_alone(row, vocab, map, s.min_p);
  if (top_k && s.min_p <= 0.0 && s.top_p >= 1.0) return top_k_alone(row, vocab, map, s.top_k, w);
  w.x.resize(vocab);
  float* x = w.x.data();
  const float x_max = load_row(row, x, vocab);
  // A NaN, or +inf without a soft-cap: the row has no finite softmax and keeps every token, so
  // its results stay NaN (a soft-capped +inf is a finite z). An all -inf row keeps every token.
  if (keeps_all(x_max, map)) return only(-kInf);
  const float z_max = map(x_max);
  if (s.min_p > 0.0 || s.top_p < 1.0) w.e.resize(vocab);
  float lower = -kInf;  // the kept set so far: {x >= lower}
  if (s.min_p > 0.0) {  // z >= max z + log(min_p), in float32 as the reference computes it
    map_row(x, w.e.data(), vocab, map);  // z; top-p turns it into masses below
    lower = smallest_reaching(x, w.e.data(), vocab, z_max + static_cast<float>(std::log(s.min_p)));
  }
  if (s.top_k > 0 && s.top_k < vocab) {  // the k-th largest kept logit, ties with it kept
    const TopK cut = kth_largest(x, vocab, lower, s.top_k, w);
    lower = cut.value;
    // The last filter, with a dropped logit among its candidates: the margin with no pass.
    if (s.top_p >= 1.0 && cut.below > -kInf) return only(margin_between(cut.value, cut.below));
  }
  if (s.top_p < 1.0) {  // the softmax over the kept tokens, at the row's max (always kept)
    const double total = masses_row(x, w.e.data(), vocab, map, s.min_p > 0.0, z_max, lower);
    const double target = s.top_p * total;
    MassRange range;
    KeptRow kept;
    if (mass_bracket(w.e.data(), vocab, total, target, w.bracket, range) &&
        (with_stats && !map.capped() ? top_p_from_bracket<true>(w, vocab, range, target, map, z_max, kept)
                                     : top_p_from_bracket<false>(w, vocab, range, target, map, z_max, kept))) {
      return kept;
    }
    lower = std::max(lower, top_p_bound(w, vocab, lower, target));
  }
  return margin_pass(x, vocab, AtLeast{lower});
}

}  // namespace

SamplingFilter sampling_filter(int64_t top_k, double top_p, double min_p) {
  TORCH_CHECK(top_p > 0.0 && min_p <= 1.0, "gspo_kernels: top_p must be > 0 and min_p <= 1; got ", top_p, " and ",
              min_p);
  return {top_k, top_p, min_p};
}

struct KeptSelector::Scratch {
  RowScratch rows;
};

KeptSelector::KeptSelector(const LogitMap& map, const SamplingFilter& filter, bool with_stats)
    : map_(map), filter_(filter), with_stats_(with_stats), scratch_(std::make_unique<Scratch>()) {}

KeptSelector::~KeptSelector() = default;

KeptRow KeptSelector::operator()(const float* row, int64_t vocab) {
  return row_threshold(row, vocab, map_, filter_, with_stats_, scratch_->rows);
}
KeptRow KeptSelector::operator()(const at::BFloat16* row, int64_t vocab) {
  return row_threshold(row, vocab, map_, filter_, with_stats_, scratch_->rows);
}
KeptRow KeptSelector::operator()(const at::Half* row, int64_t vocab) {
  return row_threshold(row, vocab, map_, filter_, with_stats_, scratch_->rows);
}

namespace {

at::Tensor kept_thresholds(const at::Tensor& logits, double inv_temperature, double softcap, int64_t top_k,
                           double top_p, double min_p) {
  check_logits(logits, c10::kCPU);
  const LogitMap map = logit_map(inv_temperature, softcap);
  const SamplingFilter filter = sampling_filter(top_k, top_p, min_p);
  const RowLayout layout = row_layout(logits);
  at::Tensor out = at::empty(logits.sizes().slice(0, logits.dim() - 1), logits.options().dtype(at::kFloat));
  float* dst = out.data_ptr<float>();
  GSPO_DISPATCH_LOGITS(logits.scalar_type(), "gspo_kernels::kept_thresholds", [&] {
    const scalar_t* base = logits.const_data_ptr<scalar_t>();
    at::parallel_for(0, layout.rows, 1, [&](int64_t begin, int64_t end) {
      KeptSelector select(map, filter, false);
      for (int64_t row = begin; row < end; ++row) dst[row] = select(base + layout.offset(row), layout.vocab).threshold;
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(gspo_kernels, CPU, m) { m.impl("kept_thresholds", &kept_thresholds); }

}  // namespace gspo::cpu
