// The softmax of each row over its kept entries (gspo_kernels/token_stats/kept_softmax.py says what
// each value is and holds the PyTorch ops every other device runs): the entries' mapped logits z
// (float32, CSR rows by offsets), a row at a time, SIMD over its entries, with gspo_math.h's
// per-element terms (accumulate_shifted, softmax_grad_term), as the CPU kernels take them.
//
//   kept_softmax_stats(z, offsets, target_pos) -> (logp, entropy, lse)
//   kept_softmax_grad(z, offsets, target_pos, lse, entropy, grad_logp, grad_entropy?, row_mask?,
//                     inv_temperature, softcap) -> dx, each entry's dLoss / d raw logit
//
// One pass over a row's entries for each (two for the stats: its max first), against the ~20 passes
// of the PyTorch ops over all entries: at k = 512 ids a row, N = 2048, 20 ms went to those ops on a
// 2-core AMX Xeon. A row's sums run in a fixed order whatever the other rows (batch invariance).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>

#include "../gspo_math.h"
#include "row_vec.h"

namespace gspo::cpu {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr int64_t kRowGrain = 64;

void check_rows(const char* op, const at::Tensor& z, const at::Tensor& offsets, const at::Tensor& target_pos) {
  TORCH_CHECK(z.device().is_cpu() && z.scalar_type() == at::kFloat && z.is_contiguous() && z.dim() == 1, op,
              ": z must be a contiguous 1-D float32 CPU tensor");
  TORCH_CHECK(offsets.scalar_type() == at::kLong && offsets.is_contiguous() && offsets.dim() == 1, op,
              ": offsets must be contiguous int64");
  TORCH_CHECK(target_pos.scalar_type() == at::kLong && target_pos.is_contiguous() &&
                  target_pos.numel() == offsets.numel() - 1,
              op, ": target_pos must be contiguous int64, one per row");
}

// The max of x[0:n], NaN if one is NaN.
float row_max(const float* x, int64_t n) {
  const int64_t n_vec = n - n % Vec::size();
  Vec vmax(-kInf);
  for (int64_t i = 0; i < n_vec; i += Vec::size()) vmax = at::vec::maximum(vmax, Vec::loadu(x + i));
  float m = max_lanes(vmax);
  for (int64_t i = n_vec; i < n; ++i) m = std::isnan(x[i]) ? x[i] : std::max(m, x[i]);
  return m;
}

// One row's entries x[0:n], its target at entry `target` (-1: none): log p, entropy, lse.
GSPO_HOT_LOOP void stats_row(const float* x, int64_t n, int64_t target, float& lp, float& ent, float& ls) {
  const float peak = row_max(x, n);
  if (std::isnan(peak) || peak == kInf) {  // a NaN or +inf kept logit: no softmax
    lp = ent = ls = kNaN;
    return;
  }
  const float shift = finite_or_zero(peak);
  const int64_t n_vec = n - n % Vec::size();
  const Vec vshift(shift);
  Vec vsum(0.f), vshifted(0.f);
  for (int64_t i = 0; i < n_vec; i += Vec::size()) {
    accumulate_shifted<VecOps>(Vec::loadu(x + i) - vshift, vsum, vshifted);
  }
  float sum = sum_lanes(vsum), shifted = sum_lanes(vshifted);
  for (int64_t i = n_vec; i < n; ++i) accumulate_shifted<ScalarOps>(x[i] - shift, sum, shifted);
  const float log_sum = std::log(sum);  // -inf for an empty set or all -inf
  ls = shift + log_sum;
  ent = log_sum - shifted / sum;
  // No distribution (an empty set, all -inf): NaN, as log_softmax gives. A target not among the
  // entries (another rank's slice, or outside the set): -inf.
  lp = sum == 0.f ? kNaN : (target >= 0 ? (x[target] - shift) - log_sum : -kInf);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> kept_softmax_stats(const at::Tensor& z, const at::Tensor& offsets,
                                                                  const at::Tensor& target_pos) {
  const char* op = "gspo_kernels::kept_softmax_stats";
  check_rows(op, z, offsets, target_pos);
  const int64_t rows = offsets.numel() - 1;
  at::Tensor logp = at::empty({rows}, z.options()), entropy = at::empty({rows}, z.options()),
             lse = at::empty({rows}, z.options());
  const float* zs = z.data_ptr<float>();
  const int64_t* off = offsets.data_ptr<int64_t>();
  const int64_t* tp = target_pos.data_ptr<int64_t>();
  float *lp = logp.data_ptr<float>(), *ent = entropy.data_ptr<float>(), *ls = lse.data_ptr<float>();
  at::parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      stats_row(zs + off[r], off[r + 1] - off[r], tp[r] >= 0 ? tp[r] - off[r] : -1, lp[r], ent[r], ls[r]);
    }
  });
  return {logp, entropy, lse};
}

// dz/dx of the logit map at z: inv_temperature, or with a soft-cap inv_temperature * cap * (1 - t^2),
// t = z / cap (LogitMap::slope, a vector of them).
Vec map_slope(const Vec& z, const LogitMap& map) {
  if (!map.capped()) return Vec(map.scale);
  const Vec t = z / Vec(map.cap);
  return Vec(map.scale * map.cap) * (Vec(1.f) - t * t);
}

