// Per-element math of the GSPO kernels, shared by the CPU and CUDA code.
//
// Softmax statistics of a set of logits z (already divided by the temperature):
//     max = max z,  sum = sum exp(z - max),  shifted = sum exp(z - max) * (z - max)
// give lse = max + log(sum) and the entropy H = log(sum) - shifted / sum. Shifting by the
// max before summing z * exp(z) keeps H accurate for logits far from zero. Two such triples
// over disjoint sets merge exactly (merge_stats), which is all the online loop needs: a
// kernel takes the stats of a small block of logits at the block's own max, then merges.
//
// The element-wise functions are templates over a math policy `Ops` that supplies
//     static T exp(T);            // e^x: 0 for -inf, NaN for NaN
//     static T max(T a, T b);     // plain max (which operand a NaN yields does not matter here)
//     static T fma(T a, T b, T c);
// so the same formula runs on scalars (CUDA threads) and on SIMD vectors (the CPU kernel).
#pragma once

#include <cmath>
#include <cstdint>

#if defined(__CUDACC__)
#define GSPO_HD __host__ __device__ __forceinline__
#else
#define GSPO_HD inline
#endif

namespace gspo {

struct SoftmaxStats {
  float max;
  float sum;
  float shifted;
};

GSPO_HD SoftmaxStats empty_stats() { return {-INFINITY, 0.f, 0.f}; }

// A set with no finite logit has max = -inf: shifting by 0 instead keeps exp() NaN-free.
GSPO_HD float finite_or_zero(float m) { return m == -INFINITY ? 0.f : m; }

GSPO_HD SoftmaxStats merge_stats(const SoftmaxStats& x, const SoftmaxStats& y) {
  const float m = fmaxf(x.max, y.max);
  const float shift = finite_or_zero(m);
  const float wx = expf(x.max - shift);
  const float wy = expf(y.max - shift);
  // (max_i - m) * sum_i is 0 * -inf for an empty set; its true contribution is 0.
  const float ax = x.shifted + (x.sum > 0.f ? (x.max - shift) * x.sum : 0.f);
  const float ay = y.shifted + (y.sum > 0.f ? (y.max - shift) * y.sum : 0.f);
  return {m, wx * x.sum + wy * y.sum, wx * ax + wy * ay};
}

struct RowResult {
  float max;
  float log_sum;
  float lse;
  float entropy;

  // log p of a (temperature-scaled) logit: (z - max) - log(sum) rather than z - lse, so large
  // logits lose nothing to the rounding of lse. z rounded differently from the max (an fma
  // against a rounded product) could put it a rounding above 0; a NaN stays NaN.
  GSPO_HD float logprob(float z) const {
    const float lp = (z - max) - log_sum;
    return lp > 0.f ? 0.f : lp;
  }
};

GSPO_HD RowResult finish_stats(const SoftmaxStats& st) {
  const float log_sum = logf(st.sum);
  // The entropy is >= 0; the CPU kernels' polynomial exp gives e^0 a few ulp under 1, so a row
  // with one finite logit had sum < 1 and an entropy of about -1e-7 (found by the long fuzz).
  // A NaN stays NaN.
  const float entropy = log_sum - st.shifted / st.sum;
  return {st.max, log_sum, st.max + log_sum, entropy < 0.f ? 0.f : entropy};
}

// log-probabilities below this are probability 0 in fp32 (e^-104 is under the smallest
// subnormal). Clamping a log-prob or shifted logit there changes no value, but keeps a
// product with p == 0 finite where it would be 0 * -inf = NaN (a -inf logit).
constexpr float kLogFloor = -200.f;

// Adds one shifted logit d = z - shift (or a vector of them) to block sums:
// sum += e^d, shifted += e^d * d. A -inf logit adds 0; a NaN makes both sums NaN.
template <class Ops, class T>
GSPO_HD void accumulate_shifted(T d, T& sum, T& shifted) {
  const T e = Ops::exp(d);
  sum = sum + e;
  shifted = Ops::fma(e, Ops::max(d, T(kLogFloor)), shifted);
}

// dLoss/dx for one vocab entry, without the one-hot term, from log p = z - lse:
//     -p * (g + h * (log p + H)) / temperature
// with the caller passing neg_g = -g / temperature and neg_h = -h / temperature.
template <class Ops, bool kEntropyGrad, class T>
GSPO_HD T softmax_grad_term(T log_p, T entropy, T neg_g, T neg_h) {
  const T p = Ops::exp(log_p);
  if constexpr (kEntropyGrad) {
    return p * Ops::fma(neg_h, Ops::max(log_p, T(kLogFloor)) + entropy, neg_g);
  } else {
    return p * neg_g;  // finite coefficient: p == 0 gives 0, a NaN stays NaN
  }
}

// What stage 3 does with a row, before any logit is read. Rows outside the loss get zeros
// whatever they hold; a row in the loss with no finite softmax (a NaN or +inf logit, or all
// -inf) or an out-of-range target gets NaN, never a finite-looking value; a row whose upstream
// gradients are both 0 gets zeros (what the formula gives for a finite softmax) unread.
enum class RowAction { kZero, kNaN, kCompute };

GSPO_HD RowAction row_action(bool in_loss, float lse, int64_t target, int64_t vocab, float g, float h) {
  if (!in_loss) return RowAction::kZero;
  if (!(fabsf(lse) < INFINITY) || target < 0 || target >= vocab) return RowAction::kNaN;
  return (g == 0.f && h == 0.f) ? RowAction::kZero : RowAction::kCompute;
}

// The logit map: the softmax is taken of z = scale * x, or with a soft-cap (cap > 0) of
// z = cap * tanh(scale * x), x the stored logit. config.kernel_logit_map sets scale and cap so
// that z = softcap_c(x * logit_scale) / temperature (the model's scale, its soft-cap, then the
// trainer's temperature). z is increasing in x (scale > 0), so a row's max maps to z's max; a
// soft-capped z is finite for every x but NaN (tanh(+-inf) = +-1), so +-inf logits have a
// softmax there. slope(z) = dz/dx, from z: exactly 0 where z saturates at +-cap.
struct LogitMap {
  float scale;
  float cap;  // 0: no soft-cap

  GSPO_HD bool capped() const { return cap > 0.f; }
  GSPO_HD float operator()(float x) const { return capped() ? cap * tanhf(x * scale) : x * scale; }
  // Through t = z / cap (exactly +-1 where z saturated at +-cap): the slope there is exactly 0,
  // as in float64, so that an infinite input times it stays NaN as the reference's does.
  GSPO_HD float slope(float z) const {
    if (!capped()) return scale;
    const float t = z / cap;
    return scale * cap * (1.f - t * t);
  }
};

// Where row r of a (B, T, V) or (N, V) tensor starts, in elements. Two strides let a kernel
// read logits[:, :-1] without a copy; packed (N, V) is rows_per_batch = N, stride_b = 0.
// int64 throughout: N * V passes 2^31 at N = 14k, V = 152k.
struct RowLayout {
  int64_t rows;
  int64_t rows_per_batch;
  int64_t stride_b;
  int64_t stride_t;
  int64_t vocab;

  GSPO_HD int64_t offset(int64_t row) const {
    return (row / rows_per_batch) * stride_b + (row % rows_per_batch) * stride_t;
  }
};

}  // namespace gspo
