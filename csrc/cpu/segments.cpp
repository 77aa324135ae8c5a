// CPU segment ops: the per-sequence sums and the per-row gather of a packed batch, each one op
// where torch needs three (a float64 cast, segment_reduce, a cast back) or four (the row ->
// sequence index, then index_select). Each segment is summed on its own, in float64, in row
// order: no value in one sequence can reach another, and the result is the same whatever the
// thread count.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>

#include "../segment_common.h"

namespace gspo::cpu {
namespace {

at::Tensor segment_sum(const at::Tensor& x_in, const at::Tensor& cu_in) {
  const int64_t k = check_segment_sum_input(x_in, cu_in);
  TORCH_CHECK(x_in.device().is_cpu(), "gspo_kernels: segment_sum's CPU kernel got ", x_in.device());
  const at::Tensor x = x_in.contiguous();
  const int64_t* cu = cu_in.const_data_ptr<int64_t>();
  const int64_t segments = cu_in.numel() - 1, rows = x.size(0);
  at::Tensor out = segment_sum_output(x, cu_in);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "gspo_kernels::segment_sum", [&] {
    const scalar_t* src = x.const_data_ptr<scalar_t>();
    scalar_t* dst = out.data_ptr<scalar_t>();
    at::parallel_for(0, segments, 64, [&](int64_t begin, int64_t end) {
      for (int64_t s = begin; s < end; ++s) {
        // Bounds clamped into [0, rows]: an invalid cu_seqlens is refused by the caller's
        // check, and must not make this op read out of bounds before then.
        const int64_t first = std::clamp<int64_t>(cu[s], 0, rows);
        const int64_t last = std::clamp<int64_t>(cu[s + 1], first, rows);
        for (int64_t c = 0; c < k; ++c) {
          double acc = 0.0;
          for (int64_t r = first; r < last; ++r) acc += static_cast<double>(src[r * k + c]);
          dst[s * k + c] = static_cast<scalar_t>(acc);
        }
      }
    });
  });
  return out;
}

at::Tensor segment_expand(const at::Tensor& v_in, const at::Tensor& cu_in, int64_t rows) {
  check_segment_expand_input(v_in, cu_in, rows);
  TORCH_CHECK(v_in.device().is_cpu(), "gspo_kernels: segment_expand's CPU kernel got ", v_in.device());
  const at::Tensor v = v_in.contiguous();
  const int64_t* cu = cu_in.const_data_ptr<int64_t>();
  const int64_t segments = cu_in.numel() - 1;
  at::Tensor out = at::empty({rows}, v.options());
  AT_DISPATCH_ALL_TYPES_AND3(at::kBool, at::kHalf, at::kBFloat16, v.scalar_type(), "gspo_kernels::segment_expand", [&] {
    const scalar_t* src = v.const_data_ptr<scalar_t>();
    scalar_t* dst = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 4096, [&](int64_t begin, int64_t end) {
      // The segment of `begin` (the last s with cu[s] <= begin; rows outside every segment,
      // possible only with an invalid cu_seqlens, take the nearest one), then walk forward.
      int64_t s = std::upper_bound(cu + 1, cu + segments + 1, begin) - (cu + 1);
      for (int64_t r = begin; r < end; ++r) {
        while (s < segments - 1 && cu[s + 1] <= r) ++s;
        dst[r] = src[std::min(s, segments - 1)];
      }
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(gspo_kernels, CPU, m) {
  m.impl("segment_sum", &segment_sum);
  m.impl("segment_expand", &segment_expand);
}

}  // namespace gspo::cpu
