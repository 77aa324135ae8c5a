// Top-p's cut on the CPU: the smallest logit u of a row's kept set so far {x >= lower} such that
// the mass of the logits above u is below top_p of the set's whole mass, with no sort of the row.
// The masses first (masses_row: one exp a logit, the whole summed in float64), then a search on
// the masses alone (mass_bracket.h) settled on the logits of the bracket it finds
// (top_p_from_bracket), or, when that bracket is not a range of logits too, the search on the
// logits (top_p_bound). Top-p's decisions are float64 sums of float32 masses, as the float64
// sampler's are (token_stats/kept_set.py states the rules). The search on the masses took top-p
// 0.9 from 65-73 to 40-42 us a row on one thread (N(0, 2^2) bf16 logits, V = 32768; AVX-512 Xeon
// without BF16), 0.5 and 0.99 alike.
#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "../gspo_math.h"
#include "kept_row_scratch.h"
#include "mass_bracket.h"
#include "row_select.h"
#include "row_vec.h"
#include "top_p_cut.h"

namespace gspo::cpu {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

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

}  // namespace

TopPCut top_p_cut(RowScratch& w, int64_t vocab, const LogitMap& map, const TopPQuery& q) {
  const double total = masses_row(w.x.data(), w.e.data(), vocab, map, q.z_in_e, q.z_max, q.lower);
  const double target = q.top_p * total;
  MassRange range;
  TopPCut cut{false, {}, q.lower};
  if (mass_bracket(w.e.data(), vocab, total, target, w.bracket, range) &&
      (q.with_stats && !map.capped() ? top_p_from_bracket<true>(w, vocab, range, target, map, q.z_max, cut.row)
                                     : top_p_from_bracket<false>(w, vocab, range, target, map, q.z_max, cut.row))) {
    cut.settled = true;
    return cut;
  }
  cut.lower = top_p_bound(w, vocab, q.lower, target);
  return cut;
}

}  // namespace gspo::cpu
