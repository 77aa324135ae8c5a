// Argument checks and output shapes of the two segment ops, shared by the CPU and CUDA files.
// A segment is the rows cu_seqlens[s] .. cu_seqlens[s + 1] of a packed batch: one sequence.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

namespace gspo {

inline void check_cu_seqlens(const at::Tensor& cu, const at::Tensor& values) {
  TORCH_CHECK(cu.scalar_type() == at::kLong && cu.dim() == 1 && cu.numel() >= 2 && cu.is_contiguous(),
              "gspo_kernels: cu_seqlens must be a contiguous int64 (S + 1,) vector with S >= 1");
  TORCH_CHECK(cu.device() == values.device(), "gspo_kernels: cu_seqlens must be on ", values.device());
}

// segment_sum's input: (N,) or (N, k) floats; returns k (1 for a vector).
inline int64_t check_segment_sum_input(const at::Tensor& x, const at::Tensor& cu) {
  check_cu_seqlens(cu, x);
  TORCH_CHECK(x.dim() == 1 || x.dim() == 2, "gspo_kernels: segment_sum takes (N,) or (N, k) values; got ",
              x.dim(), " dims");
  TORCH_CHECK(at::isFloatingType(x.scalar_type()), "gspo_kernels: segment_sum takes floats; got ",
              x.scalar_type());
  return x.dim() == 2 ? x.size(1) : 1;
}

inline at::Tensor segment_sum_output(const at::Tensor& x, const at::Tensor& cu) {
  const int64_t segments = cu.numel() - 1;
  return x.dim() == 2 ? at::empty({segments, x.size(1)}, x.options()) : at::empty({segments}, x.options());
}

inline void check_segment_expand_input(const at::Tensor& v, const at::Tensor& cu, int64_t rows) {
  check_cu_seqlens(cu, v);
  TORCH_CHECK(v.dim() == 1 && v.numel() == cu.numel() - 1,
              "gspo_kernels: segment_expand takes one value per segment, (S,); got shape ", v.sizes());
  TORCH_CHECK(rows >= 0, "gspo_kernels: segment_expand needs rows >= 0");
}

}  // namespace gspo
