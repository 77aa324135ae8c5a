// Top-p's search on the masses alone: a narrow range [lo, hi) of masses e = exp(z - z_max) in
// which the cut lies, found by passes over e only (one float32 array, not the logits beside it).
// top_p_cut.cpp then settles the cut on the logits of that range, with float64 sums, and checks
// that the range is also a range of logits (e rises with x; the exp's rounding could break that
// by an ulp, and the check then sends the row down the search on the logits).
//
// Each round estimates, from a strided sample of the candidates, where the mass below the cut
// is reached (the sample estimates the mass below, not above: every mass below the cut is at
// most the cut's, so a heavy value the sample misses cannot weigh on it), and puts two pivots
// some sampled ranks either side; one pass sums the mass at or above each and packs the
// candidates between them; the range between, above or below them, whichever holds the cut, is
// the next round's. On N(0, 2^2) logits at top-p 0.9, V = 32768, three rounds leave about 150.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "row_select.h"
#include "row_vec.h"

namespace gspo::cpu {

// A range of masses [lo, hi) (hi = +inf: no top), the mass at or above hi and inside it; by
// float32 sums, which only pick the range: the float64 sums that decide the cut come after.
struct MassRange {
  float lo, hi;
  double above, inside;
};

struct BracketScratch {
  std::vector<float> a, b;
};

constexpr int64_t kBracketSize = 256;  // candidates left when the search stops
constexpr int64_t kBracketMost = 4096;  // candidates the finish takes when ties stop the search
constexpr int64_t kPivotSample = 128;  // sampled candidates a round
constexpr int kBracketRounds = 8;

inline uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

inline float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

struct Pivots {
  float low, high;
};

// The pivots of a round, from every stride-th of c[0:n], binned by their float bits (which order
// non-negative floats; a bin spans a fixed fraction of an octave) in place of a sort: a sort of
// 128 values took a tenth of top-p's row (std::sort, AVX-512 Xeon).
inline Pivots sample_pivots(const float* c, int64_t n, const MassRange& r, double below_cut) {
  constexpr int kBins = 128;
  const int64_t stride = std::max<int64_t>(1, n / kPivotSample);
  // Masses under `floor` together weigh under 2^-16 of the mass below the cut: one bin.
  const float floor = std::max(r.lo, static_cast<float>(below_cut / static_cast<double>(n) * 0x1p-16));
  const uint32_t base = float_bits(floor);
  uint32_t top = base;
  for (int64_t i = 0; i < n; i += stride) top = std::max(top, float_bits(c[i]));
  int shift = 0;
  while (((top - base) >> shift) >= static_cast<uint32_t>(kBins)) ++shift;
  int32_t counts[kBins] = {};
  double mass[kBins] = {};
  int64_t m = 0;
  for (int64_t i = 0; i < n; i += stride, ++m) {
    const uint32_t bin = (std::max(float_bits(c[i]), base) - base) >> shift;
    ++counts[bin];
    mass[bin] += c[i];
  }
  const int last = static_cast<int>((top - base) >> shift);
  int at = last;  // the bin where the estimated mass below reaches below_cut
  int64_t rank = 0;  // sampled values below that bin
  double estimate = 0.0;
  for (int b = 0; b <= last; ++b) {
    estimate += mass[b] * static_cast<double>(stride);
    if (estimate >= below_cut) {
      at = b;
      break;
    }
    rank += counts[b];
  }
  // Ranks to spare either side: the sampled rank of the cut is off by about its square root.
  const int64_t spare = 2 + static_cast<int64_t>(1.5 * std::sqrt(static_cast<double>(std::min(rank, m - rank) + 1)));
  int lo_bin = at, hi_bin = at;
  for (int64_t got = 0; lo_bin > 0 && got < spare;) got += counts[--lo_bin];
  for (int64_t got = 0; hi_bin < last && got < spare;) got += counts[++hi_bin];
  const float low = lo_bin == 0 ? r.lo : std::max(r.lo, bits_float(base + (static_cast<uint32_t>(lo_bin) << shift)));
  const float high =
      hi_bin == last ? r.hi : std::min(r.hi, bits_float(base + (static_cast<uint32_t>(hi_bin + 1) << shift)));
  return {low, high};
}

// One pass over c[0:n]: the masses at or above each pivot (float32 lanes) and, into `between`,
// the candidates in [low, high), in order; returns their count.
struct PivotPass {
  double high, low;
  int64_t between;
};

inline PivotPass pivot_pass(const float* c, int64_t n, Pivots p, float* between) {
  int64_t out = 0, i = 0;
  double sum_high = 0.0, sum_low = 0.0;
#if defined(CPU_CAPABILITY_AVX512)
  const __m512 vhigh = _mm512_set1_ps(p.high), vlow = _mm512_set1_ps(p.low);
  __m512 h = _mm512_setzero_ps(), l = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    prefetch_ahead(c + i);
    const __m512 v = _mm512_loadu_ps(c + i);
    const __mmask16 at_high = _mm512_cmp_ps_mask(v, vhigh, _CMP_GE_OQ);
    const __mmask16 at_low = _mm512_cmp_ps_mask(v, vlow, _CMP_GE_OQ);
    h = _mm512_mask_add_ps(h, at_high, h, v);
    l = _mm512_mask_add_ps(l, at_low, l, v);
    const __mmask16 mid = _kandn_mask16(at_high, at_low);
    _mm512_storeu_ps(between + out, _mm512_maskz_compress_ps(mid, v));
    out += __builtin_popcount(mid);
  }
  sum_high = _mm512_reduce_add_ps(h);
  sum_low = _mm512_reduce_add_ps(l);
#else
  const Vec vhigh(p.high), vlow(p.low), zero(0.f);
  Vec h(0.f), l(0.f);
  for (; i + Vec::size() <= n; i += Vec::size()) {
    prefetch_ahead(c + i);
    const Vec v = Vec::loadu(c + i);
    h = h + Vec::blendv(zero, v, v >= vhigh);
    l = l + Vec::blendv(zero, v, v >= vlow);
  }
  sum_high = sum_lanes(h);
  sum_low = sum_lanes(l);
  out = compress_in_range(c, c, nullptr, i, {p.low, p.high, false}, between, nullptr);
#endif
  for (; i < n; ++i) {
    sum_high += c[i] >= p.high ? c[i] : 0.f;
    sum_low += c[i] >= p.low ? c[i] : 0.f;
    between[out] = c[i];
    out += c[i] >= p.low && c[i] < p.high;
  }
  return {sum_high, sum_low, out};
}