// One live row's entries x[0:n] into d: each entry's gradient term times dz/dx, the one-hot term at
// `target` (-1: none). kEntropy: with the entropy term (h its upstream gradient).
template <bool kEntropy>
GSPO_HOT_LOOP void grad_row(const float* x, float* d, int64_t n, int64_t target, float lse, float ent, float g, float h,
              const LogitMap& map) {
  // dz/dx only where dz is not 0 (a -inf logit's slope may be infinite).
  auto scalar_dx = [&](float xi, float one_hot) {
    const float dz = softmax_grad_term<ScalarOps, kEntropy>(xi - lse, ent, -g, -h) + one_hot;
    return dz == 0.f ? 0.f : dz * map.slope(xi);
  };
  const Vec vlse(lse), vent(ent), vneg_g(-g), vneg_h(-h), vzero(0.f);
  const int64_t n_vec = n - n % Vec::size();
  for (int64_t i = 0; i < n_vec; i += Vec::size()) {
    const Vec zi = Vec::loadu(x + i);
    const Vec term = softmax_grad_term<VecOps, kEntropy>(zi - vlse, vent, vneg_g, vneg_h);
    Vec::blendv(term * map_slope(zi, map), vzero, term == vzero).store(d + i);
  }
  for (int64_t i = n_vec; i < n; ++i) d[i] = scalar_dx(x[i], 0.f);
  if (target >= 0) d[target] = scalar_dx(x[target], g);  // the one-hot term, at the target's entry
}

at::Tensor kept_softmax_grad(const at::Tensor& z, const at::Tensor& offsets, const at::Tensor& target_pos,
                             const at::Tensor& lse, const at::Tensor& entropy, const at::Tensor& grad_logp,
                             const c10::optional<at::Tensor>& grad_entropy, const c10::optional<at::Tensor>& row_mask,
                             double inv_temperature, double softcap) {
  const char* op = "gspo_kernels::kept_softmax_grad";
  check_rows(op, z, offsets, target_pos);
  const int64_t rows = offsets.numel() - 1;
  for (const at::Tensor* t : {&lse, &entropy, &grad_logp}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->numel() == rows, op,
                ": lse, entropy and grad_logp must be contiguous float32, one per row");
  }
  TORCH_CHECK(!grad_entropy.has_value() || (grad_entropy->scalar_type() == at::kFloat &&
                                            grad_entropy->is_contiguous() && grad_entropy->numel() == rows),
              op, ": grad_entropy must be contiguous float32, one per row");
  TORCH_CHECK(!row_mask.has_value() || (row_mask->scalar_type() == at::kBool && row_mask->is_contiguous() &&
                                        row_mask->numel() == rows),
              op, ": row_mask must be contiguous bool, one per row");
  const LogitMap map{static_cast<float>(inv_temperature), static_cast<float>(softcap)};
  at::Tensor dx = at::empty_like(z);
  const float* zs = z.data_ptr<float>();
  const int64_t* off = offsets.data_ptr<int64_t>();
  const int64_t* tp = target_pos.data_ptr<int64_t>();
  const float *ls = lse.data_ptr<float>(), *ent = entropy.data_ptr<float>(), *g = grad_logp.data_ptr<float>();
  const float* h = grad_entropy.has_value() ? grad_entropy->data_ptr<float>() : nullptr;
  const bool* mask = row_mask.has_value() ? row_mask->data_ptr<bool>() : nullptr;
  float* out = dx.data_ptr<float>();
  at::parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* x = zs + off[r];
      float* d = out + off[r];
      const int64_t n = off[r + 1] - off[r];
      const bool in_loss = mask == nullptr || mask[r];
      const float hr = h == nullptr ? 0.f : h[r];
      if (in_loss && !std::isfinite(ls[r])) {  // the row rule: no finite softmax in the loss
        std::fill_n(d, n, kNaN);
        continue;
      }
      if (!in_loss || (g[r] == 0.f && hr == 0.f)) {
        std::fill_n(d, n, 0.f);
        continue;
      }
      const int64_t target = tp[r] >= 0 ? tp[r] - off[r] : -1;
      if (h == nullptr) {
        grad_row<false>(x, d, n, target, ls[r], ent[r], g[r], 0.f, map);
      } else {
        grad_row<true>(x, d, n, target, ls[r], ent[r], g[r], hr, map);
      }
    }
  });
  return dx;
}

// Per row, the entry of its target among the row's ids, or -1: one pass over the entries, where
// the PyTorch ops (a gather of the targets, a compare, a scatter max) took 9 ms of an 85 ms
// fused-linear step at k = 512 on a 2-core AMX Xeon (N = 2048). A row's ids are distinct
// (KeptTokens checks them once), so the first match is the only one.
at::Tensor kept_target_positions(const at::Tensor& offsets, const at::Tensor& ids, const at::Tensor& targets) {
  const char* op = "gspo_kernels::kept_target_positions";
  for (const at::Tensor* t : {&offsets, &ids, &targets}) {
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kLong && t->is_contiguous() && t->dim() == 1, op,
                ": offsets, ids and targets must be contiguous 1-D int64 CPU tensors");
  }
  const int64_t rows = offsets.numel() - 1;
  TORCH_CHECK(rows >= 0 && targets.numel() == rows, op, ": targets must have one id per row (offsets.numel() - 1)");
  at::Tensor out = at::empty({rows}, targets.options());
  const int64_t *off = offsets.data_ptr<int64_t>(), *id = ids.data_ptr<int64_t>(), *y = targets.data_ptr<int64_t>();
  int64_t* pos = out.data_ptr<int64_t>();
  TORCH_CHECK(rows == 0 || (off[0] == 0 && off[rows] == ids.numel()), op, ": offsets must run from 0 to ids.numel()");
  at::parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t* hit = std::find(id + off[r], id + off[r + 1], y[r]);
      pos[r] = hit == id + off[r + 1] ? -1 : hit - id;
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(gspo_kernels, CPU, m) {
  m.impl("kept_target_positions", &kept_target_positions);
  m.impl("kept_softmax_stats", &kept_softmax_stats);
  m.impl("kept_softmax_grad", &kept_softmax_grad);
}

}  // namespace gspo::cpu
