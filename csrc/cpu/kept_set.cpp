// The sampler's kept set on the CPU: per row, the threshold t on the raw logits such that the
// tokens vLLM's sampler keeps (min-p, then top-k, then top-p) are exactly {x >= t}, with no sort
// of the row (token_stats/kept_set.py states the rules; its PyTorch pre-pass is the reference).
//
// Each filter keeps an upper set of the raw logits, so the kept set is always {x >= lower} and
// every filter only raises `lower`: min-p by one compare with the row's max z; top-k by a
// selection among the logits above a bound guessed from a strided sample of the row and checked
// by an exact SIMD pass (kth_largest); top-p by a search on the masses (top_p_cut.cpp). The
// selections themselves are radix selects with no branch per element, or for ranks below 64 a
// pass by max per rank (row_select.h). Min-p alone without a soft-cap, and top-k alone, read the
// row itself (min_p_alone, top_k_alone); the others a float32 copy of it. A first version, a
// 12/12/8-bit radix select of the whole row (a scalar scatter of every logit into bins), took
// 353 ms for top-k at N = 4096, V = 32768 bf16 against 79 ms for the plain forward kernel (2-core
// AVX-512 + AMX Xeon). Rows run in parallel; each thread holds a float32 copy of one row and its
// z or masses (kept_row_scratch.h).
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
#include "kept_row_scratch.h"
#include "kept_set.h"
#include "row_select.h"
#include "row_vec.h"
#include "top_p_cut.h"

namespace gspo::cpu {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

// A row's kept set given by its threshold alone (no softmax sums on the way).
inline KeptRow threshold_only(float threshold) { return KeptRow{threshold, false, {}}; }

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
  return threshold_only(dropped ? margin_between(smallest, largest_out) : -kInf);
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
  if (keeps_all(x_max, map)) return threshold_only(-kInf);
  return margin_pass(row, vocab, ScaledAtLeast{map.scale, map(x_max) + static_cast<float>(std::log(min_p))});
}

template <typename scalar_t>
KeptRow top_k_alone(const scalar_t* row, int64_t vocab, const LogitMap& map, int64_t k, RowScratch& w) {
  const float x_max = row_max(row, vocab);
  if (keeps_all(x_max, map)) return threshold_only(-kInf);
  const TopK cut = kth_largest(row, vocab, -kInf, k, w);
  if (cut.below > -kInf) return threshold_only(margin_between(cut.value, cut.below));
  return margin_pass(row, vocab, AtLeast{cut.value});  // -inf when fewer than k logits: every one kept
}

template <typename scalar_t>
KeptRow row_threshold(const scalar_t* row, int64_t vocab, const LogitMap& map, const SamplingFilter& s, bool with_stats,
                      RowScratch& w) {
  const bool top_k = s.top_k > 0 && s.top_k < vocab;
  if (s.min_p > 0.0 && !top_k && s.top_p >= 1.0 && !map.capped()) return min_p_alone(row, vocab, map, s.min_p);
  if (top_k && s.min_p <= 0.0 && s.top_p >= 1.0) return top_k_alone(row, vocab, map, s.top_k, w);
  w.x.resize(vocab);
  float* x = w.x.data();
  const float x_max = load_row(row, x, vocab);
  // A NaN, or +inf without a soft-cap: the row has no finite softmax and keeps every token, so
  // its results stay NaN (a soft-capped +inf is a finite z). An all -inf row keeps every token.
  if (keeps_all(x_max, map)) return threshold_only(-kInf);
  const float z_max = map(x_max);
  if (s.min_p > 0.0 || s.top_p < 1.0) w.e.resize(vocab);
  float lower = -kInf;  // the kept set so far: {x >= lower}
  if (s.min_p > 0.0) {  // z >= max z + log(min_p), in float32 as the reference computes it
    map_row(x, w.e.data(), vocab, map);  // z; top-p turns it into masses below
    lower = smallest_reaching(x, w.e.data(), vocab, z_max + static_cast<float>(std::log(s.min_p)));
  }
  if (top_k) {  // the k-th largest kept logit, ties with it kept
    const TopK cut = kth_largest(x, vocab, lower, s.top_k, w);
    lower = cut.value;
    // The last filter, with a dropped logit among its candidates: the margin with no pass.
    if (s.top_p >= 1.0 && cut.below > -kInf) return threshold_only(margin_between(cut.value, cut.below));
  }
  if (s.top_p < 1.0) {  // the softmax over the kept tokens, at the row's max (always kept)
    const TopPCut cut = top_p_cut(w, vocab, map, {s.top_p, z_max, lower, s.min_p > 0.0, with_stats});
    if (cut.settled) return cut.row;
    lower = std::max(lower, cut.lower);
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