// The range of positive masses holding top-p's cut among e[0:n] (the mass at or above the cut
// reaches target, the mass above it does not; total is all of e's), with at most kBracketSize
// masses in it, or kBracketMost where ties stop the rounds; false past that (a flat row).
inline bool mass_bracket(const float* e, int64_t n, double total, double target, BracketScratch& w, MassRange& out) {
  constexpr float kInf = std::numeric_limits<float>::infinity();
  MassRange r{std::numeric_limits<float>::denorm_min(), kInf, 0.0, total};
  const float* c = e;
  for (int round = 0; round < kBracketRounds && n > kBracketSize; ++round) {
    const Pivots p = sample_pivots(c, n, r, r.inside - (target - r.above));
    std::vector<float>& dst = c == w.a.data() ? w.b : w.a;
    if (dst.size() < static_cast<size_t>(n + 16)) dst.resize(static_cast<size_t>(n + 16));
    const PivotPass pass = pivot_pass(c, n, p, dst.data());
    MassRange next;
    if (r.above + pass.high >= target) {
      next = {p.high, r.hi, r.above, pass.high};
    } else if (r.above + pass.low >= target) {
      next = {p.low, p.high, r.above + pass.high, pass.low - pass.high};
    } else {
      next = {r.lo, p.low, r.above + pass.low, r.inside - pass.low};
    }
    int64_t kept = pass.between;
    if (next.lo != p.low || next.hi != p.high) {  // the cut is not between the pivots: pack the side that holds it
      kept = compress_in_range(c, c, nullptr, n, {next.lo, next.hi, next.hi == kInf}, dst.data(), nullptr);
    }
    if (kept == 0 || !(next.lo < next.hi)) return false;  // none left: the float32 sums a rounding off
    // No progress: the candidates are runs of a few masses (ties of 16-bit logits), which no
    // pivot splits; the range as it is goes to the finish if it is not too long.
    if (kept == n) break;
    c = dst.data();
    n = kept;
    r = next;
  }
  if (n > kBracketMost) return false;
  out = r;
  return true;
}

}  // namespace gspo::cpu
