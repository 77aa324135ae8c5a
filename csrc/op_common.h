// Host-side pieces shared by the CPU and CUDA ops: argument checks, the row layout, the dtype
// dispatch and the two gradient entry points. The Python wrapper validates user input first;
// these checks keep the raw ops safe on their own.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <c10/util/Exception.h>
#include <algorithm>
#include <optional>
#include <utility>
#include <vector>

#include "gspo_math.h"

namespace gspo {

inline RowLayout row_layout(const at::Tensor& t) {
  TORCH_CHECK(t.dim() == 2 || t.dim() == 3, "gspo_kernels: logits must be (B, T, V) or (N, V); got ",
              t.dim(), " dims");
  const int64_t vocab = t.size(-1);
  TORCH_CHECK(t.stride(-1) == 1 || vocab == 1, "gspo_kernels: the vocab dimension must have stride 1");
  if (t.dim() == 3) {
    const int64_t batch = t.size(0), seq = t.size(1);
    return {batch * seq, seq > 0 ? seq : 1, t.stride(0), t.stride(1), vocab};
  }
  const int64_t n = t.size(0);
  return {n, n > 0 ? n : 1, 0, t.stride(0), vocab};
}

inline void check_logits(const at::Tensor& logits, c10::DeviceType device) {
  TORCH_CHECK(logits.device().type() == device, "gspo_kernels: logits on ", logits.device(),
              " reached the ", c10::DeviceTypeName(device), " kernel");
  const auto dtype = logits.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
              "gspo_kernels: logits must be float32, bfloat16 or float16; got ", dtype);
  TORCH_CHECK(logits.size(-1) > 0, "gspo_kernels: logits have an empty vocab dimension");
}

inline void check_row_vector(const char* name, const at::Tensor& t, const at::Tensor& logits,
                             int64_t rows, at::ScalarType dtype) {
  TORCH_CHECK(t.device() == logits.device(), "gspo_kernels: ", name, " must be on ", logits.device());
  TORCH_CHECK(t.scalar_type() == dtype, "gspo_kernels: ", name, " must be ", dtype, "; got ",
              t.scalar_type());
  // Any shape with one element a row: the token shape (B, T) or (N,), read as rows at stride 1.
  TORCH_CHECK(t.numel() == rows && t.is_contiguous(), "gspo_kernels: ", name, " must be contiguous with ", rows,
              " elements (one a logits row); got shape ", t.sizes(), (t.is_contiguous() ? "" : ", not contiguous"));
}

// The logit map from the ops' float arguments (the Python side checked them; a raw op call
// with a negative cap or a non-positive scale is refused here).
inline LogitMap logit_map(double inv_temperature, double softcap) {
  TORCH_CHECK(inv_temperature > 0.0 && softcap >= 0.0, "gspo_kernels: inv_temperature must be > 0 and softcap >= 0; got ",
              inv_temperature, " and ", softcap);
  return {static_cast<float>(inv_temperature), static_cast<float>(softcap)};
}

// What the gradient kernels read besides the logits, checked once for both devices.
struct GradInputs {
  const at::Tensor& targets;
  const at::Tensor& lse;
  const at::Tensor& entropy;
  const at::Tensor& grad_logp;
  const std::optional<at::Tensor>& grad_entropy;
  const std::optional<at::Tensor>& row_mask;
  const std::optional<at::Tensor>& kept_min;  // the sampler's kept set: x >= kept_min per row

  void check(const at::Tensor& logits, int64_t rows) const {
    check_row_vector("targets", targets, logits, rows, at::kLong);
    check_row_vector("lse", lse, logits, rows, at::kFloat);
    check_row_vector("entropy", entropy, logits, rows, at::kFloat);
    check_row_vector("grad_logp", grad_logp, logits, rows, at::kFloat);
    if (grad_entropy.has_value()) {
      check_row_vector("grad_entropy", *grad_entropy, logits, rows, at::kFloat);
    }
    if (row_mask.has_value()) {
      check_row_vector("row_mask", *row_mask, logits, rows, at::kBool);
    }
    if (kept_min.has_value()) {
      check_row_vector("kept_min", *kept_min, logits, rows, at::kFloat);
    }
  }
};

// Whether no two elements of `t` can share memory, by a sufficient test: with the dims of size
// > 1 sorted by stride, each stride must pass the largest offset the smaller ones reach. It
// accepts every dense or sliced layout (logits[:, :-1]) and refuses expand()ed and as_strided
// views whose rows overlap, which an in-place gradient would silently corrupt.
inline bool elements_disjoint(const at::Tensor& t) {
  std::vector<std::pair<int64_t, int64_t>> dims;  // (stride, size)
  for (int64_t d = 0; d < t.dim(); ++d) {
    if (t.size(d) == 0) return true;
    if (t.size(d) > 1) dims.emplace_back(t.stride(d), t.size(d));
  }
  std::sort(dims.begin(), dims.end());
  int64_t reach = 0;
  for (const auto& [stride, size] : dims) {
    if (stride <= reach) return false;
    reach += stride * (size - 1);
  }
  return true;
}

// A device's gradient launcher: writes dLoss/dlogits into `grad` (which may be `logits`).
using GradLauncher = void (*)(const at::Tensor& logits, at::Tensor& grad, const GradInputs& inputs,
                              const LogitMap& map);

// gspo_kernels::logits_grad: the gradient in a new buffer shaped like the logits.
template <GradLauncher kLaunch>
at::Tensor logits_grad_op(const at::Tensor& logits, const at::Tensor& targets, const at::Tensor& lse,
                          const at::Tensor& entropy, const at::Tensor& grad_logp,
                          const std::optional<at::Tensor>& grad_entropy, const std::optional<at::Tensor>& row_mask,
                          double inv_temperature, double softcap, const std::optional<at::Tensor>& kept_min) {
  at::Tensor grad = at::empty(logits.sizes(), logits.options());
  kLaunch(logits, grad, {targets, lse, entropy, grad_logp, grad_entropy, row_mask, kept_min},
          logit_map(inv_temperature, softcap));
  return grad;
}

// gspo_kernels::logits_grad_: the gradient written over the logits.
template <GradLauncher kLaunch>
void logits_grad_inplace_op(at::Tensor& logits, const at::Tensor& targets, const at::Tensor& lse,
                            const at::Tensor& entropy, const at::Tensor& grad_logp,
                            const std::optional<at::Tensor>& grad_entropy, const std::optional<at::Tensor>& row_mask,
                            double inv_temperature, double softcap, const std::optional<at::Tensor>& kept_min) {
  TORCH_CHECK(elements_disjoint(logits),
              "gspo_kernels: logits_grad_ needs logits whose rows do not share memory; use logits_grad");
  kLaunch(logits, logits, {targets, lse, entropy, grad_logp, grad_entropy, row_mask, kept_min},
          logit_map(inv_temperature, softcap));
}

}  // namespace gspo

// Instantiates the body for the three logits dtypes the kernels take (no float64).
#define GSPO_DISPATCH_LOGITS(TYPE, NAME, ...)                       \
  AT_DISPATCH_SWITCH(TYPE, NAME,                                     \
                     AT_DISPATCH_CASE(at::ScalarType::Float, __VA_ARGS__) \
                     AT_DISPATCH_CASE(at::ScalarType::BFloat16, __VA_ARGS__) \
                     AT_DISPATCH_CASE(at::ScalarType::Half, __VA_ARGS__))

